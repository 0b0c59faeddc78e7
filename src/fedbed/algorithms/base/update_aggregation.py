"""Server strategies that combine client updates (pseudo-gradients) rather than models.

Each client's update is ``Δθ_k = θ_k − θ_global`` over the model's trainable parameters (PPDG
Sec. 3.4 writes it ``ω_T − ω_0``). A subclass turns the K updates into one aggregated update;
the global model then moves by ``θ ← θ + η_server · aggregated`` (η_server = 1 unless the
method has a server step size, as FedGMA). Buffers (e.g. BatchNorm statistics) are averaged
with weights n_k/n as in FedAvg.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.federation.arrays import flatten, unflatten, weighted_average
from fedbed.federation.messages import Reply
from fedbed.seeding import seeded_generator

AGGREGATION_PURPOSE = 31
"""Seed component of the aggregators' random draws (visiting orders, random fills)."""


class UpdateAggregationStrategy(FedAvgStrategy):
    """FedAvg's server with the parameter average replaced by :meth:`aggregate_updates`."""

    server_learning_rate: float = 1.0

    @abstractmethod
    def aggregate_updates(
        self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Combine client updates.

        Args:
            updates: ``[K, P]`` float64, one row per client (ascending client id).
            weights: ``[K]`` float64, n_k / n.
            generator: seeded from (run seed, round) for any random choice.

        Returns:
            The aggregated update ``[P]`` and JSON-serialisable telemetry (weights, masks, counts).
        """

    def combine(self, round_number: int, replies: dict[int, Reply]) -> tuple[dict, dict[str, Any]]:
        order = sorted(replies)
        sizes = [replies[c].num_examples for c in order]
        current = self.model.state_dict()
        keys = [name for name, _ in self.model.named_parameters()]
        start = flatten(current, keys)
        updates = torch.stack([flatten(replies[c].arrays, keys) - start for c in order])
        weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        generator = seeded_generator(self.seed, round_number, AGGREGATION_PURPOSE)
        aggregated, telemetry = self.aggregate_updates(updates, weights, generator)
        new_state = weighted_average([replies[c].arrays for c in order], sizes)
        new_state.update(unflatten(start + self.server_learning_rate * aggregated, current, keys))
        telemetry.setdefault("clients", order)
        return new_state, telemetry


def visiting_orders(count: int, generator: torch.Generator) -> list[list[int]]:
    """For each ``i`` in ``0..count-1``, the other indices ``j != i`` in a random order."""
    return [[j for j in torch.randperm(count, generator=generator).tolist() if j != i] for i in range(count)]
