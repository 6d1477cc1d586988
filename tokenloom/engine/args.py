"""Every engine option in one place: its default, its command-line flag and its help, written once.

``EngineArgs`` is what ``LLM(model, **options)`` takes, what every CLI command that loads a model
reads back from its flags (``add_cli_args`` / ``from_cli_args``), and what builds the validated
configs the engine runs (``create_engine_config``). A command changes a default in one place:
``EngineArgs.add_cli_args(parser, defaults={"fair_share_seqs": 32})``.

Field metadata: ``flags`` (the option strings; none: not a flag), ``help``, and optionally
``metavar``, ``choices``, ``type`` (the flag's parser, when it differs from the field's: the KV cache
budget is GiB on the command line, bytes in Python) and ``commands`` (the commands that show the
flag; absent: every command that loads a model).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_lora_modules,
)
from tokenloom.quant.scheme import CHOICES as QUANT_CHOICES

GPU_DECODE_STEPS = 8  # decode_steps on a GPU with CUDA graphs (one host round trip per 8 tokens)
# max_num_batched_tokens by device: on the CPU, prompt chunks of 1,024 tokens prefill as fast as
# whole 4K prompts or faster and hold a quarter of their activations (docs/BENCHMARKS.md)
CPU_STEP_TOKENS = 1024
GPU_STEP_TOKENS = 8192


def _gib(text: str) -> int:
    """A --kv-cache-memory value: GiB on the command line -> bytes."""
    return int(float(text) * (1 << 30))


def _option(default: Any, *flags: str, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"flags": flags, "help": help, **extra})


@dataclass
class EngineArgs:
    """The engine's options with their defaults. ``create_engine_config`` validates them (a bad value
    is a ValueError naming the option) and resolves the ``auto``/None ones for the device."""

    model: str | None = _option(
        None,
        "-m",
        "--model",
        help="HF folder (config.json + safetensors + tokenizer.json), .gguf file, a name `tokenloom list` shows, or "
        "a Hugging Face Hub name: ORG/REPO, ORG/REPO:QUANT (a GGUF repo's Q4_K_M, Q8_0, ...), with @REVISION; "
        "fetched on first use. Default: SmolLM2-135M-Instruct",
    )
    hf_token: str | None = _option(
        None,
        "--hf-token",
        metavar="TOKEN",
        help="a Hugging Face token for gated and private Hub repos (default: $HF_TOKEN, or the one "
        "`huggingface-cli login` saved)",
    )
    cpu_threads: int | None = _option(
        None,
        "-t",
        "--threads",
        metavar="N",
        help="CPU threads, always N (default: one per physical core, fewer while other processes keep cores busy: "
        "threads that lose their core stall the others at every step)",
    )
    device: str = _option(
        "auto",
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs. auto (default): the GPU where CUDA has one, else the CPU",
    )
    dtype: str = _option(
        "auto",
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype. auto (default): on the CPU float32, and a GGUF file's quantized blocks "
        "kept as stored; on a GPU bfloat16 (a GGUF file dequantized to it at load); float32/bfloat16/float16 "
        "dequantize a GGUF file to that dtype (bf16/fp16 are slow on most CPUs)",
    )
    enforce_eager: bool = _option(
        False,
        "--enforce-eager",
        help="GPU: run decode steps op by op instead of replaying CUDA graphs captured at start-up",
    )
    decode_steps: int | None = _option(
        None,
        "--decode-steps",
        metavar="N",
        help=f"decode up to N tokens per engine step where every running request allows it, each fed back on the "
        f"device (one host round trip per N tokens; default: {GPU_DECODE_STEPS} on a GPU with CUDA graphs, "
        "else 1)",
    )
    max_model_len: int | None = _option(
        None,
        "-c",
        "--ctx-size",
        "--max-model-len",
        metavar="N",
        help="context window in tokens (default: the model's; -c/--ctx-size as llama.cpp, --max-model-len as vLLM)",
    )
    kv_cache_memory: int | None = _option(
        None,
        "--kv-cache-memory",
        metavar="GIB",
        type=_gib,
        help="memory for the KV cache in GiB (Python: bytes; default: what --kv-cache-contexts full contexts "
        "need, at most 1 GiB; or see --kv-cache-fraction)",
    )
    kv_cache_fraction: float | None = _option(
        None, "--kv-cache-fraction", metavar="F", help="size the KV cache as this fraction of the memory available now"
    )
    kv_cache_contexts: int | None = _option(
        None,
        "--kv-cache-contexts",
        metavar="N",
        help="without a KV cache budget, size the cache for N full contexts, at most 1 GiB (default: 1 for "
        "generate, chat and the tools, which run one conversation; serve and Python: 1 GiB)",
    )
    block_size: int = _option(16, "--block-size", metavar="N", help="tokens per KV cache block (default: 16)")
    enable_prefix_caching: bool = _option(
        True, "--no-prefix-caching", help="do not reuse the KV cache of shared prompt prefixes"
    )
    prefix_cache_dir: str | None = _option(
        None,
        "--prefix-cache-dir",
        metavar="DIR",
        help="keep the prefix cache's full blocks on disk too: blocks evicted from memory, and every cached "
        "block at exit, are saved there; a later prompt, in this process or after a restart, that starts "
        "with a saved prefix reads it back instead of computing it (safe for several processes at once)",
    )
    prefix_cache_disk: int = _option(
        8 << 30,
        "--prefix-cache-disk",
        metavar="GIB",
        type=_gib,
        help="GiB the prefix cache's disk tier may hold; the least recently used blocks go first (default: 8)",
    )
    window_blocks: bool = _option(
        True,
        "--no-window-blocks",
        help="keep every block in sliding-window layers too (by default they keep only the blocks their "
        "window reads, where the engine runs them so: one process on the CPU, without --prefix-cache-dir)",
    )
    kv_cache_dtype: str = _option(
        "auto",
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        help="auto: the model's dtype (float32 on the CPU); float16 / bfloat16: keys/values rounded to 16 bits "
        "(half of float32, llama.cpp's default f16 cache); int8: int8 with a scale per token and head (a quarter "
        "of float32); int4: llama.cpp's q4_0, 4 bits and a float16 scale per 32 (0.14x of float32)",
    )
    max_num_seqs: int = _option(
        64,
        "--max-num-seqs",
        metavar="N",
        commands=("serve",),
        help="requests in the running batch at most (default: 64)",
    )
    max_num_batched_tokens: int | None = _option(
        None,
        "--max-num-batched-tokens",
        metavar="N",
        commands=("serve",),
        help=f"tokens one engine step computes at most, prompt chunks and decodes together (default: "
        f"{CPU_STEP_TOKENS} on the CPU, {GPU_STEP_TOKENS} on a GPU)",
    )
    fair_share_seqs: int | None = _option(
        None,
        "--fair-share-seqs",
        metavar="N",
        commands=("serve",),
        help="while several clients run sequences, a step computes at most ceil(N / clients) of each client's "
        "(the others wait their turn), so one client's many sequences cannot slow every other client's tokens",
    )
    context_shift: bool | None = _option(
        False,
        "--context-shift",
        negatable=True,
        help="a sequence that fills the context drops its oldest tokens after the first --keep and goes on "
        "(llama.cpp's context shift; the kept keys are turned to their new positions, nothing is recomputed) "
        "instead of ending with finish reason 'length' (default: off; in `tokenloom chat` on where the model "
        "allows it (not for hybrids, DeepSeek's latent cache or GPT-2))",
    )
    context_keep: int = _option(
        4,
        "--keep",
        metavar="N",
        help="context shift keeps the first N tokens, rounded up to whole KV blocks (default: 4, attention sinks "
        "and the BOS; `tokenloom chat` keeps its system prompt)",
    )
    speculative: str | SpeculativeConfig | None = _option(
        None,
        "--speculative",
        metavar="SPEC",
        help="speculative decoding (lossless): 'ngram,k=4' (prompt lookup) or 'draft=PATH,k=4' (a smaller model with "
        "the same tokenizer); options max_batch=N (plain decoding above N running requests, default 8), "
        "min_acceptance=F, ngram_max/ngram_min",
    )
    quantization: str | None = _option(
        None,
        "--quantization",
        choices=list(QUANT_CHOICES),
        help="weight-only quantization of every Linear: int8 (per-channel), int4 (groups of 32; int4-g64/-g128 for "
        "larger groups), gguf (keep a GGUF file's own Q8_0/Q4_0/Q4_1 blocks)",
    )
    tensor_parallel_size: int = _option(
        1,
        "-tp",
        "--tensor-parallel-size",
        metavar="N",
        help="split the model over N processes (torch.distributed, gloo on CPU): started on this machine, or under "
        "torchrun (--nnodes, --master-addr) the same command on every node, rank 0 serving (Llama, Mistral, "
        "Qwen2/3 and their MoE models)",
    )
    lora: dict[str, str] | list[str] | None = _option(
        None,
        "--lora",
        metavar="NAME=PATH",
        action="append",
        commands=("serve", "generate", "chat"),
        help="load a LoRA adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors, or a GGUF LoRA "
        "file) under NAME; "
        "repeat for several. A request picks one by name (the server: its `model`), others run on the base model "
        "in the same batch",
    )
    enable_lora: bool = _option(
        False,
        "--enable-lora",
        commands=("serve",),
        help="let clients load and unload LoRA adapters at run time (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter: any adapter path this server can read), with room for --max-loras of them "
        "even when --lora gives none",
    )
    max_loras: int = _option(
        4,
        "--max-loras",
        metavar="N",
        commands=("serve",),
        help="LoRA adapters resident at once, each mixed into any batch (default: 4)",
    )
    max_lora_rank: int = _option(
        16,
        "--max-lora-rank",
        metavar="R",
        commands=("serve", "generate", "chat"),
        help="the largest LoRA rank an adapter may have; each resident slot reserves room for it (default: 16)",
    )
    lora_dtype: str = _option(
        "auto",
        "--lora-dtype",
        commands=("serve", "generate", "chat"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="how resident LoRA adapters are stored (computed in float32). auto (default): bfloat16 or float16 "
        "where every --lora adapter is stored so (at its own precision, half the bytes a token reads), "
        "else float32",
    )
    pipeline_parallel_size: int = _option(
        1,
        "-pp",
        "--pipeline-parallel-size",
        metavar="N",
        help="split the model's layers into N stages, one process each, micro-batches in flight (for slow links "
        "between machines, where it beats tensor parallelism); launched as --tensor-parallel-size",
    )

    # -- the command line ---------------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, command: str | None = None, defaults: dict[str, Any] | None = None
    ) -> None:
        """Add the flags `command` shows (those without a ``commands`` list, and those naming it) to
        `parser`, in one "model and engine" group, with `defaults` replacing the fields' own."""
        defaults = defaults or {}
        unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"no engine option named {', '.join(sorted(unknown))}")
        group = parser.add_argument_group("model and engine")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta.get("flags") or ("commands" in meta and command not in meta["commands"]):
                continue
            default = defaults.get(f.name, f.default)
            help_text = meta["help"]
            if f.name in defaults and "default:" not in help_text:
                help_text += f" (default: {default})"
            if meta.get("negatable"):  # --x and --no-x: a command may turn it on by default
                group.add_argument(
                    *meta["flags"], dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
                continue
            if isinstance(f.default, bool):
                action = "store_false" if f.default else "store_true"
                group.add_argument(*meta["flags"], dest=f.name, action=action, default=default, help=help_text)
                continue
            kwargs = {k: meta[k] for k in ("metavar", "choices", "action") if k in meta}
            group.add_argument(
                *meta["flags"],
                dest=f.name,
                default=default,
                help=help_text,
                type=meta.get("type", _flag_type(f)),
                **kwargs,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options a parsed command line holds (fields without a flag there keep their defaults)."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**given)

    # -- the configs --------------------------------------------------------------------------------

    def resolved_device(self) -> str:
        """auto -> cuda where torch sees a GPU, else cpu; cuda without one is a ValueError."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU)")
        return self.device

    def check(self) -> None:
        """The checks that need no model, before any weights load: a TypeError for an option of the
        wrong type, a ValueError naming the option for a bad value (the configs' own checks)."""
        self._configs()

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig these options describe (the model name resolved to a path)."""
        from tokenloom.loader.hub import resolve_model

        config = self._configs()
        config.model = resolve_model(self.model, token=self.hf_token)
        return config

    def _configs(self) -> EngineConfig:
        """The configs, each validated by its ``__post_init__``, the model not yet resolved."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if str(f.type).startswith("int") and value is not None and (type(value) is not int):
                raise TypeError(f"{f.name} must be an integer, got {value!r}")
        device = self.resolved_device()
        decode_steps = self.decode_steps
        if decode_steps is None:
            decode_steps = GPU_DECODE_STEPS if device == "cuda" and not self.enforce_eager else 1
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_fraction=self.kv_cache_fraction,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_contexts=self.kv_cache_contexts,
            prefix_cache_dir=self.prefix_cache_dir,
            prefix_cache_disk=self.prefix_cache_disk,
            window_blocks=self.window_blocks,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens
            or (GPU_STEP_TOKENS if device == "cuda" else CPU_STEP_TOKENS),
            fair_share_seqs=self.fair_share_seqs,
            decode_steps=decode_steps,
            context_shift=self.context_shift,
            context_keep=self.context_keep,
        )
        speculative = (
            SpeculativeConfig.parse(self.speculative) if isinstance(self.speculative, str) else self.speculative
        )
        lora = None
        if self.lora or self.enable_lora:
            lora = LoRAConfig(
                parse_lora_modules(self.lora),
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                dtype=self.lora_dtype,
                runtime_updates=self.enable_lora,
            )
        return EngineConfig(
            model=self.model or "",
            lora=lora,
            dtype=self.dtype,
            device=device,
            max_model_len=self.max_model_len,
            cache=cache,
            scheduler=scheduler,
            speculative=speculative,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enforce_eager=self.enforce_eager,
            cpu_threads=self.cpu_threads,
        )


def _flag_type(f: dataclasses.Field) -> Any:
    """The parser of a flag for field `f`, from its annotation (a string under postponed annotations)."""
    annotation = str(f.type)
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str
