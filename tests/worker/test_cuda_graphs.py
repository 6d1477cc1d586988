"""The decode-graph runner's bookkeeping (worker/cuda_graphs.py): buckets, padding, the static buffer,
and a model run over the static inputs equal to the eager run. The capture itself needs CUDA
(tests/test_gpu.py replays against eager there); here a stand-in replays by calling the forward
on the same static views, with the Triton kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenloom.attention.metadata import build_paged_inputs
from tokenloom.kernels import triton as triton_kernels
from tokenloom.kernels.triton.paged_attention import paged_attention
from tokenloom.worker.batch import SeqChunk, build_batch
from tokenloom.worker.cuda_graphs import DecodeGraphs, StaticDecodeInputs, StaticLayout, bucket_for, capture_sizes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(100)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 33, 64, 65, 100)] == [1, 2, 4, 8, 64, 64, 100, 100]
    assert bucket_for(101, sizes) is None


CHUNKS = [SeqChunk([11], 0, [7]), SeqChunk([12], 16, [3, 9]), SeqChunk([13], 40, [2, 5, 8, 1])]


def test_static_buffer_holds_the_chunks_and_pads_the_bucket():
    inputs = StaticDecodeInputs(StaticLayout(rows=8, max_blocks=4), block_size=16, device=DEVICE)
    inputs.load(CHUNKS, bucket=4)
    ids, positions, meta = inputs.model_inputs(4)
    assert ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [0, 16, 40, 0]
    assert meta.slot_mapping.tolist() == [7 * 16, 9 * 16, 8 * 16 + 8, -1]  # padding writes nothing
    paged = meta.paged_inputs()
    assert paged.seq_lens.tolist() == [1, 17, 41, 0]  # padding sees nothing
    assert paged.query_start.tolist() == [0, 1, 2, 3, 4]
    assert paged.block_offsets.tolist() == [0, 1, 3, 0]
    assert paged.block_ids[:6].tolist() == [7, 3, 9, 2, 5, 8]  # only the blocks in use
    inputs.load(CHUNKS[:1], bucket=2)  # a smaller step after a larger
    _, _, meta = inputs.model_inputs(2)
    assert meta.slot_mapping.tolist() == [7 * 16, -1]
    assert meta.paged_inputs().seq_lens.tolist() == [1, 0]


def test_attention_over_the_static_inputs_equals_the_eager_inputs():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 16, 2, 32, generator=gen).to(DEVICE)
    q = torch.randn(4, 4, 32, generator=gen).to(DEVICE)
    inputs = StaticDecodeInputs(StaticLayout(rows=4, max_blocks=4), block_size=16, device=DEVICE)
    inputs.load(CHUNKS, bucket=4)
    _, _, meta = inputs.model_inputs(4)
    static = paged_attention(q, k_cache, v_cache, meta.paged_inputs(), 0.2)
    eager = paged_attention(
        q[:3], k_cache, v_cache, build_paged_inputs([1, 1, 1], [1, 17, 41], [c.block_ids for c in CHUNKS], DEVICE), 0.2
    )
    assert torch.equal(static[:3], eager)
    assert not static[3].any()


class EagerReplay(DecodeGraphs):
    """DecodeGraphs whose 'graph' is the forward called again on the same static views: what a
    replay computes, without CUDA."""

    def capture(self, bucket: int) -> None:
        self.graphs[bucket] = bucket

    def replay(self, bucket: int):
        return self.forward(*self.inputs.model_inputs(bucket))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/test_gpu.py replays real graphs")
def test_a_model_over_the_static_inputs_equals_its_eager_run(tiny_model_dir, monkeypatch):
    """A tiny Llama decoding 3 sequences through the replay inputs (bucket 4, the Triton attention
    path, interpreted) gives the hidden states of the eager batch (the CPU path), and writes the
    same keys and values."""
    from tokenloom.kv_cache.paged import PagedKVCache
    from tokenloom.loader import load_model

    loaded = load_model(str(tiny_model_dir("llama_gqa")))
    model, config = loaded.model, loaded.config
    caches = [PagedKVCache(config, 12, 16, torch.float32, "cpu") for _ in range(2)]
    prompts = [SeqChunk(list(range(5, 5 + n)), 0, blocks) for n, blocks in ((1, [7]), (17, [3, 9]), (41, [2, 5, 8]))]
    for cache in caches:  # the same prompts in both
        batch = build_batch(prompts, 16, torch.device("cpu"), cache.null_block)
        model(batch.input_ids, batch.positions, batch.meta, cache)
    decode = [SeqChunk([30 + i], len(p.token_ids), p.block_ids) for i, p in enumerate(prompts)]
    batch = build_batch(decode, 16, torch.device("cpu"), caches[0].null_block)
    eager = model(batch.input_ids, batch.positions, batch.meta, caches[0])
    monkeypatch.setattr(triton_kernels, "takes_cache", lambda kv_cache: True)
    replay = EagerReplay(
        lambda ids, positions, meta: model(ids, positions, meta, caches[1]), [1, 2, 4], 4, 16, torch.device("cpu")
    )
    replay.capture_all = None
    assert replay.takes(decode) and not replay.takes(prompts)
    got = replay.run(decode)
    assert torch.allclose(got, eager, atol=1e-4)
    again = replay.run(
        [SeqChunk([0], c.start, c.block_ids) for c in decode],  # ids given on the device
        torch.tensor([30, 31, 32]),
    )
    assert torch.allclose(again, eager, atol=1e-4)
    for layer in range(config.num_layers):
        assert torch.allclose(caches[0].keys[layer], caches[1].keys[layer], atol=1e-5)
        assert torch.allclose(caches[0].values[layer], caches[1].values[layer], atol=1e-5)
