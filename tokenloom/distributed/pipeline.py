"""Pipeline parallelism: the layers split into consecutive stages, one per rank, and each model
call cut into micro-batches that flow through the stages, so that stage r works on micro-batch
m while stage r - 1 works on m + 1 (for links too slow for tensor parallelism's two all-reduces
per layer: a stage sends one (2, T, hidden) tensor per micro-batch).

Rank 0 holds the embedding, its layers, the final norm and the LM head; rank r > 0 only its
layers (and their KV cache). The last stage sends each micro-batch's (hidden, residual) back to
rank 0, which finishes it. Micro-batches are whole sequences (their chunks), so each has its
own attention metadata and writes its own KV blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from tokenloom.distributed.group import ParallelGroup
from tokenloom.distributed.shard import TENSOR_PARALLEL_CLASSES, TensorParallelError, unsplit_error
from tokenloom.models.config import ModelConfig

if TYPE_CHECKING:
    from tokenloom.models.llama import LlamaForCausalLM
    from tokenloom.worker.batch import SeqChunk

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    """Rank `rank` of `size` pipeline stages over a model of `num_layers` layers."""

    rank: int
    size: int
    num_layers: int

    @property
    def layers(self) -> range:
        """This stage's layers: an even split, the first stages one more where it does not divide."""
        base, extra = divmod(self.num_layers, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def check(self, config: ModelConfig, model_class: type) -> None:
        if model_class.__name__ not in TENSOR_PARALLEL_CLASSES:
            raise unsplit_error("pipeline", config, model_class)
        if self.size > config.num_layers:
            raise TensorParallelError(
                f"--pipeline-parallel-size {self.size} exceeds the model's {config.num_layers} layers"
            )

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is this stage's (its layers'; rank 0: the rest too)."""
        layer = _LAYER.match(name)
        return int(layer.group(1)) in self.layers if layer else self.rank == 0

    def trim(self, model: nn.Module) -> None:
        """Drop what this stage does not hold from a model not yet materialized (on "meta")."""
        llama = cast("LlamaForCausalLM", model)  # check() admits the Llama family only
        for i in range(self.num_layers):
            if i not in self.layers:
                llama.model.layers[i] = nn.Identity()
        if self.rank != 0:
            body: nn.Module = llama.model  # a plain Module: its submodules change type here
            body.embed_tokens = nn.Identity()
            body.norm = nn.Identity()
            llama.lm_head = nn.Identity()


def micro_batches(chunks: list[SeqChunk], count: int) -> list[list[SeqChunk]]:
    """`chunks` in order, in at most `count` consecutive groups of about equal tokens."""
    total = sum(len(c.token_ids) for c in chunks)
    groups: list[list[SeqChunk]] = [[]]
    done = 0
    for chunk in chunks:
        if groups[-1] and len(groups) < count and done >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(chunk)
        done += len(chunk.token_ids)
    return groups


class Pipeline:
    """One rank's part of every model call (ModelRunner.forward hands it the step's chunks)."""

    def __init__(self, model: nn.Module, stage: PipelineStage, group: ParallelGroup) -> None:
        # stage.check() admitted the Llama family only
        self.model, self.stage, self.group = cast("LlamaForCausalLM", model), stage, group
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

    def forward(self, runner, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """Run this stage over every micro-batch of `chunks`: on rank 0 the final hidden states
        (T, hidden) in the chunks' order, elsewhere None. Sends are asynchronous, so a stage
        starts micro-batch m + 1 while the next stage works on m."""
        stage, group = self.stage, self.group
        batches = [runner.batch(g) for g in micro_batches(chunks, stage.size)]
        sending = []
        for m, batch in enumerate(batches):
            if stage.rank == 0:
                h, residual = self.model.model.embed_tokens(batch.input_ids), None
            else:
                h, residual = group.recv(self._carrier(batch), stage.rank - 1, m)
            attend = self.model.plan(batch.positions, batch.meta, runner.kv_cache, self.dtype)
            h, residual = self.model.run_layer_range(h, residual, attend, stage.layers)
            assert residual is not None  # a stage has at least one layer (check())
            sending.append(group.isend(torch.stack([h, residual]), (stage.rank + 1) % stage.size, m))
        finished = None
        if stage.rank == 0:  # the last stage's (hidden, residual), normed
            finished = [
                self.model.model.norm.add_forward(*group.recv(self._carrier(b), stage.size - 1, m))[0]
                for m, b in enumerate(batches)
            ]
        for work in sending:
            group.wait(work)
        return None if finished is None else torch.cat(finished)

    def _carrier(self, batch) -> torch.Tensor:
        """(2, T, hidden): where a micro-batch's (hidden, residual) arrives."""
        return torch.empty(2, batch.input_ids.shape[0], self.model.config.hidden_size, dtype=self.dtype)
