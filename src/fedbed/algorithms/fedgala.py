"""FedGaLA (``fedgala.md``): federated unsupervised domain generalisation by global and local
alignment of gradients, on the self-supervised clients of :mod:`fedbed.algorithms.base.self_supervised`.

**Local alignment** (Sec. 3.3, Algorithm 1 lines 14-22). The server sends every client, as
read-only payload arrays ``reference/<parameter>``, the global model's last change
ĝ_est^(l,t) = θ^(l,t) − θ^(l,t−1) (the strategy keeps the previous global model, so a client that
skipped rounds still gets the right one). After each backward pass, for each layer l the client
compares its step on that layer with the reference and skips the layer's update when the cosine
is at most τ (line 18 keeps it when the cosine exceeds τ; τ = 0 by default, Fig. 2d).

Readings of the paper, each tested in ``tests/test_fedgala.py``:

- **A layer is one parameter tensor** (a weight or a bias), as the authors' code loops over
  ``named_parameters`` and drops ``param.grad``; the paper's "layer l" does not say more.
- **Like with like.** ĝ_est is a parameter change (downhill) while a batch gradient g points
  uphill, so the test compares the step direction −g with ĝ_est: an update that moves the layer
  along the global model's last change is kept, one moving against it is dropped. (The authors'
  code compares +g with ĝ_est, which keeps exactly the updates that undo the global change;
  Sec. 3.3's rationale, "discarding local gradients that are not aligned with the global
  model", reads as the test here.) The step is −g whatever the optimiser (Adam rescales it per
  coordinate; the paper writes plain SGD in line 20).
- **Round 1** has no previous global model: no reference is sent, nothing is compared or
  discarded, and no discard ratio is logged for it.
- **An all-zero reference** (a layer that did not change, e.g. the classifier head the
  self-supervised loss never trains, or a layer every client discarded the round before) has no
  direction: the cosine is undefined and the update is kept (discarding it would freeze such a
  layer forever).
- **Skipping** sets the parameter's gradient to ``None``, so the optimiser leaves that tensor
  unchanged for that step (Adam's moments and its weight decay included).
- **Discard ratio** (Fig. 2b): per parameter, discarded steps over compared steps in the round;
  ``discard_ratio`` is over all compared (parameter, step) pairs. Both are reply metrics
  (``discard_ratio``, ``discard_ratio/<parameter>``) and their means over the clients are the
  round summary's metrics of the same names.

**Global alignment** (Algorithm 1 lines 5-13): :func:`global_gradient_alignment`
on the client updates g_i = Θ_i − Θ^{t−1} over every trainable parameter (the whole model as
one vector, as the Algorithm writes it; the authors' code runs it per state-dict entry), from
the FedAvg update, ``iter`` = 3 times; the global model moves by the aggregated update (line 12's
Θ^(t) is the model the clients started from); buffers (BatchNorm statistics) are FedAvg's
n_k/n average. The weights are logged per round (``telemetry.weights``, ``fedbed plot
alignment``). ``fedavg_global_alignment`` is this rule alone, a server rule for any client technique.

**Ablations** (Tables 3, 4, 6, 7): ``global_alignment``, ``local_alignment`` (both off is
FedSimCLR, Table 4's last row), ``unaligned_update=reweight`` with ``reweight_factor`` (Table 6:
the unaligned step is multiplied by the factor instead of dropped), ``objective`` (Table 3: MoCo,
BYOL or SimSiam instead of SimCLR; their other settings are the objective's defaults, but
FedGaLA's ``temperature`` applies to MoCo too, and the optimiser is FedGaLA's), and Table 7's
``l2_coefficient`` and ``proximal_coefficient``.

Defaults (App. B.3): Adam, learning rate 3e-3, batch 128 and 7 local epochs of 100 rounds (run
settings, ``docs/configs/pacs32-fedgala.yaml``), τ = 0, ``iter`` = 3, SimCLR's temperature 0.5.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.local_training import LocalTrainingHyperparameters, SupervisedAlgorithm
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy, ModelAggregation
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.self_supervised import (
    SelfSupervisedAlgorithm,
    SelfSupervisedModel,
    SelfSupervisedTrainer,
)
from fedbed.algorithms.base.self_supervised_objectives import OBJECTIVES, Objective, SimCLRHyperparameters
from fedbed.algorithms.base.update_aggregation import UpdateAggregation
from fedbed.federation.alignment import cosine_similarities
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary

REFERENCE_PREFIX = "reference/"
"""Read-only payload arrays ``reference/<parameter>``: the global model's last change."""

