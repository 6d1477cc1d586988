"""The memory-mapped GGUF reader against files written by the `gguf` package: every metadata
type, a tensor of every block type, bad files rejected with the reason."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.quant.test_gguf_kernels import random_blocks, reference
from tokenloom.loader.gguf_reader import GGUFFormatError, GGUFReader
from tokenloom.quant.gguf.tensor import KERNEL_TYPES, GGMLTensor


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A GGUF file with metadata of each value type and one tensor per kernel block type."""
    path = tmp_path_factory.mktemp("gguf") / "every-type.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.strings", ["a", "", "Ġthe", "日本"])
    w.add_array("test.ints", [3, 1, 4, 1, 5])
    w.add_array("test.floats", [0.5, -1.5])
    tensors = {}
    for kind, (name, _, _) in KERNEL_TYPES.items():
        raw = random_blocks(kind, 4, 2 * 256)
        tensors[name] = raw
        w.add_tensor(f"t.{name}", raw, raw_dtype=gguf.GGMLQuantizationType(kind))  # shape from the bytes
    w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tensors


def test_metadata_reads_back(written):
    path, _ = written
    f = GGUFReader(path).fields
    assert f["general.architecture"] == "llama"
    assert (f["test.u32"], f["test.i64"], f["test.f32"], f["test.bool"]) == (7, -5, 0.25, True)
    assert f["test.str"] == "héllo"
    assert f["test.strings"] == ["a", "", "Ġthe", "日本"]
    assert f["test.ints"] == [3, 1, 4, 1, 5] and f["test.floats"] == [0.5, -1.5]


def test_every_block_type_reads_back_as_written(written):
    path, tensors = written
    infos = {t.name: t for t in GGUFReader(path).tensors}
    for name, raw in tensors.items():
        info = infos[f"t.{name}"]
        assert info.shape == (4, 512) and KERNEL_TYPES[info.type][0] == name
        got = GGMLTensor(info.type, torch.from_numpy(info.raw()).view(4, -1), 512)
        assert np.array_equal(got.data.numpy(), raw)
        assert torch.equal(got.dequantize(), reference(info.type, raw, 512))
    f32 = infos["t.f32"]
    assert f32.shape == (3, 4) and np.array_equal(
        f32.raw().view(np.float32).reshape(3, 4), np.arange(12, dtype=np.float32).reshape(3, 4)
    )


def test_truncated_and_foreign_files_are_errors(written, tmp_path):
    path, _ = written
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFFormatError, match="past the end|truncated"):
        GGUFReader(cut)
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:100])
    with pytest.raises(GGUFFormatError):
        GGUFReader(header_cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFReader(other)


def test_mixture_of_experts_in_an_unsupported_family_is_refused_by_name(tmp_path):
    """Experts are read for llama (Mixtral), qwen2moe and qwen3moe files; elsewhere the expert
    count is named, before any tensor is read."""
    from tokenloom.loader.gguf import GGUFFile
    from tokenloom.models.config import UnsupportedModelError

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in {
        "qwen2.block_count": 1,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4,
        "qwen2.context_length": 128,
        "qwen2.expert_count": 8,
        "qwen2.expert_used_count": 2,
    }.items():
        w.add_uint32(key, value)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 128, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="mixture of experts in a GGUF 'qwen2' file is not supported"):
        GGUFFile(path).hf_config()


def _mapped_kib(path) -> int:
    """This process's resident KiB of file `path`'s mappings (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_parsed_header_and_looked_up_embedding_rows_leave_the_resident_size(tmp_path):
    """A GGUF file's header pages (a vocabulary's strings) are dropped once parsed, and an embedding
    read a few rows at a time reads them from the file (pread), not through the map: the process
    never maps the file's pages of the tokens it has seen (nor their 64 KiB neighbourhoods, which
    raised the peak resident size for the moment of each lookup). Through the map, the same
    lookups leave the whole table resident."""
    from tokenloom.quant.gguf.modules import GGMLEmbedding

    path = tmp_path / "embedding.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token-{i:06d}-" + "x" * 40 for i in range(40_000)])  # ~2 MB
    raw = random_blocks(8, 8192, 256)  # Q8_0, 8192 x 272 B: 2.2 MB
    w.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"]) == 40_000
    assert _mapped_kib(path) < 64  # 2 MB of strings read, dropped
    info = reader.tensors[0]
    expected = reference(8, raw, 256)

    def look_up_every_row(read_rows) -> int:
        emb = GGMLEmbedding(8192, 256, torch.float32)
        emb.load_weight(GGMLTensor(8, torch.from_numpy(info.raw()).view(8192, -1), 256, read_rows))
        for start in range(0, 8192, 512):
            ids = torch.arange(start, start + 512).flip(0)
            assert torch.equal(emb(ids), expected[start : start + 512].flip(0))
        return _mapped_kib(path)

    assert look_up_every_row(lambda index: torch.from_numpy(info.read_rows(index.tolist(), 272))) < 64
    with pytest.raises(IndexError, match="row 8192 is out of range for token_embd.weight's 8192 rows"):
        info.read_rows([5, 8192], 272)
    assert look_up_every_row(None) > 2000  # kept: the whole table
