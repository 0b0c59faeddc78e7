"""FedOMG: data-free on-server gradient matching (Nguyen et al., "Federated Domain
Generalization with Data-free On-server Matching Gradient", ICLR 2025).

The server treats the clients' updates ``g_k = θ_k − θ`` (local − global, trainable parameters)
as per-domain gradients and looks for an invariant direction among their convex combinations
``g_Γ = Σ_k Γ_k g_k``, ``Γ`` on the simplex, near the FedAvg update ``g_FL = Σ_k (n_k/n) g_k``:

``Γ* = argmin_Γ  g_Γ · g_FL + κ ‖g_FL‖ ‖g_Γ‖`` (the paper's gradient-matching problem, the dual
of CAGrad's), then ``g_IGD = g_FL + κ ‖g_FL‖ g_Γ* / ‖g_Γ*‖`` and ``θ ← θ + η_g g_IGD``.

κ is the search radius (κ → 0 is FedAvg with a server step η_g). ``Γ`` is found as the authors'
code finds it (``skydvn/FedOMG``, ``FedOMG-DG/algorithms/FedOMG/utils/fed_merge.py::OMG``): a
softmax over logits starting at 0 (uniform Γ), 20 steps of SGD (learning rate 25, momentum 0.5)
on the objective computed from the clients' Gram matrix scaled by the squared mean update norm,
keeping the best Γ of the 21 evaluated. The coefficients, the objective and κ‖g_FL‖ are logged per
round (``telemetry.coefficients``). As a server rule it composes with other methods' clients
(``mcgdm+fedomg``; the paper's "+OMG" rows); buffers are averaged with n_k/n as in FedAvg.

The paper's text was not among FedBed's references (the equations are as its summaries give
them). The authors' code differs, and ``reading=authors_code`` follows it: each update is scaled by
its client's weight before the search, ``g_FL`` is their plain mean (the FedAvg update / K), and
the direction is divided by ``1 + κ²``; its ``λ = c / (‖g_Γ‖ + 10⁻⁴)`` keeps the code's small
constants. Defaults: κ = 0.5 (paper and code) and η_g = 0.5, the server learning rate of the
authors' PACS scripts (``train_pacs_OMG.py``, ``--global_model_lr 0.5``); a reading note of the
paper reports η_g = 0.05, which FedBed could not check. Their code leaves BatchNorm's running
statistics of the global model untouched; FedBed averages them.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from fedbed.algorithms.base.local_training import LocalTrainingHyperparameters, SupervisedAlgorithm
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.update_aggregation import UpdateAggregation

STABILITY = 1e-4
"""The small constant the authors' solver adds under its square roots and to its norms."""


class FedOMGHyperparameters(LocalTrainingHyperparameters):
    """FedOMG's server hyperparameters (module docstring for the sources).

    Attributes:
        search_radius: κ ≥ 0.
        server_learning_rate: η_g > 0.
        solver_steps: SGD steps of the coefficient search (20: 21 evaluations).
        solver_learning_rate: its learning rate (25).
        solver_momentum: its momentum (0.5).
        reading: ``paper`` or ``authors_code``.
    """

    search_radius: float = Field(0.5, ge=0)
    server_learning_rate: float = Field(0.5, gt=0)
    solver_steps: int = Field(20, ge=0)
    solver_learning_rate: float = Field(25.0, gt=0)
    solver_momentum: float = Field(0.5, ge=0, lt=1)
    reading: Literal["paper", "authors_code"] = "paper"


def matching_coefficients(gram: torch.Tensor, reference: torch.Tensor, radius: float, steps: int = 20,
                          learning_rate: float = 25.0, momentum: float = 0.5) -> tuple[torch.Tensor, float]:
    """The simplex coefficients Γ minimising ``Γ·b + c sqrt(Γᵀ G Γ + 10⁻⁴)`` (module docstring).

    Args:
        gram: ``[K, K]`` float64 Gram matrix ``G`` of the candidate updates (scaled).
        reference: ``[K]`` their inner products ``b`` with the reference direction (same scale).
        radius: ``c``, κ times the reference's (scaled) norm.
        steps: SGD steps on the softmax logits, which start at 0.
        learning_rate: of the SGD.
        momentum: of the SGD.

    Returns:
        ``(Γ [K] float64 on the simplex, its objective)``: the best of the ``steps + 1`` evaluated.
    """
    logits = torch.zeros(len(reference), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([logits], lr=learning_rate, momentum=momentum)
    best, best_value = torch.softmax(logits.detach(), dim=0), math.inf
    for step in range(steps + 1):
        coefficients = torch.softmax(logits, dim=0)
        objective = coefficients @ reference + radius * torch.sqrt(coefficients @ gram @ coefficients + STABILITY)
        if float(objective.detach()) < best_value:
            best, best_value = coefficients.detach().clone(), float(objective.detach())
        if step < steps:
            optimizer.zero_grad()
            objective.backward()
            optimizer.step()
    return best, best_value


class FedOMGAggregation(UpdateAggregation):
    """FedOMG's on-server gradient matching of the client updates (module docstring)."""

    def __init__(self, hparams: FedOMGHyperparameters, seed: int = 0) -> None:
        super().__init__(seed)
        self.hparams = hparams
        self.server_learning_rate = hparams.server_learning_rate

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor,
                          generator: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:
        hp, kappa = self.hparams, self.hparams.search_radius
        authors = hp.reading == "authors_code"
        candidates = updates.to(torch.float64) * weights[:, None] if authors else updates.to(torch.float64)
        mixing = torch.full_like(weights, 1.0 / len(weights)) if authors else weights
        reference = mixing @ candidates
        gram = candidates @ candidates.T
        scale = torch.sqrt((candidates * candidates).sum(dim=1) + STABILITY).mean() ** 2
        scaled_gram = gram / scale
        radius = kappa * math.sqrt(float(mixing @ scaled_gram @ mixing) + STABILITY)
        coefficients, objective = matching_coefficients(scaled_gram, scaled_gram @ mixing, radius, hp.solver_steps,
                                                        hp.solver_learning_rate, hp.solver_momentum)
        matched = coefficients @ candidates
        if authors:
            multiplier = radius / (math.sqrt(float(coefficients @ scaled_gram @ coefficients) + STABILITY) + STABILITY)
            direction = (reference + multiplier * matched) / (1.0 + kappa**2)
        else:
            norm = float(matched.norm())
            direction = reference + (kappa * float(reference.norm()) / norm) * matched if norm > 0 else reference
        return direction, {"weights": weights.tolist(), "coefficients": coefficients.tolist(), "objective": objective,
                           "correction_norm": kappa * float(reference.norm())}


@register_algorithm
class FedOMG(SupervisedAlgorithm):
    """FedOMG (Nguyen et al., ICLR 2025): FedAvg's clients, the server's gradient matching; a
    server rule for any client technique (``fedsr+fedomg``)."""

    name = "fedomg"
    summary = ("FedOMG (Nguyen et al., ICLR 2025): on-server gradient matching, the FedAvg update plus "
               "kappa*|g_FL| along the best convex combination of client updates (CAGrad-style search).")
    hyperparameters = FedOMGHyperparameters
    secure_aggregation_compatible = False  # the server needs each client's own update
    server_rule = True

    def create_aggregation(self, hparams: FedOMGHyperparameters, context: AlgorithmContext) -> FedOMGAggregation:
        return FedOMGAggregation(hparams, context.seed)

    def create_strategy(self, hparams: FedOMGHyperparameters, context: AlgorithmContext) -> FedAvgStrategy:
        return FedAvgStrategy(context.seed, self.create_aggregation(hparams, context))
