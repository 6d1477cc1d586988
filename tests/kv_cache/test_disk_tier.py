"""The prefix cache's disk tier (kv_cache/disk_tier.py): files that are whole or not there, damage
read as a miss, a size bound, several processes at once; and in the engine, a prompt whose blocks
were saved (evicted from memory, or at exit) is read back, after a restart too, with the output a
cold run gives."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.kv_cache.disk_tier import DiskTier, chain_key


def test_a_block_comes_back_as_written_and_keys_chain_on_the_whole_prefix(tmp_path):
    tier = DiskTier(tmp_path, "space", 1 << 20)
    first = chain_key("space", [1, 2, 3])
    assert chain_key(first, [4, 5, 6]) != chain_key(chain_key("space", [9, 2, 3]), [4, 5, 6])
    assert not tier.contains(first) and tier.get(first) is None
    tier.put(first, b"payload bytes")
    assert tier.contains(first) and tier.get(first) == b"payload bytes"
    assert DiskTier(tmp_path, "space", 1 << 20).get(first) == b"payload bytes"  # another instance: a restart
    assert DiskTier(tmp_path, "other", 1 << 20).get(first) is None  # another model's space


def test_a_half_written_file_is_never_read(tmp_path):
    tier = DiskTier(tmp_path, "space", 1 << 20)
    key = chain_key("space", [1])
    path = tier._path(key)
    path.parent.mkdir(parents=True)
    (path.parent / ".tmp-crashed").write_bytes(b"TLKV0001 half")  # a writer died before its rename
    assert not tier.contains(key) and tier.get(key) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    tier = DiskTier(tmp_path, "space", 1 << 20)
    key = chain_key("space", [1])
    tier.put(key, bytes(range(200)))
    path = tier._path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x10
    elif damage == "truncate":
        data = data[:-20]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert tier.get(key) is None
    assert not path.exists() and tier.corrupt == 1


def test_the_least_recently_used_blocks_go_past_the_bound(tmp_path):
    tier = DiskTier(tmp_path, "space", 3 * 1100)  # room for 3 blocks of 1,000 bytes and their headers
    keys = [chain_key("space", [i]) for i in range(3)]
    for i, key in enumerate(keys):
        tier.put(key, bytes(1000))
        os.utime(tier._path(key), (1000 + i, 1000 + i))  # written in order
    tier.get(keys[0])  # read: the most recently used now
    tier.put(chain_key("space", [9]), bytes(1000))
    assert [tier.contains(k) for k in keys] == [True, False, True]  # the oldest unread one went
    assert sum(p.stat().st_size for p in Path(tier.root).glob("*/*.kv")) <= 3 * 1100


def _writer(directory: str, seed: int) -> None:
    tier = DiskTier(directory, "space", 1 << 30)
    for i in range(200):
        tier.put(chain_key("space", [i % 50]), bytes([i % 50]) * 4096)  # the same keys as the others


def test_processes_writing_the_same_blocks_at_once_leave_whole_files(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s)) for s in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    tier = DiskTier(tmp_path, "space", 1 << 30)
    for i in range(50):
        assert tier.get(chain_key("space", [i])) == bytes([i]) * 4096
    assert not list(Path(tier.root).glob("*/.tmp-*"))


# ---- in the engine ------------------------------------------------------------------------------

PROMPT = list(range(20, 90))  # 70 tokens: 4 full blocks of 16 read back, the rest computed
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama_gqa"))


def _llm(folder, directory, **kwargs):
    kwargs = {"dtype": "float32", "kv_cache_memory": 4 << 20, "prefix_cache_dir": str(directory)} | kwargs
    return LLM(folder, **kwargs)


def _answer(llm, prompt=PROMPT):
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    return out.token_ids, out.logprobs


def test_a_restart_reads_the_saved_prefix_back_and_answers_as_a_cold_run(folder, tmp_path):
    cold = _answer(LLM(folder, dtype="float32", kv_cache_memory=4 << 20))
    first = _llm(folder, tmp_path)
    assert _answer(first) == cold
    assert first.engine.core.block_manager.save_to_disk() >= 4  # what exit would save
    del first
    again = _llm(folder, tmp_path)
    tokens, logprobs = _answer(again)
    blocks = again.engine.core.block_manager
    assert blocks.stats.disk_hit_tokens == 4 * 16
    assert tokens == cold[0]
    for ours, theirs in zip(logprobs, cold[1]):
        assert ours.keys() == theirs.keys()
        assert all(ours[t] == pytest.approx(theirs[t], abs=1e-5) for t in ours)


def test_blocks_evicted_from_memory_are_read_back_in_the_same_process(folder, tmp_path):
    llm = _llm(folder, tmp_path, kv_cache_memory=None, kv_cache_contexts=1, max_model_len=96)
    cold = _answer(llm)
    others = [[5 + i] * 80 for i in range(3)]  # each fills the cache: PROMPT's blocks are evicted
    llm.generate(others, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    blocks = llm.engine.core.block_manager
    assert blocks.disk.writes >= 4  # saved as they were evicted
    assert _answer(llm) == cold
    assert blocks.stats.disk_hit_tokens >= 4 * 16


def test_a_damaged_block_is_computed_again(folder, tmp_path):
    first = _llm(folder, tmp_path)
    cold = _answer(first)
    first.engine.core.block_manager.save_to_disk()
    del first
    files = sorted(Path(tmp_path).glob("*/*/*.kv"), key=lambda p: p.stat().st_mtime_ns)
    damaged = bytearray(files[2].read_bytes())
    damaged[-1] ^= 1
    files[2].write_bytes(bytes(damaged))
    again = _llm(folder, tmp_path)
    assert _answer(again)[0] == cold[0]
    assert again.engine.core.block_manager.disk.corrupt == 1


def test_a_cache_of_another_format_does_not_read_them(folder, tmp_path):
    first = _llm(folder, tmp_path)
    _answer(first)
    first.engine.core.block_manager.save_to_disk()
    other = _llm(folder, tmp_path, kv_cache_dtype="int8")
    _answer(other)
    assert other.engine.core.block_manager.stats.disk_hit_tokens == 0


def test_the_disk_tier_needs_prefix_caching(folder, tmp_path):
    with pytest.raises(ValueError, match="needs prefix caching"):
        _llm(folder, tmp_path, enable_prefix_caching=False)
