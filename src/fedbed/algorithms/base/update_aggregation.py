"""Server rules that combine client updates (pseudo-gradients) rather than models.

Each client's update is ``Δθ_k = θ_k − θ_global`` over the model's trainable parameters (PPDG
Sec. 3.4 writes it ``ω_T − ω_0``). A subclass turns the K updates into one aggregated update;
the global model then moves by ``θ ← θ + η_server · aggregated`` (η_server = 1 unless the
method has a server step size, as FedGMA). Buffers (e.g. BatchNorm statistics) and frozen
parameters are averaged with the clients' weights as in FedAvg.

An update aggregation is a :class:`~fedbed.algorithms.base.model_aggregation.ModelAggregation`:
it sits in :class:`~fedbed.algorithms.base.model_aggregation.FedAvgStrategy`'s averaging seam,
so the same rule serves its own method (``algorithm: ppdg``) and any client technique it is
composed with (``algorithm: mcgdm`` with ``server: ppdg``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from fedbed.algorithms.base.model_aggregation import ClientModels, ModelAggregation
from fedbed.federation.arrays import flatten, stacked_updates, unflatten, weighted_average
from fedbed.seeding import seeded_generator

AGGREGATION_PURPOSE = 31
"""Seed component of the aggregators' random draws (visiting orders, random fills)."""


class UpdateAggregation(ModelAggregation):
    """FedAvg's average with the trainable parameters' mean update replaced by
    :meth:`aggregate_updates`.

    Args:
        seed: the run's seed; the round's random draws come from (seed, round,
            :data:`AGGREGATION_PURPOSE`).
    """

    server_learning_rate: float = 1.0

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def aggregate_updates(
        self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Combine client updates.

        Args:
            updates: ``[K, P]`` float64, one row per client (ascending client id).
            weights: ``[K]`` float64, the clients' weights normalised to sum 1 (n_k / n).
            generator: seeded from (run seed, round) for any random choice.

        Returns:
            The aggregated update ``[P]`` and JSON-serialisable telemetry (weights, masks, counts).
        """

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The new global state dict: buffers averaged, parameters moved by the combined update.

        Returns:
            ``(state dict, telemetry of aggregate_updates with "clients": the ids in row order)``.
        """
        keys = [name for name in models.current if name in models.parameter_names]
        start = flatten(models.current, keys)
        updates = stacked_updates(models.arrays, start, keys)
        weights = torch.tensor(models.weights, dtype=torch.float64) / sum(models.weights)
        generator = seeded_generator(self.seed, models.round_number, AGGREGATION_PURPOSE)
        aggregated, telemetry = self.aggregate_updates(updates, weights, generator)
        new_state = weighted_average(models.arrays, models.weights)
        new_state.update(unflatten(start + self.server_learning_rate * aggregated, models.current, keys))
        telemetry.setdefault("clients", list(models.clients))
        return new_state, telemetry


def visiting_orders(count: int, generator: torch.Generator) -> list[list[int]]:
    """For each ``i`` in ``0..count-1``, the other indices ``j != i`` in a random order."""
    return [[j for j in torch.randperm(count, generator=generator).tolist() if j != i] for i in range(count)]
