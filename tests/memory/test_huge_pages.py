"""Weights moved into 2 MiB pages after loading (tokenloom/memory/huge_pages.py): the same tensor objects
and values in a map the kernel may back with huge pages; the same tokens either way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.memory import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


def smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`; "mapping": its header line."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
                if inside:
                    fields["mapping"] = line.strip()
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


class Holder(nn.Module):
    """A parameter, a buffer, two views of one storage and a tensor held outside both (GGUF panels')."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(1024, 1024, generator=g), requires_grad=False)  # 4 MiB
        fused = torch.randn(512, 256, generator=g)
        self.register_buffer("first", fused[:256])
        self.register_buffer("second", fused[256:])
        self.small = nn.Parameter(torch.randn(16), requires_grad=False)
        self.outside = torch.randint(0, 255, (300, 1024), dtype=torch.uint8, generator=g)

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.outside]


@needs_thp
def test_weights_move_into_one_map_marked_for_huge_pages_keeping_tensors_and_values():
    m = Holder()
    tensors = [m.weight, m.first, m.second, m.outside]
    before = [t.clone() for t in tensors]
    small_at = m.small.data_ptr()
    moved = huge_pages.move_to_huge_pages(m)
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))  # the same objects, the same values
    assert m.weight is m._parameters["weight"] and isinstance(m.weight, nn.Parameter)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1  # one arena
    assert m.second.data_ptr() - m.first.data_ptr() == 256 * 256 * 4  # views of one storage stay so
    assert m.small.data_ptr() == small_at  # under MIN_BYTES: left where it was
    mapping = smaps_of(m.weight.data_ptr())
    assert mapping["THPeligible"] == "1"  # the kernel may back it with 2 MiB pages
    assert mapping["mapping"].split()[1] == "rw-p" and "/dev/zero" not in mapping["mapping"]  # private, not shmem
    m.weight.add_(1)  # still writable, still in place
    assert torch.equal(m.weight, before[0] + 1)


def test_nothing_moves_when_turned_off_or_too_small(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_HUGE_PAGES", "0")
    m = Holder()
    at = m.weight.data_ptr()
    assert not huge_pages.available() and huge_pages.move_to_huge_pages(m) == 0 and m.weight.data_ptr() == at
    monkeypatch.delenv("TOKENLOOM_HUGE_PAGES")
    tiny = nn.Linear(64, 64)
    at = tiny.weight.data_ptr()
    assert huge_pages.move_to_huge_pages(tiny) == 0 and tiny.weight.data_ptr() == at


def test_file_maps_and_onednn_tensors_are_not_movable():
    import mmap

    region = mmap.mmap(-1, 1 << 20)
    viewing = torch.frombuffer(region, dtype=torch.uint8)  # not torch's memory
    assert not huge_pages.movable(viewing)
    assert huge_pages.movable(torch.empty(1 << 20, dtype=torch.uint8))
    if torch.backends.mkldnn.is_available():
        assert not huge_pages.movable(torch.randn(256, 256).to_mkldnn())


@needs_thp
@pytest.mark.slow
def test_a_gguf_model_decodes_the_same_tokens_from_huge_pages(default_gguf_path, monkeypatch):
    from tokenloom import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = ["Once upon a time", "The capital of France is"]

    def run():
        llm = LLM(str(default_gguf_path), kv_cache_memory=32 << 20)
        outs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        return llm, outs

    llm, moved = run()
    head = llm.engine.core.runner.model.lm_head
    assert smaps_of(head.qweight.data_ptr()).get("THPeligible") == "1"
    monkeypatch.setenv("TOKENLOOM_HUGE_PAGES", "0")
    _, kept = run()
    assert moved == kept


def test_a_storage_shared_with_a_tensor_left_behind_is_copied_but_never_discarded():
    """Pages of an old storage are handed back as they are copied only where the tensors being
    moved are all that hold it: a view outside the model keeps its values."""
    m = Holder()
    elsewhere = m.weight[3]  # a view nobody will move
    want = elsewhere.clone()
    storage = m.weight.untyped_storage()
    assert not huge_pages._held_only_by(storage, [m.weight])
    del elsewhere
    assert huge_pages._held_only_by(storage, [m.weight])
    elsewhere = m.weight[3]
    del storage
    huge_pages.move_to_huge_pages(m)
    assert torch.equal(elsewhere, want) and torch.equal(m.weight[3], want)


def test_copying_with_discard_hands_back_the_old_pages():
    source = torch.ones(4 << 20, dtype=torch.uint8)
    region = torch.empty_like(source)
    huge_pages._copy(source.untyped_storage(), region, 1 << 20, discard=True)
    assert int(region.sum()) == source.numel()  # the copy is whole
    # the source's pages read back as zeros: all but the part-pages at each 1 MiB piece's ends
    assert int(source.sum()) <= 4 * 2 * 4096


@needs_thp
def test_a_weight_arena_cuts_aligned_buffers_until_full_then_torch_allocates():
    with huge_pages.weight_arena(4 << 20):
        a = huge_pages.empty((1000,), torch.float16)
        b = huge_pages.empty((3 << 20,), torch.uint8)
        too_big = huge_pages.empty((4 << 20,), torch.uint8)  # past the arena (4 MiB and its alignment slack)
    after = huge_pages.empty((1 << 17,), torch.float32)  # outside weight_arena
    assert b.data_ptr() - a.data_ptr() == 2048  # 2000 bytes, rounded up to 64
    assert a.data_ptr() % huge_pages.HUGE_PAGE == 0  # the arena starts on a 2 MiB boundary
    assert smaps_of(a.data_ptr()).get("THPeligible") == "1"
    assert not huge_pages.movable(a) and not huge_pages.movable(b)  # already where the move would put them
    assert huge_pages.movable(too_big) and huge_pages.movable(after)  # torch's own
    b.fill_(7)
    assert int(b.sum()) == 7 * (3 << 20) and a.shape == (1000,) and b.dtype == torch.uint8


@needs_thp
def test_gguf_panels_load_into_the_arena_and_leave_nothing_to_move(default_gguf_path):
    from tokenloom.loader.load import load_model
    from tokenloom.quant.int8 import kernels

    if not kernels.panels_available():
        pytest.skip("no int8/int4 panel kernels built here")
    model = load_model(str(default_gguf_path), prepare=False).model
    qkv = model.model.layers[0].self_attn.qkv_proj  # Q4_1, loaded in three parts
    assert qkv.panel_layout and not huge_pages.movable(qkv.qweight)
    assert smaps_of(qkv.qweight.data_ptr()).get("THPeligible") == "1"
    assert huge_pages.move_to_huge_pages(model) == 0  # norms are under MIN_BYTES: nothing left to copy