DISCARD_METRIC = "discard_ratio"
"""Reply and round metric: the share of compared layer updates that local alignment skipped."""


class LocalAlignment:
    """The before-step hook of FedGaLA's local alignment (module docstring for the readings).

    Args:
        model: the model being trained; its parameters named in ``reference`` are tested.
        reference: parameter name -> ĝ_est of that parameter (same shape).
        threshold: τ; a layer's step is kept only when its cosine with ĝ_est exceeds τ.
        unaligned_update: ``discard`` (Algorithm 1) or ``reweight`` (Table 6).
        reweight_factor: the factor an unaligned gradient is multiplied by under ``reweight``.

    Raises:
        ValueError: a reference whose shape differs from its parameter's.
    """

    def __init__(self, model: nn.Module, reference: dict[str, torch.Tensor], threshold: float = 0.0,
                 unaligned_update: str = "discard", reweight_factor: float = 0.01) -> None:
        self.parameters = [(name, p) for name, p in model.named_parameters() if name in reference]
        for name, parameter in self.parameters:
            if reference[name].shape != parameter.shape:
                raise ValueError(f"the reference change of {name} has shape {tuple(reference[name].shape)}, "
                                 f"the parameter {tuple(parameter.shape)}: server and client models differ")
        self.reference = reference
        self.threshold = threshold
        self.unaligned_update = unaligned_update
        self.reweight_factor = reweight_factor
        self.discarded = {name: 0 for name, _ in self.parameters}
        self.compared = dict.fromkeys(self.discarded, 0)

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        """Test every referenced parameter's step −g; skip or shrink the unaligned ones."""
        for name, parameter in self.parameters:
            if parameter.grad is None:
                continue
            cosine = update_alignment(-parameter.grad, self.reference[name])
            if cosine != cosine:  # undefined (a zero reference or gradient): keep
                continue
            self.compared[name] += 1
            if cosine <= self.threshold:
                self.discarded[name] += 1
                if self.unaligned_update == "discard":
                    parameter.grad = None
                else:
                    parameter.grad.mul_(self.reweight_factor)

    def metrics(self) -> dict[str, float]:
        """``discard_ratio`` over all compared updates and ``discard_ratio/<parameter>`` for each
        parameter compared at least once (Fig. 2b)."""
        total = sum(self.compared.values())
        metrics = {DISCARD_METRIC: sum(self.discarded.values()) / total if total else 0.0}
        metrics.update({f"{DISCARD_METRIC}/{name}": self.discarded[name] / count
                        for name, count in self.compared.items() if count})
        return metrics


def reference_of(payload: Payload) -> dict[str, torch.Tensor]:
    """The reference changes the server sent (parameter name -> ĝ_est); empty in round 1."""
    return {name.removeprefix(REFERENCE_PREFIX): tensor for name, tensor in payload.read_only_arrays.items()
            if name.startswith(REFERENCE_PREFIX)}


class GlobalAlignmentAggregation(UpdateAggregation):
    """:func:`global_gradient_alignment` of the client updates, ``iterations`` = ``iter`` of line 7
    (0 keeps FedAvg's n_k/n weights: Table 4, "w/o GA")."""

    def __init__(self, seed: int = 0, iterations: int = 3) -> None:
        super().__init__(seed)
        self.iterations = iterations

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator):
        aggregated, alignment_weights = global_gradient_alignment(updates, weights, self.iterations)
        return aggregated, {"weights": alignment_weights.tolist(), "fedavg_weights": weights.tolist()}


