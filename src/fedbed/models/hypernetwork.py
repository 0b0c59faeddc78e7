"""The hypernetwork of hFedF (``hfedf.txt``, Table 8) and pFedHN: a client embedding mapped to a
whole client model's state dict. The method that trains it is :mod:`fedbed.algorithms.hypernetwork`."""

from __future__ import annotations

import math

import torch
from torch import nn


def embedding_dimension(num_clients: int) -> int:
    """pFedHN's and hFedF's client-embedding size ``e = ⌊1 + N/4⌋`` (hFedF Sec. 5.1)."""
    return math.floor(1 + num_clients / 4)


class HyperNetwork(nn.Module):
    """The hypernetwork of hFedF's Table 8.

    Embedding table ν ``[N, e]`` -> Linear(e, 50) -> LeakyReLU -> Linear(50, 50) -> LeakyReLU ->
    Linear(50, 50) -> LeakyReLU -> Linear(50, 50) -> one linear head per client-model tensor
    (the "multi-head linear" layer), reshaped to that tensor's shape.

    Args:
        num_clients: N, rows of the embedding table.
        target_shapes: name -> shape of every tensor of the client model's state dict.
        hidden: hidden width (50 in Table 8).
        embedding_dim: e (default :func:`embedding_dimension`).
    """

    def __init__(
        self, num_clients: int, target_shapes: dict[str, torch.Size], hidden: int = 50, embedding_dim: int | None = None
    ) -> None:
        super().__init__()
        dim = embedding_dim or embedding_dimension(num_clients)
        self.embeddings = nn.Embedding(num_clients, dim)
        self.body = nn.Sequential(
            nn.Linear(dim, hidden), nn.LeakyReLU(),
            nn.Linear(hidden, hidden), nn.LeakyReLU(),
            nn.Linear(hidden, hidden), nn.LeakyReLU(),
            nn.Linear(hidden, hidden),
        )
        self.target_shapes = dict(target_shapes)
        self.head_names = {name: f"head{i}" for i, name in enumerate(self.target_shapes)}
        self.heads = nn.ModuleDict(
            {self.head_names[name]: nn.Linear(hidden, math.prod(shape)) for name, shape in self.target_shapes.items()}
        )

    def forward(self, client_index: int) -> dict[str, torch.Tensor]:
        """φ_i = h(θ, ν[i]): the client model's state dict for client ``client_index``."""
        features = self.body(self.embeddings.weight[client_index])
        return {name: self.heads[self.head_names[name]](features).view(shape) for name, shape in self.target_shapes.items()}

    def body_parameters(self) -> list[nn.Parameter]:
        """θ: every parameter except the embedding table."""
        return [p for name, p in self.named_parameters() if not name.startswith("embeddings.")]
