"""One entry point: a path (HF folder or .gguf file) -> model + tokenizer."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tokenloom.distributed.pipeline import Pipeline, PipelineStage
from tokenloom.distributed.shard import TensorParallelError, TensorShard
from tokenloom.layers.grouped import GroupedLinear
from tokenloom.loader.safetensors import CheckpointError, hf_eos_ids, iter_safetensors, read_json, safetensors_files
from tokenloom.loader.weights import load_weights
from tokenloom.memory import huge_pages
from tokenloom.memory.allocator import release_free_memory
from tokenloom.models.base import CausalLM
from tokenloom.models.config import ModelConfig, parse_dtype
from tokenloom.models.registry import model_class
from tokenloom.quant import WeightFormat, parse_quantization, quantize_structure
from tokenloom.quant.checkpoint import describe_weights, formats_for, gguf_formats, load_saved_state, saved_formats
from tokenloom.quant.gguf.tensor import GGMLTensor
from tokenloom.sampling.defaults import FALLBACK, SamplingDefaults, from_generation_config, from_gguf_metadata
from tokenloom.tokenizer import Tokenizer

__all__ = ["CheckpointError", "LoadedModel", "build_model", "load_checkpoint", "load_model"]

GGUF_MAGIC = b"GGUF"

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A checkpoint translated into HF terms, tensors not yet read."""

    hf_config: dict
    config: ModelConfig  # hf_config validated: the architecture is one tokenloom runs
    tensors: Iterable[tuple[str, torch.Tensor | GGMLTensor]]
    num_tensors: int
    tokenizer: Tokenizer
    eos_token_ids: set[int]
    # HF tensor name -> the GGML type of the blocks it comes as (a GGUF file's, an MXFP4 folder's experts)
    tensor_types: dict[str, int] | None = None
    sampling_defaults: SamplingDefaults = FALLBACK  # the model's recommended sampling settings, if any
    weight_bytes: int = 0  # GGUF only: the bytes of its tensors (every shard's)
    is_gguf: bool = False


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    hf_config: dict
    sampling_defaults: SamplingDefaults = FALLBACK
    local_config: ModelConfig | None = None  # a tensor-parallel rank's share (its heads, KV heads); None: config
    kv_layers: range | None = None  # a pipeline stage's layers (whose KV it caches); None: all
    pipeline: Pipeline | None = None  # a pipeline stage: how its runner hands on each model call

    def __post_init__(self) -> None:
        if self.local_config is None:
            self.local_config = self.config


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def chat_template_of(path: str | Path) -> str | None:
    """The chat template of the checkpoint at `path` (None: it has none), read without its weights
    or vocabulary: a GGUF file's metadata key, an HF folder's tokenizer files."""
    path = Path(path).expanduser()
    if path.is_file() and _is_gguf(path):
        from tokenloom.loader.gguf import GGUFFile

        return GGUFFile(path).field("tokenizer.chat_template")
    from tokenloom.tokenizer import folder_chat_template

    return folder_chat_template(path) if path.is_dir() else None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF folder or a GGUF file; raises FileNotFoundError / CheckpointError with the reason.

    A GGUF file's quantized matrices come as GGMLTensors over the file's own blocks.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (expected an HF folder with "
            "config.json + *.safetensors, a .gguf file, a model name that "
            "`tokenloom list` shows, or a Hugging Face Hub name ORG/REPO[:QUANT])"
        )
    if path.is_file():
        if not _is_gguf(path):
            raise CheckpointError(f"{path} is neither a GGUF file nor a folder (no GGUF magic bytes)")
        from tokenloom.loader.gguf import GGUFFile

        g = GGUFFile(path)
        if not g.tensors:
            raise CheckpointError(
                f"{path} holds a vocabulary only, no weights (llama.cpp ships such files to "
                "test tokenizers): give a GGUF file with the model's weights"
            )
        hf_config = g.hf_config()
        return Checkpoint(
            hf_config,
            ModelConfig.from_hf(hf_config),
            g.iter_tensors(),
            len(g.tensors),
            g.tokenizer(),
            g.eos_token_ids(),
            g.tensor_types(),
            from_gguf_metadata(g.field),
            sum(t.nbytes for t in g.tensors),
            is_gguf=True,
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json; not an HF model folder")
    hf_config = read_json(config_path)
    config = ModelConfig.from_hf(hf_config)  # an unsupported model says so before its files are opened
    files = safetensors_files(path)
    tokenizer = Tokenizer.from_folder(path)
    eos = hf_eos_ids(path, hf_config)
    eos.update(t for t in [tokenizer.token_to_id(tokenizer.eos_token)] if t is not None)
    generation = path / "generation_config.json"
    defaults = from_generation_config(read_json(generation) if generation.is_file() else None)
    names = _tensor_names(files)
    return Checkpoint(
        hf_config,
        config,
        iter_safetensors(files),
        len(names),
        tokenizer,
        eos,
        model_class(config).stored_block_types(config, names),
        sampling_defaults=defaults,
    )


def _tensor_names(files: list[Path]) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                names += h.keys()
        except Exception as e:
            raise CheckpointError(f"{f} is corrupt or truncated: {e}") from e
    return names


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    format_of: Callable[[str], WeightFormat | None] | None = None,
    trim: Callable[[CausalLM], None] | None = None,
) -> CausalLM:
    """An uninitialized model (parameters allocated, not filled) on `device`.

    `format_of(module name)` picks a quantized format per nn.Linear (None: float); `trim` drops
    modules before anything is allocated (a pipeline stage's model holds its layers only).
    """
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype)
    if format_of is not None:
        quantize_structure(model, format_of, cls.input_embedding_name, config.tie_word_embeddings, dtype)
    if trim is not None:
        trim(model)
    # Module.to_empty's empty_like on meta tensors runs through torch._refs (slow, every load): plain empty instead
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    model.init_buffers(device)  # non-persistent float32 buffers: recomputed after the empty move
    return model.eval()


