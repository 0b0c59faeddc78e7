"""Gradient-agreement baselines of PPDG's Tables 4-5 and hFedF's Table 10, as server aggregators.

Each combines the clients' updates Δθ_k = θ_k − θ_global (see :mod:`update_aggregation`):

- AgrSum / AgrRand (Mansilla et al., "Domain generalization via gradient surgery", ICCV 2021):
  coordinates where every client's update has the same strict sign keep their combined value;
  conflicting coordinates are zeroed (AgrSum) or filled with ``s·ε``, ``ε ~ N(0, 1)``, where ``s``
  is the mean absolute combined value over the agreeing coordinates (AgrRand).
- PCGrad (Yu et al., NeurIPS 2020, Algorithm 1): each update is projected onto the normal plane
  of every other update it conflicts with.
- FedGMA (Tenison et al., "Gradient masked averaging for federated learning", 2022): the
  weighted mean update is multiplied by the soft mask ``M_j = 1[A_j >= τ] + 1[A_j < τ]·A_j`` with
  ``A_j = |(1/K) Σ_k sign(Δ_kj)|`` and applied with a server step size η: ``θ ← θ + η M ⊙ Δ̄``.

The centralized originals sum per-domain gradients of one step; with multi-step client
updates, FedBed combines them with the n_k/n-weighted mean instead, so that every aggregator
moves the model on FedAvg's scale and the comparison isolates the combination rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.search_space import LogUniform, Uniform
from fedbed.algorithms.base.update_aggregation import (
    UpdateAggregation,
    visiting_orders,
)


def _mask_summary(mask: torch.Tensor) -> dict[str, float]:
    """Telemetry of a mask ``[P]``: its mean and the share of coordinates it shrinks."""
    return {"mask_mean": float(mask.mean()), "masked_fraction": float((mask < 1).to(torch.float64).mean())}


class AgreementAggregation(UpdateAggregation):
    """AgrSum (``random_fill=False``) or AgrRand (``random_fill=True``)."""

    def __init__(self, seed: int, random_fill: bool) -> None:
        super().__init__(seed)
        self.random_fill = random_fill

    def aggregate_updates(
        self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        combined = weights @ updates
        mask = unanimous_sign_mask(updates)
        result = mask * combined
        if self.random_fill:
            agreeing = mask.bool()
            scale = float(combined[agreeing].abs().mean()) if bool(agreeing.any()) else 0.0
            noise = torch.randn(combined.shape, generator=generator, dtype=torch.float64)
            result = torch.where(agreeing, result, scale * noise)
        return result, {"weights": weights.tolist(), **_mask_summary(mask)}


class AgrSum(SupervisedAlgorithm):
    """AgrSum (Mansilla et al., ICCV 2021, Sec. 3): conflicting-sign coordinates are zeroed.

    Like every server rule here, FedAvg's clients and server with the average replaced by
    :meth:`create_aggregation`, which a run may also compose with another method's clients.
    """

    name = "agrsum"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    server_rule = True
    summary = "AgrSum (Mansilla et al. 2021): keep coordinates whose sign all clients agree on, zero the rest."
    hyperparameters = LocalTrainingHyperparameters
    random_fill = False

    def create_aggregation(self, hparams, context: AlgorithmContext) -> UpdateAggregation:
        return AgreementAggregation(context.seed, self.random_fill)

    def create_strategy(self, hparams, context: AlgorithmContext) -> FedAvgStrategy:
        return FedAvgStrategy(context.seed, self.create_aggregation(hparams, context))


register_algorithm(AgrSum)


@register_algorithm
class AgrRand(AgrSum):
    """AgrRand (Mansilla et al., ICCV 2021, Sec. 3): conflicting coordinates get scaled Gaussian noise."""

    name = "agrrand"
    summary = "AgrRand (Mansilla et al. 2021): agreeing coordinates kept, conflicting ones filled with s*N(0,1)."
    random_fill = True


class PCGradAggregation(UpdateAggregation):
    """Project conflicting updates (:func:`pcgrad_project`), then take the weighted mean."""

    def aggregate_updates(
        self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        projected = pcgrad_project(updates, visiting_orders(len(updates), generator))
        changed = [bool(not torch.equal(p, u)) for p, u in zip(projected, updates.to(torch.float64))]
        return weights @ projected, {"weights": weights.tolist(), "projected_clients": changed}


@register_algorithm
class PCGrad(AgrSum):
    """PCGrad (Yu et al., NeurIPS 2020) as a server aggregator (PPDG Sec. 4, baseline)."""

    name = "pcgrad"
    summary = "PCGrad (Yu et al. 2020): project each conflicting update onto the other's normal plane, then average."

    def create_aggregation(self, hparams, context: AlgorithmContext) -> PCGradAggregation:
        return PCGradAggregation(context.seed)


class FedGMAHyperparameters(LocalTrainingHyperparameters):
    """FedGMA's mask threshold τ and server step size η.

    Defaults are hFedF's selected values on PACS (``hfedf.txt``, Table 10): τ = 0.7, η = 1.0
    (Office-Home: 0.3, 0.01; VLCS: 0.5, 0.01). Searched over the span of hFedF's grids (Table 10):
    τ ~ U(0.3, 0.7) (grid 0.3, 0.5, 0.7), η ~ 10^U(−2, 0) (grid 1e-2, 1e-1, 1).
    """

    mask_threshold: float = Field(0.7, ge=0, le=1)
    server_learning_rate: float = Field(1.0, gt=0)

    search_space = {
        "mask_threshold": Uniform(0.3, 0.7, source="hFedF Table 10: FedGMA's mask threshold grid {0.3, 0.5, 0.7}"),
        "server_learning_rate": LogUniform(1e-2, 1.0, source="hFedF Table 10: FedGMA's server step size grid {1e-2, 1e-1, 1}"),
    }


class FedGMAAggregation(UpdateAggregation):
    """``θ ← θ + η · M ⊙ Σ_k (n_k/n) Δθ_k`` with FedGMA's soft sign-agreement mask ``M``."""

    def __init__(self, hparams: FedGMAHyperparameters, seed: int) -> None:
        super().__init__(seed)
        self.mask_threshold = hparams.mask_threshold
        self.server_learning_rate = hparams.server_learning_rate

    def aggregate_updates(
        self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = gradient_masked_average_mask(updates, self.mask_threshold)
        return mask * (weights @ updates), {"weights": weights.tolist(), **_mask_summary(mask)}


@register_algorithm
class FedGMA(AgrSum):
    """FedGMA (Tenison et al. 2022): gradient-masked averaging with a server step size."""

    name = "fedgma"
    summary = "FedGMA (Tenison et al. 2022): soft sign-agreement mask on the mean update, server step size."
    hyperparameters = FedGMAHyperparameters
    dataset_defaults = {  # hfedf.txt Table 10, Office-Home and VLCS columns
        "OfficeHome": {"mask_threshold": 0.3, "server_learning_rate": 0.01},
        "VLCS": {"mask_threshold": 0.5, "server_learning_rate": 0.01},
    }

    def create_aggregation(self, hparams: FedGMAHyperparameters, context: AlgorithmContext) -> FedGMAAggregation:
        return FedGMAAggregation(hparams, context.seed)


def pcgrad_project(updates: torch.Tensor, orders: Sequence[Sequence[int]]) -> torch.Tensor:
    """PCGrad's projection (Yu et al., NeurIPS 2020, Algorithm 1) applied to client updates.

    For each ``i`` and each other ``j`` in a random order: if ``g_i^PC · g_j < 0`` then
    ``g_i^PC ← g_i^PC − (g_i^PC · g_j / ||g_j||²) g_j``, projecting onto the normal plane of the
    *original* ``g_j``. A zero ``g_j`` never conflicts, so no division by zero happens.

    Args:
        updates: ``[K, P]``.
        orders: for each ``i``, the ``j`` in visiting order (:func:`visiting_orders`).

    Returns:
        ``[K, P]`` projected updates.
    """
    original = updates.to(torch.float64)
    projected = original.clone()
    squared_norms = (original * original).sum(dim=1)
    for i, order in enumerate(orders):
        for j in order:
            dot = float(projected[i] @ original[j])
            if dot < 0:
                projected[i] = projected[i] - (dot / float(squared_norms[j])) * original[j]
    return projected


def sign_agreement(updates: torch.Tensor) -> torch.Tensor:
    """Per-coordinate sign agreement ``A_j = |(1/K) Σ_k sign(g_kj)|`` in [0, 1] (FedGMA's score).

    Args:
        updates: ``[K, P]``.

    Returns:
        ``[P]`` float64; 1 where every client has the same strict sign, 0 where signs cancel.
    """
    return torch.sign(updates.to(torch.float64)).mean(dim=0).abs()


def unanimous_sign_mask(updates: torch.Tensor) -> torch.Tensor:
    """Mansilla et al.'s agreement mask: 1 where all K updates share one strict sign, else 0.

    ``m_j = 1[|Σ_k sign(g_kj)| = K]``; a zero coordinate in any update breaks agreement.

    Returns:
        ``[P]`` float64 of zeros and ones.
    """
    count = updates.shape[0]
    return (torch.sign(updates.to(torch.float64)).sum(dim=0).abs() == count).to(torch.float64)


def gradient_masked_average_mask(updates: torch.Tensor, mask_threshold: float) -> torch.Tensor:
    """FedGMA's soft mask (Tenison et al. 2022): ``M_j = 1`` if ``A_j >= τ`` else ``A_j``.

    ``A`` is :func:`sign_agreement`. Coordinates below the threshold are scaled by their agreement,
    not zeroed; ``τ = 0`` gives the all-ones mask (FedAvg).

    Returns:
        ``[P]`` float64 in [0, 1].
    """
    agreement = sign_agreement(updates)
    return torch.where(agreement >= mask_threshold, torch.ones_like(agreement), agreement)
