"""Decode steps replayed from a tape of op calls: the layer stack in one native call.

At batch 1 a 30-layer model's decode step is ~500 op calls, and from Python each pays
interpreter and argument-parsing time before its kernel starts: on SmolLM2-135M about as long
as the quantized kernels themselves (docs/BENCHMARKS.md, 'Measurements behind design choices').
A tape is recorded once per step shape from one eager run of ``model.run_layers`` under a
dispatch mode (every op call with its arguments and results), then replayed by
``csrc/op_tape.cpp``: the same kernels on the same arguments in the same order, so the same
bits, with a fraction of that overhead per call and the GIL released for the whole stack (the
server's event loop runs meanwhile). This is what CUDA graphs do for a GPU, at the level of
dispatcher calls instead of kernel launches.

What a tape may bake in, and the checks that keep it honest (any failure: no tape, the step
runs eagerly, and the reason is logged once):
- Per-step tensors are *inputs*: the embeddings and the attention's step tensors
  (``StepAttention.step_tensors``: rope tables, cache slots, block tables, context lengths).
  Every other tensor an op reads must be produced by an earlier op of the tape, or belong to
  the model or the KV cache (a weight, a cache block): a tensor from anywhere else could
  change between steps, so the recording is refused.
- Shapes are baked: tapes are keyed by the shapes of their inputs (block tables are padded
  to a power of two blocks, so a growing context re-records log2 times).
- Control flow is baked: only models whose layers run the same ops for every step of a
  shape (``CausalLM.replayable_layers``) are taped, and a recording in which any op returns a
  non-tensor (``.item()``, ``.tolist()`` feeding Python) is refused.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import QUANTIZED_CACHES

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "op_tape.cpp"
MAX_TAPES = 32  # distinct step shapes kept (least recently used dropped)
# A shape is recorded at its third step: a recording costs more than an eager step, and under
# continuous batching many batch sizes come once or twice, so recording every new shape cost
# throughput (docs/BENCHMARKS.md, 'Measurements behind design choices').
RECORD_AT = 3
TENSOR_LIST = -2  # an argument's slot: a list of tensors (csrc/op_tape.cpp)


def tape_module():
    """The compiled replayer (a Python extension module), or None where it cannot be built."""
    return native.load_module(_SOURCE, "op tape replayer")


class _Recorder(TorchDispatchMode):
    """Every op call below autograd while active: (op, args, kwargs, result), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo guard around __torch_dispatch__: its wrapper imports torch._dynamo on the first
        recording (a heavy import, paid inside the first decode step; tokenloom never compiles here)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


class NotReplayable(Exception):
    """A recording that a tape cannot reproduce; the message says why."""

    output: Any  # set by record(): the step's output, run eagerly


def _storage_key(t: torch.Tensor) -> int:
    """What identifies the memory `t` reads: its storage's address, or for a tensor without one
    (oneDNN's blocked weights, ``layers/prepacked.py`` where the panel kernel cannot be built)
    the tensor itself."""
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()


def _storages(tensors) -> set[int]:
    return {_storage_key(t) for t in tensors if isinstance(t, torch.Tensor)}


def _schema_values(func, args: tuple, kwargs: dict) -> list:
    """The call's value for every schema argument, defaults filled in."""
    values = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            values.append(args[i])
        elif arg.name in kwargs:
            values.append(kwargs[arg.name])
        elif arg.has_default_value():
            values.append(arg.default_value)
        else:
            raise NotReplayable(f"{func}: argument {arg.name} missing")
    return values


class _TapeBuilder:
    """Turns a recording into the replayer's call list: tensors become slots or checked constants."""

    def __init__(self, inputs: list[torch.Tensor], owned: set[int]) -> None:
        self.slot_of = {id(t): i for i, t in enumerate(inputs)}
        self.owned = owned
        self.calls: list[list] = []
        self.last_read: dict[int, int] = {}

    def _tensor(self, func, value: torch.Tensor, index: int) -> tuple[torch.Tensor | None, int]:
        """(None, slot) for a tensor of the step, (value, -1) for a weight or cache tensor."""
        if id(value) in self.slot_of:
            slot = self.slot_of[id(value)]
            self.last_read[slot] = index
            return None, slot
        if _storage_key(value) not in self.owned:
            raise NotReplayable(
                f"{func} reads a tensor {tuple(value.shape)} that is neither an input, "
                "nor made by the step, nor the model's or the KV cache's"
            )
        return value, -1

    def _argument(self, func, value, index: int, lists: dict[int, Sequence[int]], j: int) -> tuple[Any, int]:
        """(constant, -1), (None, slot), or for a list of tensors (elements, TENSOR_LIST) with
        the element slots in lists[j]."""
        if isinstance(value, torch.Tensor):
            return self._tensor(func, value, index)
        if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            elements, lists[j] = zip(*(self._tensor(func, v, index) for v in value))
            return list(elements), TENSOR_LIST
        if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            raise NotReplayable(f"{func} takes a list mixing tensors and other values")
        return value, -1

    def add(self, func, args: tuple, kwargs: dict, out) -> None:
        index = len(self.calls)
        returns = func._schema.returns
        if not all(str(r.type) in ("Tensor", "List[Tensor]") for r in returns):
            raise NotReplayable(f"{func} returns {[str(r.type) for r in returns]}: the step's Python reads it")
        lists: dict[int, Sequence[int]] = {}
        values = _schema_values(func, args, kwargs)
        constants, slots = (
            zip(*(self._argument(func, v, index, lists, j) for j, v in enumerate(values))) if values else ((), ())
        )
        outs = () if not returns else (out,) if len(returns) == 1 else out
        out_slots = [
            [self._slot(t) for t in o] if str(r.type) == "List[Tensor]" else self._slot(o)
            for r, o in zip(returns, outs)
        ]
        name, overload = func._schema.name, func._overloadname
        self.calls.append(
            [
                name,
                "" if overload == "default" else overload,
                list(constants),
                list(slots),
                out_slots,
                [],
                {j: list(s) for j, s in lists.items()},
            ]
        )

    def _slot(self, tensor: torch.Tensor) -> int:
        """The slot of a result (a new one, or its own where an op returns a tensor it was given)."""
        if id(tensor) not in self.slot_of:
            self.slot_of[id(tensor)] = len(self.slot_of)
        return self.slot_of[id(tensor)]

    def build(self, output: torch.Tensor, num_inputs: int):
        """The compiled tape; each slot released after its last read, outputs nobody reads dropped."""
        if id(output) not in self.slot_of:
            raise NotReplayable("the step's output is not made by the recorded ops")
        out_slot = self.slot_of[id(output)]
        for slot, index in self.last_read.items():
            if slot >= num_inputs and slot != out_slot:
                self.calls[index][5].append(slot)
        read = set(self.last_read) | {out_slot}
        kept = lambda s: s if s in read else -1  # noqa: E731
        for call in self.calls:
            call[4] = [[kept(e) for e in s] if isinstance(s, list) else kept(s) for s in call[4]]
        calls = [tuple(c) for c in self.calls]
        return tape_module().OpTape(calls, num_inputs, out_slot, len(self.slot_of))


