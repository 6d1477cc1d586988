"""The modules that make a rank's share of the model compute the whole model's result: the sum
after each row-parallel block, the vocabulary-parallel embedding and the gathered LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from tokenloom.distributed.group import ParallelGroup
from tokenloom.distributed.shard import TensorShard

if TYPE_CHECKING:
    from tokenloom.models.llama import LlamaForCausalLM


class AllReduced(nn.Module):
    """A block whose output each rank computes in part (row-parallel): the parts summed."""

    def __init__(self, module: nn.Module, group: ParallelGroup) -> None:
        super().__init__()
        self.module, self.group = module, group

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.group.all_reduce(self.module.forward(*args, **kwargs).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + count) of the embedding: ids elsewhere give zeros here, and the sum over
    the ranks is every id's row."""

    def __init__(self, embedding: nn.Embedding, first: int, group: ParallelGroup) -> None:
        super().__init__()
        self.embedding, self.first, self.group = embedding, first, group

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden)."""
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.embedding.weight.shape[0])
        rows = self.embedding(local.masked_fill(outside, 0))
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0.0).contiguous())


class VocabParallelLMHead(nn.Module):
    """The output projection's vocabulary rows [first, first + count) on each rank, gathered on
    rank 0 (the only rank that samples). Rank 0's call first broadcasts the hidden rows, which
    the other ranks receive in ``serve``."""

    def __init__(self, head: nn.Module, vocab_size: int, group: ParallelGroup) -> None:
        super().__init__()
        self.head, self.vocab_size, self.group = head, vocab_size, group

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.head.weight)  # a Linear's parameter

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0: hidden (N, H) -> logits (N, V)."""
        self.group.send("logits", (tuple(hidden.shape), hidden.dtype))
        logits = self._project(self.group.broadcast(hidden.contiguous()))
        assert logits is not None  # rank 0 gathers the logits
        return logits

    def serve(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Another rank: take part in rank 0's forward."""
        self._project(self.group.broadcast(torch.empty(shape, dtype=dtype)))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor | None:
        gathered = self.group.gather_columns(self.head(hidden).contiguous())  # (N, size x count)
        return None if gathered is None else gathered[:, : self.vocab_size]


def parallelize(model: nn.Module, shard: TensorShard, group: ParallelGroup, config) -> None:
    """Wrap a rank's model (built from shard.local_config, weights loaded) so that its forward and
    compute_logits give the whole model's (`config`'s) results: an all-reduce after each
    attention's o_proj and each MLP or MoE block, the vocabulary-parallel embedding and LM head.
    The model's ``config`` becomes the whole model's (what the runner reads: vocabulary, hidden
    size), ``local_config`` its own share's."""
    llama = cast("LlamaForCausalLM", model)  # shard.check() admitted the Llama family only
    layer: Any  # a decoder layer, whose o_proj and mlp change type here
    for layer in llama.model.layers:
        layer.self_attn.o_proj = AllReduced(layer.self_attn.o_proj, group)
        layer.mlp = AllReduced(layer.mlp, group)
    first, _ = shard.vocab_rows(config)
    body: nn.Module = llama.model  # a plain Module: its embedding changes type here
    body.embed_tokens = VocabParallelEmbedding(llama.model.embed_tokens, first, group)
    llama.lm_head = VocabParallelLMHead(llama.lm_head, config.vocab_size, group)
    # Module.__setattr__ takes any value; torch annotates it Tensor | Module
    llama.local_config, llama.config = llama.config, config  # type: ignore[assignment]
    llama.tensor_shard = shard  # type: ignore[assignment]
