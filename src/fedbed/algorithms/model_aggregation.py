"""How a FedAvg-family server turns the round's client models into the new global model.

Every method whose server averages the clients' models (FedAvg, FedProx, FedSR, FedADG, the
self-supervised methods, Central) calls :meth:`ModelAggregation.aggregate` from
:meth:`fedbed.algorithms.fedavg.FedAvgStrategy.combine`: the one seam where the run's server
options plug in. The default is FedAvg's weighted average; robust aggregation
(:mod:`fedbed.algorithms.robust_aggregation`) and client-level differential privacy
(:mod:`fedbed.algorithms.differential_privacy`) replace it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedbed.federation.messages import Scalar
from fedbed.gradients import weighted_average

MODEL_AGGREGATION_PURPOSE = 37
"""Seed component of a model aggregation's random draws (differential privacy's noise)."""


@dataclass(frozen=True)
class ClientModels:
    """What a model aggregation combines in one round.

    Attributes:
        current: the global model's state dict before the round (what every client was sent).
        clients: the K client ids, ascending.
        arrays: their K state dicts (same names, shapes and dtypes as ``current``: the engine
            checked them).
        weights: K positive weights (n_k for FedAvg, 1 for FedADG's uniform mean).
        round_number: the round (from 1).
        generator: seeded from (run seed, round, :data:`MODEL_AGGREGATION_PURPOSE`).
        parameter_names: the names of ``current`` that are trainable floating-point parameters
            (:func:`trainable_parameter_names`); the others are buffers (BatchNorm's running
            statistics, its integer ``num_batches_tracked``), which a rule that ranks or clips
            client models must not read as if they were weights.
    """

    current: Mapping[str, torch.Tensor]
    clients: Sequence[int]
    arrays: Sequence[Mapping[str, torch.Tensor]]
    weights: Sequence[float]
    round_number: int
    generator: torch.Generator
    parameter_names: frozenset[str]


def trainable_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """The state-dict names of ``model``'s floating-point parameters that require gradients."""
    return frozenset(name for name, parameter in model.named_parameters()
                     if parameter.requires_grad and parameter.is_floating_point())


class ModelAggregation:
    """FedAvg's aggregation (McMahan et al., AISTATS 2017, Algorithm 1): ``θ ← Σ_k w_k θ_k / Σ_k w_k``.

    Subclasses replace :meth:`aggregate` (and may ask the clients for something through
    :meth:`client_config`); they keep no state across rounds, so a resumed run needs none:
    every random draw comes from the round's seeded ``generator``.
    """

    def client_config(self) -> dict[str, Scalar]:
        """Scalars every client receives in its payload's config (none for FedAvg)."""
        return {}

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The new global state dict and JSON-serialisable telemetry.

        Returns:
            ``(state dict, {"weights": {client: w_k / Σ w}, ...})``.
        """
        total = float(sum(models.weights))
        return weighted_average(models.arrays, models.weights), {
            "weights": {str(c): w / total for c, w in zip(models.clients, models.weights)}}
