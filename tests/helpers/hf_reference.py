"""HF transformers as the oracle: a plain greedy loop over its own KV cache.

No generate() logits processors are involved (min_new_tokens would mask EOS and
change the argmax), so the reference is exactly "argmax of HF's logits".
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


def load_hf_reference(folder, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers' model of `folder` in eval mode, with its eager attention.

    Eager is the architecture as transformers writes it. Some releases route a model through
    SDPA, which drops what SDPA cannot express: transformers 5.17 ran Gemma 2 through SDPA and
    dropped its attention-score soft-capping (later releases refuse SDPA for Gemma 2)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", **kwargs
    ).eval()


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]  # chosen-token logprobs
    margins: list[float]  # top1 - top2 logit per step


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> Reference:
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)  # the last position's
    tokens, logprobs, margins = [], [], []
    for _ in range(new_tokens):
        logits = out.logits[0, -1].float()  # (vocab,)
        token = int(logits.argmax())
        top2 = logits.topk(2).values
        tokens.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        margins.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return Reference(tokens, logprobs, margins)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, transformers parses each GGUF file's metadata once, however often it
    opens it.

    ``from_pretrained(gguf_file=...)`` builds a fresh ``gguf.GGUFReader`` and converts every
    metadata value for the config, again for the weights, and again for the tokenizer; for
    Gemma-3's 262k-token vocabulary each reader and each conversion takes seconds. The reader
    is read-only after construction, so one per path serves every caller,
    and a metadata-only load (``return_tensors=False``) is answered from the first one's result
    (a deep copy, as callers may change it): the same tensors and metadata, in less time.
    The reader itself slices a plain array over the mapped file (_reader_over_plain_array), and
    the tensor-name map that transformers builds anew for each of a model's ~300 submodules
    (``gguf.get_tensor_name_map``) is built once per (architecture, layers): it is
    only read after construction.
    """
    import functools

    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    original_reader, original_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    original_name_map = gguf.get_tensor_name_map
    readers: dict[tuple[Path, str], object] = {}
    metadata: dict[Path, dict] = {}

    def shared_reader(path, mode="r"):
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = _reader_over_plain_array(original_reader, path, mode)
        return readers[key]

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = Path(path).resolve()
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return pickle.loads(pickle.dumps(metadata[key]))  # a deep copy: deepcopy takes seconds here

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = shared_reader, load_once
    gguf.get_tensor_name_map = functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = original_reader, original_load
        gguf.get_tensor_name_map = original_name_map


def _reader_over_plain_array(reader_class, path, mode: str):
    """``reader_class(path, mode)`` with its ``data`` a plain ndarray view of the np.memmap it maps.

    The reader parses metadata by slicing ``data`` a few times per value, ~10M slices for a
    262k-token vocabulary; a memmap slice runs memmap.__array_finalize__ in Python each time, a
    plain view of the same mapping does not (the same bytes, a third of the time)."""
    import numpy as np

    memmap = np.memmap

    def plain_view(*args, **kwargs):
        return memmap(*args, **kwargs).view(np.ndarray)  # the view keeps the mapping alive

    np.memmap = plain_view  # type: ignore[misc]
    try:
        return reader_class(path, mode)
    finally:
        np.memmap = memmap  # type: ignore[misc]