def record(body, inputs: list[torch.Tensor], owned: set[int]):
    """Run ``body(*inputs)`` eagerly under the recorder: (its output, a tape replaying it).
    Raises NotReplayable (after the eager run, whose output stands) where no tape can."""
    recorder = _Recorder()
    with recorder:
        output = body(*inputs)
    builder = _TapeBuilder(inputs, owned)
    try:
        for func, args, kwargs, out in recorder.calls:
            builder.add(func, args, kwargs, out)
        return output, builder.build(output, len(inputs))
    except Exception as e:  # the replayer's own checks (an argument it cannot convert) too
        refusal = e if isinstance(e, NotReplayable) else NotReplayable(f"{type(e).__name__}: {e}")
        refusal.output = output
        raise refusal from e


class StepTapes:
    """The decode-step tapes of one model over one KV cache, keyed by step shape.

    ``forward(input_ids, positions, meta)`` is the model's forward: for a step of decoding
    sequences alone, replayed from a tape where the model and the step allow it (see the
    module doc); every other step calls the model as it is. ``variant()``: what else a step's ops
    depend on, kept apart in the key (whether some row runs through a LoRA adapter)."""

    def __init__(self, model, kv_cache, variant: Callable[[], Hashable] = lambda: None) -> None:
        self.model, self.kv_cache, self.variant = model, kv_cache, variant
        self.tapes: OrderedDict[tuple, Any] = OrderedDict()
        self.refused: set[tuple] = set()
        self.seen: dict[tuple, int] = {}  # steps run eagerly per shape not yet recorded
        self._owned: set[int] | None = None

    @staticmethod
    def usable(model) -> bool:
        """The model's layers replay (CausalLM.replayable_layers), tapes are not turned off
        (``TOKENLOOM_NO_TAPES=1``, for A/B runs) and the replayer builds."""
        return (
            model.replays_decode_steps() and os.environ.get("TOKENLOOM_NO_TAPES") != "1" and tape_module() is not None
        )

    def owned(self) -> set[int]:
        """Storages a tape may hold as constants: the model's parameters and buffers, tensors its
        modules hold outside those (``held_tensors()``: GGUF blocks), the KV cache's (a stored
        format's codes and scales: kv_cache/quantized.py)."""
        if self._owned is None:
            held = [t for m in self.model.modules() if hasattr(m, "held_tensors") for t in m.held_tensors()]
            layers = [*self.kv_cache.keys, *self.kv_cache.values]
            cache = [t for c in layers for t in ((c.data, c.scales) if isinstance(c, QUANTIZED_CACHES) else (c,))]
            tensors = [*self.model.parameters(), *self.model.buffers(), *held, *cache]
            self._owned = _storages(tensors)
        return self._owned

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if any(n != 1 for n in meta.query_lens):
            return self.model(input_ids, positions, meta, self.kv_cache)
        h, attend = self.model.embed_and_plan(input_ids, positions, meta, self.kv_cache)
        step = attend.step_tensors()
        if step is None:
            return self.model.run_layers(h, attend)
        inputs = [h, *step]
        key = (self.variant(), *((tuple(t.shape), t.dtype) for t in inputs))
        tape = self.tapes.get(key)
        if tape is not None:
            self.tapes.move_to_end(key)
            return tape.run(inputs)
        if key in self.refused:
            return self.model.run_layers(h, attend)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] < RECORD_AT:
            if len(self.seen) > 64 * MAX_TAPES:  # shapes seen once or twice, long ago
                self.seen.clear()
            return self.model.run_layers(h, attend)
        try:
            output, tape = record(lambda h_, *_: self.model.run_layers(h_, attend), inputs, self.owned())
        except NotReplayable as e:
            self.refused.add(key)
            log.info("decode steps of shape %s run eagerly: %s", key, e)
            return e.output
        self.tapes[key] = tape
        del self.seen[key]
        if len(self.tapes) > MAX_TAPES:
            self.tapes.popitem(last=False)
        return output