def _progress(tensors: Iterable, total: int, desc: str, show: bool) -> Iterator:
    show = show and sys.stderr.isatty()  # a bar in a log file is noise: only at a terminal
    return iter(tqdm(tensors, total=total, desc=desc, unit="tensor", disable=not show, leave=False))


def _trimmed(tensors: Iterator, every_bytes: int = 32 << 20) -> Iterator:
    """`tensors` as they come, the heap's free pages handed back after each `every_bytes` read:
    with freed memory kept in the process (allocator.keep_freed_memory), each tensor's conversion
    temporaries would otherwise stay resident, and the load's peak would be the weights plus
    all of them (a 0.5B GGUF: 1.0 GB peak for 0.7 GB after)."""
    read = 0
    for name, tensor in tensors:
        yield name, tensor
        read += tensor.nbytes if hasattr(tensor, "nbytes") else 0
        if read >= every_bytes:
            release_free_memory()
            read = 0


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    progress: bool = False,
    quantization: str | None = None,
    prepare: bool = True,
    shard: TensorShard | PipelineStage | None = None,
) -> LoadedModel:
    """Load weights and tokenizer; every checkpoint tensor must fill exactly one parameter.

    A GGUF file keeps its blocks as stored unless a `dtype` other than "auto" (dequantize
    to it) or a `quantization` other than "gguf" is asked for. `quantization` (int8,
    int4[-gN]) quantizes every Linear while loading, tensor by tensor; a folder saved by
    ``save_quantized`` loads in its own format. `prepare=False` skips the CPU layout
    changes (for saving the model again). With a tensor-parallel `shard`, the model is that rank's
    share (built from shard.local_config, each tensor cut by shard.narrow as it is read), to be
    wrapped by distributed.layers.parallelize; with a PipelineStage, that stage's layers (rank 0:
    and the embedding, final norm and LM head), the other tensors never read.
    ``LoadedModel.config`` is the whole model's.
    """
    quantization = parse_quantization(quantization)
    ckpt = load_checkpoint(path)
    # an HF folder's blocks (MXFP4 experts) are kept on the CPU, whose kernels run them in place;
    # elsewhere they are dequantized once at load rather than on every call
    on_cpu = torch.device(device).type == "cpu"
    has_blocks = ckpt.tensor_types is not None and (ckpt.is_gguf or on_cpu)
    keep_blocks = has_blocks and (quantization == "gguf" or (quantization is None and dtype == "auto"))
    if quantization == "gguf" and ckpt.tensor_types is None:
        raise ValueError(
            "--quantization gguf keeps a GGUF file's own blocks, but this checkpoint has none (not a GGUF "
            "file or an MXFP4 folder); use int8 or int4"
        )
    config = ckpt.config
    if max_model_len is not None:
        if max_model_len > config.context_limit():
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length {config.context_limit()}"
            )
        config.max_model_len = max_model_len
    config.eos_token_ids = tuple(sorted(set(config.eos_token_ids) | ckpt.eos_token_ids))
    saved = saved_formats(ckpt.hf_config, quantization)
    format_of = _format_of(ckpt, quantization, saved, keep_blocks)
    local, stage = _this_ranks_share(config, shard, quantized_folder=saved is not None)
    model = build_model(local, parse_dtype(dtype), device, format_of, None if stage is None else stage.trim)
    for module in model.modules():  # blocks as int8 codes where blocks are kept
        if isinstance(module, GroupedLinear):
            module.keep_blocks = keep_blocks
    release_free_memory()  # the tokenizer's and metadata's temporaries
    tensors = _share_of_tensors(ckpt, config, shard, keep_blocks, progress)
    if saved is not None:
        load_saved_state(model, tensors)
    else:
        # blocks re-laid as they load land in 2 MiB pages (no copy by prepare_for_inference)
        with huge_pages.weight_arena(ckpt.weight_bytes if keep_blocks and on_cpu else 0):
            load_weights(model, tensors)
    if keep_blocks:
        assert ckpt.tensor_types is not None  # blocks are kept where the checkpoint has them
        log.info("GGUF weights: %s", describe_weights(model, ckpt.tensor_types))
    if prepare:
        model.prepare_for_inference()
    release_free_memory()  # conversion temporaries: gone from the resident size
    if ckpt.tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {ckpt.tokenizer.vocab_size} tokens but the model only {config.vocab_size} embeddings"
        )
    return LoadedModel(
        model,
        config,
        ckpt.tokenizer,
        frozenset(config.eos_token_ids),
        ckpt.hf_config,
        ckpt.sampling_defaults,
        local,
        None if stage is None else stage.layers,
    )


