"""FedDG-GA: generalization adjustment of the aggregation weights (Zhang et al., "Federated
Domain Generalization with Generalization Adjustment", CVPR 2023).

Every client reports its generalization gap ``G_k(θ^r) = Ê_k(θ^r) − Ê_k(θ_k^r)``: the risk of the
global model it received against that of its own model of the round before, on its own data
(:mod:`fedbed.algorithms.base.client_reports`). The server moves each client's aggregation weight
towards the clients the global model serves worst (Sec. 4, "Generalization Adjustment"):

``a_k ← a_k + d_r · (G_k − μ) / max_l (G_l − μ)``, ``μ = (1/K) Σ_l G_l``, ``d_r = d (1 − r/R)``,

then clips the weights at 0 and renormalises them to sum 1, and averages the round's models (every
state-dict entry, as the authors' ``fed_merge.FedAvg``) with them. The weights start uniform
(1/K, the authors' ``train_pacs_GA.py``). In FedBed's round ``t`` the clients report the gap of the
model they received, ``θ^{t−1}``, so ``r = t − 1``; a round without every replying client's gap
(round 1: no client has a previous model) keeps the weights. The gap each client reports and the
weights are logged per round (``telemetry.generalization_gaps``, ``telemetry.weights``).

The paper's text was not among FedBed's references; its equation is as the paper's summaries
give it (the centring by μ is confirmed by the authors' issue #8). The authors' code
(``MediaBrain-SJTU/FedDG-GA``, ``utils/weight_adjust.py::refine_weight_dict_by_GA``, driven by
``algorithms/fedavg/train_pacs_GA.py``) differs, and ``reading=authors_code`` follows it:

- the gaps are divided by ``max_l |G_l|`` without subtracting their mean (issue #8);
- the step is ``d (1 − (i − 1)/R) / K`` with the code's round index ``i = t − 2`` (the off-by-one
  decay and the ``1/3`` written for K = 3 sites);
- the weights are clipped to [0, 1] before renormalising;
- each site scores its gap on its validation split (``dataloader_dict[site]['val']``), where the
  paper's ``Ê_k`` is the risk on the client's data: ``gap_samples=holdout`` scores it on the
  client's share of the id-validation holdouts (the samples ``train_domain_val`` selects on),
  ``training`` (its training samples) is the default. This switch is separate from ``reading``.

The authors' script measures the gap in accuracy (``--fair acc``); ``gap_metric=accuracy``
does so (local minus global accuracy, in percent), ``loss`` (the paper's risk) is the default.
Which reading produced the published numbers is not stated; the public scripts are the code's.
The default step ``d = 0.2`` is the scripts' ``--step_size`` (the paper's value could not be
checked). FedDG-GA assumes every client joins every round; under partial participation a
client keeps its weight between the rounds it joins and the round's weights are renormalised
over the clients that replied.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedbed.algorithms.base.client_reports import (
    GAP_METRICS,
    GAP_SAMPLE_CHOICES,
    GAP_SAMPLES,
    REPORT_GENERALIZATION_GAP,
)
from fedbed.algorithms.base.local_training import LocalTrainingHyperparameters, SupervisedAlgorithm
from fedbed.algorithms.base.model_aggregation import ClientModels, FedAvgStrategy, ModelAggregation
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.federation.arrays import weighted_average


class GeneralizationAdjustmentHyperparameters(LocalTrainingHyperparameters):
    """FedDG-GA's step size ``d``, the gap's metric and the reading (module docstring).

    Attributes:
        step_size: ``d`` in (0, 1]; 0.2 as the authors' scripts.
        gap_metric: ``loss`` (the paper's risk) or ``accuracy`` (the authors' ``--fair acc``).
        gap_samples: ``training`` (the client's training samples, the paper's ``D̂_k``) or
            ``holdout`` (its share of the id-validation holdouts: the authors' validation split
            where a client holds one domain, as their sites do; under a mixed partition a
            client's share splits its domains' holdouts equally among their holders, not in the
            proportions of its training data). A client whose share is empty fails its rounds
            with the reason (the engine drops it from each round).
        reading: ``paper`` or ``authors_code``.
    """

    step_size: float = Field(0.2, gt=0, le=1)
    gap_metric: Literal["loss", "accuracy"] = "loss"
    gap_samples: Literal[GAP_SAMPLE_CHOICES] = "training"
    reading: Literal["paper", "authors_code"] = "paper"


def adjusted_weights(weights: torch.Tensor, gaps: torch.Tensor, step: float, reading: str = "paper") -> torch.Tensor:
    """One generalization adjustment of the weights (module docstring).

    Args:
        weights: ``[K]`` current weights (summing to 1).
        gaps: ``[K]`` the clients' generalization gaps (larger: the global model is worse there).
        step: this round's step, ``d_r`` (``paper``) or the code's ``d (1 − (i−1)/R) / K``.
        reading: ``paper`` (gaps centred by their mean, divided by the largest centred gap,
            clipped at 0) or ``authors_code`` (divided by the largest absolute gap, clipped to [0, 1]).

    Returns:
        ``[K]`` float64 weights summing to 1; the input weights when the gaps are all equal
        (``paper``) or all zero (``authors_code``): there is nothing to adjust by.
    """
    weights, gaps = weights.to(torch.float64), gaps.to(torch.float64)
    if reading == "paper":
        centred = gaps - gaps.mean()
        scale = centred.max()
        adjusted = (weights + step * centred / scale).clamp(min=0.0) if scale > 0 else weights
    else:
        scale = gaps.abs().max()
        adjusted = (weights + step * gaps / scale).clamp(0.0, 1.0) if scale > 0 else weights
    return adjusted / adjusted.sum()


class GeneralizationAdjustment(ModelAggregation):
    """FedDG-GA's server rule: the weights adjusted by the reported gaps, then the weighted mean.

    Args:
        hparams: its hyperparameters.
        rounds: the run's number of rounds ``R`` (the step's decay).
    """

    def __init__(self, hparams: GeneralizationAdjustmentHyperparameters, rounds: int) -> None:
        self.hparams = hparams
        self.rounds = rounds
        self.weights: dict[int, float] = {}

    def client_config(self) -> dict[str, Any]:
        return {REPORT_GENERALIZATION_GAP: 1, GAP_SAMPLES: self.hparams.gap_samples}

    def reported_metrics(self) -> tuple[str, ...]:
        return (GAP_METRICS[self.hparams.gap_metric],)

    def step(self, round_number: int, clients: int) -> float:
        """The step of round ``round_number`` (1-based), which adjusts by the gaps of ``θ^{t−1}``."""
        if self.hparams.reading == "paper":
            return self.hparams.step_size * (1.0 - (round_number - 1) / self.rounds)
        code_round = round_number - 2  # the code's index of the round whose models gave the gaps
        return self.hparams.step_size * (1.0 - (code_round - 1) / self.rounds) / clients

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        clients = list(models.clients)
        for client in clients:
            self.weights.setdefault(client, 1.0 / len(clients))
        (name,) = self.reported_metrics()
        gaps = [metrics.get(name) for metrics in models.metrics]
        telemetry: dict[str, Any] = {}
        current = torch.tensor([self.weights[c] for c in clients], dtype=torch.float64)
        current = current / current.sum()
        if len(gaps) == len(clients) and all(gap is not None for gap in gaps):
            step = self.step(models.round_number, len(clients))
            current = adjusted_weights(current, torch.tensor(gaps, dtype=torch.float64), step, self.hparams.reading)
            telemetry.update({"generalization_gaps": {str(c): g for c, g in zip(clients, gaps)}, "step_size": step})
        self.weights.update({c: float(w) for c, w in zip(clients, current)})
        telemetry["weights"] = {str(c): float(w) for c, w in zip(clients, current)}
        return weighted_average(models.arrays, current.tolist()), telemetry

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = {int(c): float(w) for c, w in state.get("weights", {}).items()}


@register_algorithm
class FedDGGA(SupervisedAlgorithm):
    """FedDG-GA (Zhang et al., CVPR 2023): FedAvg's clients, aggregation weights adjusted by the
    clients' generalization gaps; a server rule for any supervised client technique
    (``fedsr+feddg_ga``)."""

    name = "feddg_ga"
    summary = ("FedDG-GA (Zhang et al., CVPR 2023): aggregation weights moved towards the clients with the largest "
               "generalization gap (global vs local risk on their data), decaying step d(1 - r/R).")
    hyperparameters = GeneralizationAdjustmentHyperparameters
    secure_aggregation_compatible = False  # the server needs each client's own model and gap
    server_rule = True
    needs_supervised_clients = True

    def create_aggregation(self, hparams: GeneralizationAdjustmentHyperparameters,
                           context: AlgorithmContext) -> GeneralizationAdjustment:
        if context.rounds is None:
            raise ValueError("FedDG-GA's step decays over the run's rounds: the context needs rounds")
        return GeneralizationAdjustment(hparams, context.rounds)

    def create_strategy(self, hparams: GeneralizationAdjustmentHyperparameters, context: AlgorithmContext) -> FedAvgStrategy:
        return FedAvgStrategy(context.seed, self.create_aggregation(hparams, context))