class GlobalAlignmentStrategy(FedAvgStrategy):
    """FedGaLA's server: ``aggregation`` (global alignment by default, or a composed server rule)
    and, with ``send_reference``, the global model's last change sent to every client as
    ``reference/<parameter>`` read-only arrays (local alignment)."""

    metric_prefix = ""  # the clients' mean discard ratio is logged as ``discard_ratio`` (committed records, pacs32-fedgala.md)

    def __init__(self, seed: int = 0, aggregation: ModelAggregation | None = None, send_reference: bool = False) -> None:
        super().__init__(seed, aggregation or GlobalAlignmentAggregation(seed))
        self.send_reference = send_reference
        self.previous: dict[str, torch.Tensor] | None = None

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        super().initialize(model, clients)
        self.previous = None

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        payloads = super().configure_round(round_number, selected)
        if self.send_reference and self.previous is not None:
            reference = {f"{REFERENCE_PREFIX}{name}": (parameter.detach() - self.previous[name]).clone()
                         for name, parameter in self.model.named_parameters()}
            for payload in payloads.values():
                payload.read_only_arrays = reference
        return payloads

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        previous = {name: parameter.detach().clone() for name, parameter in self.model.named_parameters()}
        summary = super().aggregate(round_number, replies)
        self.previous = previous
        return summary

    def state_dict(self) -> dict[str, Any]:
        previous = None if self.previous is None else {n: t.clone() for n, t in self.previous.items()}
        return {**super().state_dict(), "previous": previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous = state["previous"]


class FedGaLAHyperparameters(SimCLRHyperparameters):
    """FedGaLA's hyperparameters (module docstring for the sources).

    Attributes:
        objective: the self-supervised objective (SimCLR, Sec. 4; Table 3: MoCo, BYOL).
        local_alignment: Algorithm 1 lines 17-21 (Table 4, "w/o LA").
        global_alignment: Algorithm 1 lines 7-10 (Table 4, "w/o GA").
        alignment_threshold: τ of line 18 (0, Fig. 2d).
        alignment_iterations: ``iter`` of line 7 (3, Fig. 3a).
        unaligned_update: ``discard`` (FedGaLA) or ``reweight`` (Table 6).
        reweight_factor: Table 6's factor (0.001, 0.01, 0.1; default 0.01, its best mean).
    """

    objective: Literal[tuple(OBJECTIVES)] = "simclr"
    local_alignment: bool = True
    global_alignment: bool = True
    alignment_threshold: float = Field(0.0, ge=-1, le=1)
    alignment_iterations: int = Field(3, ge=0)
    unaligned_update: Literal["discard", "reweight"] = "discard"
    reweight_factor: float = Field(0.01, gt=0, le=1)


class FedGaLATrainer(SelfSupervisedTrainer):
    """A self-supervised client with FedGaLA's local alignment between backward and step."""

    hparams: FedGaLAHyperparameters

    def begin_round(self, model: SelfSupervisedModel, payload: Payload, state: dict[str, Any]) -> None:
        super().begin_round(model, payload, state)
        reference = reference_of(payload)
        self.local_alignment = (LocalAlignment(model, reference, self.hparams.alignment_threshold,
                                               self.hparams.unaligned_update, self.hparams.reweight_factor)
                                if self.hparams.local_alignment and reference else None)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.local_alignment is not None:
            self.local_alignment(optimizer)

    def round_metrics(self, state: dict[str, Any]) -> dict[str, float]:
        return self.local_alignment.metrics() if self.local_alignment is not None else {}


FEDGALA_RUN_SETTINGS = {"rounds": 100, "local_epochs": 7, "batch_size": 128, "image_size": 32}
"""FedGaLA's run settings on PACS, Office-Home, TerraIncognita and DomainNet (one value for all
four): "100 communication rounds with 7 local epochs" (Sec. 4, Implementation details; App. B.3),
"a batch size of 128" (App. B.3), images "resized to 32 x 32" for all datasets (App. B.1). The
paper's DomainNet is a 20-class subset with three training and three test domains, which FedBed's
``DomainNet`` (all six domains, all classes) does not reproduce: only the budget applies there."""


@register_algorithm
class FedGaLA(SelfSupervisedAlgorithm):
    """FedGaLA (``fedgala.md``, Algorithm 1): local and global gradient alignment on SimCLR clients."""

    name = "fedgala"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    summary = ("FedGaLA (Pourpanah et al., AAAI 2025; fedgala.md): SimCLR clients that skip layer updates "
               "unaligned with the global model's last change (local alignment) and a server reweighting "
               "client updates by their alignment (global alignment).")
    hyperparameters = FedGaLAHyperparameters
    trainer_class = FedGaLATrainer
    dataset_run_settings = {dataset: FEDGALA_RUN_SETTINGS for dataset in ("PACS", "OfficeHome", "TerraIncognita", "DomainNet")}

    def build_objective(self, hparams: FedGaLAHyperparameters) -> Objective:
        return OBJECTIVES[hparams.objective].from_hyperparameters(hparams)

    def create_strategy(self, hparams: FedGaLAHyperparameters, context: AlgorithmContext) -> GlobalAlignmentStrategy:
        iterations = hparams.alignment_iterations if hparams.global_alignment else 0
        return GlobalAlignmentStrategy(context.seed, GlobalAlignmentAggregation(context.seed, iterations),
                                       send_reference=hparams.local_alignment)


class GlobalAlignmentHyperparameters(LocalTrainingHyperparameters):
    """FedAvg's client optimiser and ``iter`` of FedGaLA's global alignment (3, Fig. 3a)."""

    alignment_iterations: int = Field(3, ge=0)


@register_algorithm
class FedAvgGlobalAlignment(SupervisedAlgorithm):
    """FedAvg's supervised clients with FedGaLA's global gradient alignment on the server."""

    name = "fedavg_global_alignment"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    server_rule = True
    summary = ("FedAvg clients; server reweights client updates by their alignment with the consensus "
               "(FedGaLA, fedgala.md Alg. 1, lines 5-13).")
    hyperparameters = GlobalAlignmentHyperparameters

    def create_aggregation(self, hparams: GlobalAlignmentHyperparameters, context: AlgorithmContext) -> GlobalAlignmentAggregation:
        return GlobalAlignmentAggregation(context.seed, hparams.alignment_iterations)

    def create_strategy(self, hparams: GlobalAlignmentHyperparameters, context: AlgorithmContext) -> GlobalAlignmentStrategy:
        return GlobalAlignmentStrategy(context.seed, self.create_aggregation(hparams, context))


def global_gradient_alignment(
    updates: torch.Tensor, weights: torch.Tensor, iterations: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedGaLA's global gradient alignment (``fedgala.md``, Sec. 3.3, Algorithm 1 lines 5-10).

    Starting from the FedAvg update ``ĝ = Σ_k (n_k/n) g_k`` (line 6), ``iterations`` times:
    ``w_k = (cos(g_k, ĝ) + 1) / 2`` (line 8), ``w_k ← w_k / Σ_j w_j`` (line 9) and
    ``ĝ = Σ_k w_k g_k`` (line 10). Clients whose update points along the consensus get more
    weight; a client pointing against it keeps a weight in [0, 1/2] before normalisation (the
    paper does not drop clients at the server).

    Args:
        updates: ``[K, P]`` client updates ``g_k = Θ_k − Θ^{t−1}`` (any unit: parameter change).
        weights: ``[K]`` the FedAvg weights n_k / n of line 6 (non-negative, summing to 1).
        iterations: ``iter`` of line 7 (the paper's default and Fig. 3a's best: 3); 0 gives
            FedAvg's update and weights.

    Returns:
        ``(aggregated update [P], alignment weights [K])``, float64; the weights sum to 1. An
        all-zero update has cosine 0 with everything (weight 1/2 before normalisation); when
        every cosine is −1 (impossible for the consensus of the same vectors, but for
        safety) the weights fall back to the FedAvg weights.

    Raises:
        ValueError: ``updates`` not ``[K, P]`` with K >= 1, ``weights`` not ``[K]``, or
            ``iterations < 0``.
    """
    if updates.dim() != 2 or updates.shape[0] < 1:
        raise ValueError(f"updates must be [K, P] with K >= 1, got shape {tuple(updates.shape)}")
    if weights.shape != (updates.shape[0],):
        raise ValueError(f"weights must be [K] = [{updates.shape[0]}], got shape {tuple(weights.shape)}")
    if iterations < 0:
        raise ValueError(f"the number of alignment iterations must be >= 0, got {iterations}")
    updates, current = updates.to(torch.float64), weights.to(torch.float64)
    aggregated = current @ updates
    for _ in range(iterations):
        alignment = (cosine_similarities(updates, aggregated[None, :])[:, 0] + 1.0) / 2.0
        total = float(alignment.sum())
        current = alignment / total if total > 0 else weights.to(torch.float64)
        aggregated = current @ updates
    return aggregated, current


def update_alignment(step: torch.Tensor, reference: torch.Tensor) -> float:
    """Cosine between a parameter tensor's update direction and a reference change of it.

    FedGaLA's local alignment test (``fedgala.md``, Sec. 3.3, Algorithm 1 line 18) compares one
    layer's batch step with the global model's last change ĝ_est = θ^(t) − θ^(t−1). Both must be
    parameter changes (a gradient g points uphill; its step is −η·g), which the caller ensures.

    Args:
        step: the proposed change of one parameter tensor (any shape).
        reference: the reference change, same number of elements.

    Returns:
        The cosine in [−1, 1]; ``nan`` when either vector is all zeros (undefined: the caller
        decides what an undefined cosine means).

    Raises:
        ValueError: the two have different numbers of elements.
    """
    if step.numel() != reference.numel():
        raise ValueError(f"an update of {step.numel()} elements cannot be compared with a reference of {reference.numel()}")
    a, b = step.detach().reshape(-1).to(torch.float64), reference.detach().reshape(-1).to(torch.float64)
    scale = float(a.norm() * b.norm())
    return float(a @ b) / scale if scale > 0 else float("nan")


__all__ = ["FedAvgGlobalAlignment", "FedGaLA", "FedGaLAHyperparameters", "GlobalAlignmentStrategy", "LocalAlignment",
           "reference_of"]