def _format_of(ckpt: Checkpoint, quantization: str | None, saved: dict | None, keep_blocks: bool):
    """Parameter name -> the weight format it is built in: a quantized folder's own, a GGUF file's
    blocks kept, or what `quantization` asks for."""
    if saved is not None:
        return saved.get
    if keep_blocks:
        assert ckpt.tensor_types is not None  # blocks are kept where the checkpoint has them
        return gguf_formats(ckpt.tensor_types, ckpt.config.tie_word_embeddings, model_class(ckpt.config))
    return formats_for(quantization, model_class(ckpt.config))


def _this_ranks_share(
    config: ModelConfig, shard: TensorShard | PipelineStage | None, quantized_folder: bool
) -> tuple[ModelConfig, PipelineStage | None]:
    """The config this process builds its model from (a tensor-parallel rank's share) and its
    pipeline stage, each plan checked against the model first."""
    if isinstance(shard, TensorShard):
        shard.check(config, model_class(config))
        if quantized_folder:
            raise TensorParallelError(
                "tensor parallelism over a folder saved quantized is not implemented: load "
                "the original checkpoint with --quantization"
            )
        return shard.local_config(config), None
    if shard is not None:
        shard.check(config, model_class(config))
    return config, shard


def _share_of_tensors(
    ckpt: Checkpoint, config: ModelConfig, shard: TensorShard | PipelineStage | None, keep_blocks: bool, progress: bool
):
    """(name, tensor) of the checkpoint as this process loads them: a tensor-parallel rank's cut of
    each, a pipeline stage's own tensors only, or all of them."""
    tensors = _trimmed(_progress(ckpt.tensors, ckpt.num_tensors, "loading weights", progress))
    if isinstance(shard, TensorShard):
        dense = not keep_blocks  # blocks that become float anyway are cut as float
        return ((name, shard.narrow(name, _dense(t) if dense else t, config)) for name, t in tensors)
    if shard is not None:
        return ((name, t) for name, t in tensors if shard.owns(name))
    return tensors


def save_hf_folder(path: str | Path, folder: str | Path, progress: bool = True) -> None:
    """Convert any loadable checkpoint (e.g. a GGUF file) into an HF folder of float32 safetensors
    (GGUF blocks dequantized)."""
    from safetensors.torch import save_file

    ckpt = load_checkpoint(path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: _dense(t).contiguous()
        for name, t in _progress(ckpt.tensors, ckpt.num_tensors, f"preparing {Path(path).name}", progress)
    }
    save_file(tensors, str(folder / "model.safetensors"))
    write_folder_metadata(folder, ckpt.hf_config, ckpt.eos_token_ids, ckpt.tokenizer, ckpt.sampling_defaults)


def write_folder_metadata(
    folder: Path, hf_config: dict, eos_token_ids: set[int], tokenizer: Tokenizer, sampling: SamplingDefaults = FALLBACK
) -> None:
    """config.json, generation_config.json (with the model's own sampling settings, if it has
    any) and the tokenizer files of an HF folder."""
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {"bos_token_id": hf_config.get("bos_token_id"), "eos_token_id": sorted(eos_token_ids)}
    if sampling is not FALLBACK:
        generation |= {"do_sample": sampling.values["temperature"] > 0, **sampling.values}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save(folder)


def _dense(tensor):
    """A checkpoint tensor as float (GGUF blocks dequantized), for a model that keeps none."""
    from tokenloom.quant.gguf.tensor import GGMLTensor

    return tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor
