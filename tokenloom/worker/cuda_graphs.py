"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket, replayed.

A decode step of a small model is hundreds of small kernels; launched one by one from Python the
GPU idles between them. A graph launches them all in one call. What a replay may change is only
the *values* in the tensors the capture read, so every per-step input lives in one static device
buffer (int32), written each step by one host-to-device copy from a pinned twin:

    ids (B) | positions (B) | slots (B) | seq_lens (B) | query_start (B + 1) | block_offsets (B) | block_ids

with B the largest bucket, and block_ids the step's block tables one after another (the paged
attention kernel reads them flat), so a step copies the header and the blocks it names, never a
padded (B, longest table) matrix. A batch of n sequences runs in the smallest bucket >= n; rows
n..bucket are padding: slot -1 (the cache-write kernel skips it) and no context (the attention
kernel writes zeros), so they touch no sequence's cache and their outputs are never read.

Buckets are 1, 2, 4, 8, ... up to max_num_seqs (and max_num_seqs itself), captured at start-up,
largest first, into one shared memory pool. Prefill and mixed steps run eagerly. Only models
whose decode forward has no data-dependent Python (``CausalLM.replayable_layers``; a MoE router's
``.tolist()`` is) are captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenloom.attention import AttentionMetadata
from tokenloom.attention.metadata import PagedInputs
from tokenloom.worker.batch import SeqChunk

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below max_num_seqs, then max_num_seqs."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences; None when n is past the largest."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True, slots=True)
class StaticLayout:
    """Where each input sits in the static int32 buffer, for a largest bucket of `rows` sequences
    of up to `max_blocks` blocks each."""

    rows: int
    max_blocks: int

    @property
    def header(self) -> int:
        return 6 * self.rows + 1

    @property
    def size(self) -> int:
        return self.header + self.rows * self.max_blocks

    def views(self, buf):
        """(ids, positions, slots, seq_lens, query_start, block_offsets, block_ids) views of buf."""
        r = self.rows
        return (
            buf[:r],
            buf[r : 2 * r],
            buf[2 * r : 3 * r],
            buf[3 * r : 4 * r],
            buf[4 * r : 5 * r + 1],
            buf[5 * r + 1 : 6 * r + 1],
            buf[6 * r + 1 :],
        )


def fill_decode_inputs(
    host: np.ndarray, layout: StaticLayout, chunks: list[SeqChunk], bucket: int, block_size: int
) -> int:
    """Write one-token `chunks` into the host buffer for a replay of `bucket` rows (padding rows:
    slot -1, no context); returns how many leading int32s of the buffer the device needs."""
    n = len(chunks)
    ids, positions, slots, seq_lens, _, offsets, block_ids = layout.views(host)
    starts = [c.start for c in chunks]
    ids[:n] = [c.token_ids[0] for c in chunks]
    positions[:n] = starts
    slots[:n] = [c.block_ids[p // block_size] * block_size + p % block_size for c, p in zip(chunks, starts)]
    seq_lens[:n] = [p + 1 for p in starts]
    counts = [p // block_size + 1 for p in starts]  # blocks covering each context
    offsets[:n] = np.cumsum([0, *counts[:-1]])
    total = sum(counts)
    if total > len(block_ids):
        raise ValueError(f"decode batch names {total} blocks; the static buffer holds {len(block_ids)}")
    block_ids[:total] = [b for c, k in zip(chunks, counts) for b in c.block_ids[:k]]
    ids[n:bucket], positions[n:bucket], slots[n:bucket], seq_lens[n:bucket], offsets[n:bucket] = 0, 0, -1, 0, 0
    return layout.header + total


class StaticDecodeInputs:
    """The static buffer on the device, its pinned host twin, and what a bucket's replay reads."""

    def __init__(self, layout: StaticLayout, block_size: int, device: torch.device) -> None:
        self.layout, self.block_size, self.device = layout, block_size, torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.device_buf = torch.zeros(layout.size, dtype=torch.int32, device=self.device)
        self.host_buf = torch.zeros(layout.size, dtype=torch.int32, pin_memory=on_gpu)
        self.host = self.host_buf.numpy()
        views = layout.views(self.host)
        views[2][:] = -1  # no row writes the cache
        views[4][:] = np.arange(len(views[4]))  # one query per row
        self.device_buf.copy_(self.host_buf)
        self.copied = torch.cuda.Event() if on_gpu else None
        if self.copied is not None:
            self.copied.record()

    def model_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(ids, positions, meta) of a `bucket`-row forward: views of the device buffer."""
        ids, positions, slots, seq_lens, query_start, offsets, block_ids = self.layout.views(self.device_buf)
        paged = PagedInputs(seq_lens[:bucket], query_start[: bucket + 1], offsets[:bucket], block_ids, 1)
        meta = AttentionMetadata(
            slots[:bucket], list(range(bucket)), [1] * bucket, [1] * bucket, [], paged_inputs_=paged
        )
        return ids[:bucket], positions[:bucket], meta

    def load(self, chunks: list[SeqChunk], bucket: int) -> None:
        """Write one-token `chunks` (padded to `bucket` rows) into the device buffer: one copy,
        asynchronous on a GPU (the host buffer is not written again until it has left)."""
        if self.copied is not None:
            self.copied.synchronize()
        used = fill_decode_inputs(self.host, self.layout, chunks, bucket, self.block_size)
        self.device_buf[:used].copy_(self.host_buf[:used], non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    """One captured decode forward per bucket over static inputs; ``run`` replays the right one.

    ``forward(ids, positions, meta)`` -> hidden (T, hidden) is what gets captured (the model
    over the runner's KV cache); it must be capturable: no host syncs, no data-dependent Python.
    """

    def __init__(self, forward, sizes: list[int], max_blocks: int, block_size: int, device: torch.device) -> None:
        self.forward, self.sizes = forward, sizes
        self.inputs = StaticDecodeInputs(StaticLayout(sizes[-1], max_blocks), block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its memory); seconds taken."""
        started = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):
            self.capture(size)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def capture(self, bucket: int) -> None:
        ids, positions, meta = self.inputs.model_inputs(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compiled, library handles made
            for _ in range(2):
                self.forward(ids, positions, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(ids, positions, meta)
        self.pool = graph.pool()
        self.graphs[bucket], self.outputs[bucket] = graph, out

    def takes(self, chunks: list[SeqChunk]) -> bool:
        """Every chunk is one token, and a bucket holds them all."""
        return bool(chunks) and len(chunks) <= self.sizes[-1] and all(len(c.token_ids) == 1 for c in chunks)

    def run(self, chunks: list[SeqChunk], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the decode forward of one-token `chunks` -> hidden states (n, hidden): a view of the
        graph's output, valid until the next replay. `input_ids` (n,) on the device, where given,
        replace the chunks' tokens (a copy on the device, after the inputs' upload)."""
        bucket = bucket_for(len(chunks), self.sizes)
        assert bucket is not None  # takes(chunks): a bucket holds them
        self.inputs.load(chunks, bucket)
        if input_ids is not None:
            self.inputs.layout.views(self.inputs.device_buf)[0][: len(chunks)].copy_(input_ids)
        return self.replay(bucket)[: len(chunks)]

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the `bucket` graph over what the static buffer holds now: its output (bucket, hidden)."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]


def start_decode_graphs(model, kv_cache, max_num_seqs: int, max_model_len: int) -> DecodeGraphs | None:
    """Capture the decode graphs of `model` over `kv_cache`, or None (logged) where its forward cannot
    be captured. Logs the capture's time."""
    if not type(model).replayable_layers:
        log.info("CUDA graphs off: %s picks experts on the host each step; decode runs eagerly", type(model).__name__)
        return None
    sizes = capture_sizes(max_num_seqs)
    max_blocks = -(-max_model_len // kv_cache.block_size)

    def forward(ids, positions, meta):
        return model(ids, positions, meta, kv_cache)

    graphs = DecodeGraphs(forward, sizes, max_blocks, kv_cache.block_size, kv_cache.device)
    seconds = graphs.capture_all()
    log.info(
        "CUDA graphs: decode captured for batch sizes %s in %.1f s (--enforce-eager: off)",
        ", ".join(map(str, sizes)),
        seconds,
    )
    return graphs
