"""Batch-1 speed of a loaded LLM: prefill tokens/s, decode tokens/s, time to first token, memory.

Used by ``tokenloom bench`` and the benchmark scripts; every figure is the median
over `runs` timed generations after one warm-up.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tokenloom.memory.probes import proc_kib_field


@dataclass
class SpeedReport:
    prompt_tokens: int
    new_tokens: int
    prefill_tok_s: float  # prompt tokens / time to first token
    decode_tok_s: float  # (new tokens - 1) / time after the first token
    ttft_s: float
    weight_bytes: int  # parameters and buffers of the model (packed/quantized as stored)
    bytes_per_token: int  # weight bytes one decode step reads (the embedding: one row)
    peak_rss_bytes: int  # the process's peak resident memory so far

    def as_dict(self) -> dict:
        return asdict(self)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied tensors counted once), and of GGUF blocks."""
    from tokenloom.quant.gguf.modules import GGMLEmbedding, GGMLLinear

    seen = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    blocks = sum(s.nbytes for m in model.modules() if isinstance(m, GGMLLinear) for _, s in m.segments)
    blocks += sum(m.weight_q.nbytes for m in model.modules() if isinstance(m, GGMLEmbedding) and m.weight_q is not None)
    return sum(t.numel() * t.element_size() for t in seen.values()) + blocks


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads: everything but the input embedding table,
    of which it reads one row, unless the output projection reads that same tensor."""
    from tokenloom.quant.gguf.modules import GGMLEmbedding

    total = model_bytes(model)
    embedding = model.get_submodule(str(model.input_embedding_name))
    if isinstance(embedding, GGMLEmbedding) and embedding.weight_q is not None:
        total -= embedding.weight_q.nbytes
    if isinstance(embedding, torch.nn.Embedding):
        head = model.lm_head
        if not (isinstance(head, torch.nn.Linear) and head.weight is embedding.weight):
            total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM (reset by exec, unlike ru_maxrss, which a
    child inherits from the parent it forked from)."""
    if (peak := proc_kib_field("/proc/self/status", "VmHWM")) is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(llm, prompt_tokens: int = 128, new_tokens: int = 64, runs: int = 3, seed: int = 0) -> SpeedReport:
    """Greedy generations of `new_tokens` after a random prompt of `prompt_tokens` ids, timed."""
    from tokenloom.sampling_params import SamplingParams

    vocab = llm.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prefill, decode, ttft = [], [], []
    for i in range(runs + 1):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()  # fresh: no prefix-cache hit
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        total = time.perf_counter() - start
        first = out.metrics.ttft
        if i == 0:
            continue  # warm-up
        ttft.append(first)
        prefill.append(prompt_tokens / first)
        decode.append((len(out.token_ids) - 1) / max(total - first, 1e-9))
    model = llm.engine.model
    return SpeedReport(
        prompt_tokens,
        new_tokens,
        statistics.median(prefill),
        statistics.median(decode),
        statistics.median(ttft),
        model_bytes(model),
        bytes_read_per_token(model),
        peak_rss_bytes(),
    )
