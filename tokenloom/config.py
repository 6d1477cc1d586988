"""The engine's runtime configuration, each dataclass validated in ``__post_init__``: the KV
cache budget, the scheduler's step limits, speculative decoding, and ``EngineConfig`` holding them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloom.memory.probes import available_memory
from tokenloom.models.config import parse_dtype

KV_CACHE_DTYPES = ("auto", "int8", "int4", "float16", "bfloat16")  # --kv-cache-dtype (kv_cache/quantized.py)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry and budget.

    The budget is ``kv_cache_memory`` bytes if given, else ``kv_cache_fraction`` of
    the memory available now, else 1 GiB, or less where ``kv_cache_contexts`` full contexts
    need less (a CLI session runs one conversation: its context is all the cache it can use).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_contexts: int | None = None
    prefix_cache_dir: str | None = None  # the prefix cache's disk tier (kv_cache/disk_tier.py); None: none
    prefix_cache_disk: int = 8 << 30  # bytes the disk tier may hold
    # sliding-window layers keep only the blocks their window reads, in a pool of their own
    # (kv_cache/window_pool.py) where the engine runs them so (one process, the CPU, no disk tier)
    window_blocks: bool = True

    def __post_init__(self) -> None:
        if self.prefix_cache_disk <= 0:
            raise ValueError(f"prefix_cache_disk must be positive, got {self.prefix_cache_disk}")
        if self.prefix_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("prefix_cache_dir needs prefix caching (it is its disk tier)")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 0.9:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.9], got {self.kv_cache_fraction}")
        if self.kv_cache_contexts is not None and self.kv_cache_contexts < 1:
            raise ValueError(f"kv_cache_contexts must be >= 1, got {self.kv_cache_contexts}")

    def resolve_memory(self, bytes_per_token: int, max_model_len: int) -> int:
        """The KV cache budget in bytes, for a model whose token takes `bytes_per_token` in the
        cache and whose context is `max_model_len` tokens."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.kv_cache_fraction is not None:
            return int(self.kv_cache_fraction * available_memory())
        if self.kv_cache_contexts is not None:
            blocks = -(-max_model_len // self.block_size) * self.kv_cache_contexts + 1  # + the null block
            return min(1 << 30, blocks * self.block_size * bytes_per_token)
        return 1 << 30


@dataclass(slots=True)
class SchedulerConfig:
    """How much work one engine step may do."""

    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 8192  # tokens computed in one step (prefill + decode)
    fair_share_seqs: int | None = None  # per-step turns divided between clients (engine/fair_share.py)
    decode_steps: int = 1  # tokens a step may decode in a row when every request allows it
    # a sequence that fills the context drops its oldest tokens after the first context_keep
    # (engine/context_shift.py) instead of ending with "length"; None: where the model allows it
    # (the engine core settles it to True or False at start-up)
    context_shift: bool | None = False
    context_keep: int = 4  # tokens kept at the start (attention sinks), rounded up to whole blocks

    def __post_init__(self) -> None:
        if not isinstance(self.context_keep, int) or self.context_keep < 0:
            raise ValueError(f"context_keep must be an integer >= 0, got {self.context_keep!r}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.fair_share_seqs is not None and self.fair_share_seqs <= 0:
            raise ValueError(f"fair_share_seqs must be positive, got {self.fair_share_seqs}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class LoRAConfig:
    """LoRA adapters over the base model (tokenloom/lora/): those loaded at start-up, by name, and the
    room kept for them. `max_loras` adapters are resident at once (a slot each, loaded and unloaded at
    run time); `max_lora_rank` is the largest rank a slot holds (its memory is reserved up front)."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder or GGUF LoRA file
    max_loras: int = 4
    max_lora_rank: int = 16
    dtype: str = "auto"  # the slots' storage: auto (the start-up adapters' own half type, else float32) or a dtype
    runtime_updates: bool = False  # the server may load and unload adapters by request (--enable-lora)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.adapters = parse_lora_modules(self.adapters)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"lora_dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if len(self.adapters) > self.max_loras:
            raise ValueError(
                f"{len(self.adapters)} LoRA adapters given but max_loras is {self.max_loras}: raise --max-loras"
            )


def parse_lora_modules(given) -> dict[str, str]:
    """{name: path} from a dict, or from NAME=PATH strings / (name, path) pairs (the --lora flags);
    ValueError for a malformed entry or a name given twice."""
    if isinstance(given, dict):
        pairs = list(given.items())
    else:
        pairs = []
        for item in given or ():
            if isinstance(item, str):
                name, sep, path = item.partition("=")
                if not sep:
                    raise ValueError(f"--lora takes NAME=PATH, got {item!r}")
                item = (name, path)
            pairs.append(tuple(item))
    adapters: dict[str, str] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"a LoRA adapter needs a name and a path, got {name!r}={path!r}")
        if name.strip() in adapters:
            raise ValueError(f"LoRA adapter name {name.strip()!r} is given twice")
        adapters[name.strip()] = path.strip()
    return adapters


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding: propose k tokens per request, verify them in one target pass.

    ``method`` is "ngram" (prompt lookup: copy what followed the latest earlier match of
    the last n tokens, n from ``ngram_max`` down to ``ngram_min``) or "draft" (a smaller
    model with the same tokenizer at ``draft_model``). Speculation is skipped, and the
    step decodes plainly, when more than ``max_batch`` requests decode at once (the
    batch is compute bound there and verification costs more than it saves) and, per
    request, while its recent acceptance rate is below ``min_acceptance``.
    """

    method: str
    k: int = 4
    draft_model: str | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    max_batch: int = 8
    min_acceptance: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model path (draft=PATH)")
        if not 1 <= self.k <= 16:
            raise ValueError(f"speculative k must be in [1, 16], got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.max_batch < 1 or not 0 <= self.min_acceptance <= 1:
            raise ValueError("speculative max_batch must be >= 1 and min_acceptance in [0, 1]")

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """'ngram,k=4' or 'draft=PATH,k=4[,max_batch=8,...]' -> SpeculativeConfig."""
        head, *options = [part.strip() for part in spec.split(",") if part.strip()]
        method, _, path = head.partition("=")
        kwargs: dict = {"method": method, "draft_model": path or None}
        ints = ("k", "ngram_max", "ngram_min", "max_batch")
        for option in options:
            key, eq, value = option.partition("=")
            if not eq or key not in ints + ("min_acceptance",):
                raise ValueError(f"unknown speculative option {option!r}; options: {', '.join(ints)}, min_acceptance")
            try:
                kwargs[key] = int(value) if key in ints else float(value)
            except ValueError:
                raise ValueError(f"speculative option {key} needs a number, got {value!r}") from None
        return cls(**kwargs)


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs besides the weights; the CLI maps flags onto these fields."""

    model: str
    dtype: str = "auto"  # auto: float32 compute, GGUF blocks kept (CUDA: bfloat16); else the weights'
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own context length
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    quantization: str | None = None  # int8 | int4[-g32|-g64|-g128] | gguf (weights); None: float
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | int4 | float16 | bfloat16 (kv_cache/quantized.py)
    tensor_parallel_size: int = 1  # ranks the model is split over (distributed/); 1: this process alone
    pipeline_parallel_size: int = 1  # stages its layers are split into, one rank each (distributed/pipeline.py)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (worker/cuda_graphs.py)
    cpu_threads: int | None = None  # CPU: None follows the cores other processes leave free (engine/cpu_share.py)
    lora: LoRAConfig | None = None  # LoRA adapters (tokenloom/lora/); None: none can be loaded

    def __post_init__(self) -> None:
        from tokenloom.quant.scheme import parse_quantization

        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not implemented: give one of them")
        if self.lora is not None and self.world_size > 1:
            raise ValueError("LoRA adapters with a model split over processes are not implemented")
        parse_dtype(self.dtype)
        if self.dtype == "auto" and torch.device(self.device).type == "cuda":
            self.dtype = "bfloat16"  # what GPUs compute fastest (a GGUF file is dequantized to it at load)
        self.quantization = parse_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def world_size(self) -> int:
        """Processes the model runs on (tensor x pipeline parallel ranks)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
