"""Token embeddings."""

from __future__ import annotations

import torch
from torch import nn


def uninitialized_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding whose weight is left unfilled (the loader fills it). Skipping the random
    init matters on the meta device: its normal_() goes through torch._refs, which imports
    torch._dynamo (a heavy import, paid on every load)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
