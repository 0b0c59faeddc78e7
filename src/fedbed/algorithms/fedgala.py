"""FedGaLA (``fedgala.md``): federated unsupervised domain generalisation by global and local alignment of
gradients, on the self-supervised clients of :mod:`fedbed.algorithms.base.self_supervised`.

**Local alignment** (Sec. 3.3, Algorithm 1 lines 14-22). The server sends every client, as read-only payload arrays
``reference/<parameter>``, the global model's last change ĝ_est^(l,t) = θ^(l,t) − θ^(l,t−1) (it keeps the previous
global model, so a client that skipped rounds still gets the right one). After each backward pass the client skips
a layer's update when the cosine of its step with ĝ_est is at most τ (line 18 keeps it above τ; τ = 0, Fig. 2d).
Readings of the paper, each tested in ``tests/test_fedgala.py``:

- **A layer is one parameter tensor** (weight or bias), as the authors' code loops over ``named_parameters``.
- **Like with like** (``compared_gradient: step``). ĝ_est is a parameter change (downhill), a batch gradient g
  points uphill, so the step −g is compared (whatever the optimiser; line 20 writes SGD): an update along the global
  change is kept, one against it dropped, as Sec. 3.3's rationale ("not aligned with the global model") reads.
- **Round 1** has no previous global model: no reference is sent, nothing compared, no discard ratio logged.
- **An all-zero reference** (a layer that did not change: the classifier head the loss never trains, a layer every
  client discarded) has no direction: the cosine is undefined and the update kept (else it never moves again).
- **Skipping** sets the gradient to ``None``: the optimiser (Adam's moments, weight decay) leaves the tensor alone.
- **Discard ratio** (Fig. 2b): per parameter, discarded over compared steps in the round; ``discard_ratio`` over all
  compared (parameter, step) pairs; reply metrics whose client means are the round's metrics of those names.

**Global alignment** (lines 5-13): :func:`global_gradient_alignment` on the client updates g_i = Θ_i − Θ^{t−1} over
every trainable parameter as one vector (``global_alignment_scope: model``, as the Algorithm writes it), from the
FedAvg update, ``iter`` = 3 times; the global model moves by the result; buffers (BatchNorm statistics) are FedAvg's
n_k/n average. Weights logged per round (``telemetry.weights``); ``fedavg_global_alignment`` is this rule alone.

**Ablations** (Tables 3, 4, 6, 7): ``global_alignment``, ``local_alignment`` (both off is FedSimCLR, Table 4),
``unaligned_update=reweight`` with ``reweight_factor`` (Table 6: the unaligned step is scaled, not dropped),
``objective`` (Table 3: MoCo or BYOL; FedBed also offers SimSiam, the FedSimSiam baseline of Table 1; each with
its defaults, but FedGaLA's ``temperature`` (MoCo) and optimiser), Table 7's ``l2_coefficient`` and
``proximal_coefficient``. Defaults: Adam 3e-3, batch 128, 7 local epochs, 100 rounds (App. B.3; run settings,
``docs/configs/pacs32-fedgala.yaml``), τ = 0 (Fig. 2d, Sec. 5.4), ``iter`` = 3 (Fig. 3a, Sec. 3.3), temperature 0.5
(SimCLR's, Chen et al. 2020; the paper gives none).

**Where the authors' code differs from the paper** (github.com/MahdiyarMM/FedGaLA: ``main.py``, ``utils.py``,
``models.py``, ``data/datasets.py``). Switched, all at once by ``reading: authors_code`` (an explicit switch wins):

1. ``compared_gradient: gradient``: ``utils.py`` ``client_update`` compares +``param.grad`` (per named parameter)
   with the global change, keeping exactly the updates that undo it, dropping it when the cosine is below
   ``--delta_threshold``, −0.1 (``main.py``), which the reading sets as τ (a cosine equal to τ, or a zero reference's
   0 from ``F.cosine_similarity``, is kept there; measure zero, or the same at τ ≤ 0: not switched).
2. ``global_alignment_scope: per_parameter``: ``utils.py`` ``Aggregation_by_Alignment`` runs ``AbyA`` once per
   state-dict entry (logged ``weights``: their mean over the parameters), buffers included (FedAvg's here).
3. ``consensus_weighting: size_and_alignment``: ``AbyA`` gets the updates times the clients' shares and starts from
   their plain mean: the consensus Σ w_k (n_k/n) g_k carries the sizes, the model moves by Σ w_k g_k, and 0
   iterations give 1/K, not n_k/n.
4. ``uniform_weight_share`` γ (``--gamma``, 0; ``run_a.sh`` tries 0.25-0.75): ``AbyA`` returns (1 − γ)·w + γ/K.

Not switched (run settings, outside this file, or one round of 100):

- Timing (``main.py`` ``main``): the first aggregation returns no change, so local alignment starts in round 3
  (θ^2 − θ^1) and round 1's ``AbyA`` compares client models, not updates; ``main.py`` at 9af310a never keeps the
  previous model: there local alignment never runs and ``AbyA`` always compares models.
- Optimiser (``main.py``): SimCLR's Adam at 1e-4 (App. B.3: 3e-3; ``client_lr: 1e-4``), no weight decay or schedule,
  built once per client for the run (Adam's moments span rounds; FedBed's trainer builds it every round); MoCo,
  SimSiam, BYOL: SGD 0.03, 0.025, 0.03, momentum 0.9, weight decay 1e-4 (App. B.3: 3e-4; MoCo 0.025, others 0.03).
  FedAvg's shares (``main.py``) are each client's batches over all batches (``drop_last``), ≈ n_k/n.
- SimCLR (``models.py``): ``info_nce_loss`` at temperature 0.07 (``temperature: 0.07``; ``main.py``'s
  ``NT_XentLoss(0.5)`` is unused; the paper gives none); projector ``MLP`` 512 → 4096 (BatchNorm, ReLU) → 2048 and
  CIFAR ResNet-18 (3×3 stem, 4×4 pooling) as here. Views (``data/datasets.py`` ``get_augmentations``): colour
  jitter of strength 1 (0.8, 0.8, 0.8, 0.2), FedBed's ``simclr`` 0.5; crop 0.08-1, flip, grayscale 0.2, no blur.
- Linear probe (``utils.py`` ``linear_evaluation``): on the projector's 2048-d output (``backbone.fc`` is the MLP),
  augmented training images, the first 10 % of the domain's CSV rows; FedBed probes the featurizer.
- Discard ratio: per epoch, first client only. BYOL's target network never moves (``client_update`` calls no EMA
  update); MoCo's key encoder and queue are averaged with the model.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from fedbed.algorithms.base.local_training import LocalTrainingHyperparameters, SupervisedAlgorithm
from fedbed.algorithms.base.model_aggregation import ClientModels, FedAvgStrategy, ModelAggregation
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm, SelfSupervisedModel, SelfSupervisedTrainer
from fedbed.algorithms.base.self_supervised_objectives import OBJECTIVES, Objective, SimCLRHyperparameters
from fedbed.algorithms.base.update_aggregation import UpdateAggregation
from fedbed.federation.alignment import cosine_similarities
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary

REFERENCE_PREFIX = "reference/"
"""Read-only payload arrays ``reference/<parameter>``: the global model's last change."""

DISCARD_METRIC = "discard_ratio"
"""Reply and round metric: the share of compared layer updates that local alignment skipped."""


class LocalAlignment:
    """The before-step hook of FedGaLA's local alignment (module docstring for the readings): each parameter
    of ``model`` named in ``reference`` (name -> ĝ_est, same shape, else ``ValueError``) keeps its update only when
    the cosine of its step −g (``compared_gradient: step``) or of +g (``gradient``, the authors' code) with ĝ_est
    exceeds ``threshold`` τ; ``unaligned_update``: ``discard`` (Algorithm 1) or ``reweight`` (Table 6)."""

    def __init__(self, model: nn.Module, reference: dict[str, torch.Tensor], threshold: float = 0.0,
                 unaligned_update: str = "discard", reweight_factor: float = 0.01, compared_gradient: str = "step") -> None:
        self.parameters = [(name, p) for name, p in model.named_parameters() if name in reference]
        for name, parameter in self.parameters:
            if reference[name].shape != parameter.shape:
                raise ValueError(f"the reference change of {name} has shape {tuple(reference[name].shape)}, "
                                 f"the parameter {tuple(parameter.shape)}: server and client models differ")
        self.reference, self.threshold, self.unaligned_update = reference, threshold, unaligned_update
        self.reweight_factor, self.compared_gradient = reweight_factor, compared_gradient
        self.discarded = {name: 0 for name, _ in self.parameters}
        self.compared = dict.fromkeys(self.discarded, 0)

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        """Test every referenced parameter's step −g (or +g); skip or shrink the unaligned ones."""
        for name, parameter in self.parameters:
            if parameter.grad is None:
                continue
            cosine = update_alignment(-parameter.grad if self.compared_gradient == "step" else parameter.grad, self.reference[name])
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
        """``discard_ratio`` over all compared updates, ``discard_ratio/<parameter>`` per compared parameter (Fig. 2b)."""
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
    """:func:`global_gradient_alignment` of the client updates (``iterations`` = ``iter``, line 7; 0 is FedAvg, Table 4's
    "w/o GA"), on the whole update (``scope: model``) or on each parameter's segment (``per_parameter``, the authors'
    ``Aggregation_by_Alignment``, logging the mean weights); the other options are the function's."""

    def __init__(self, seed: int = 0, iterations: int = 3, scope: str = "model", consensus_weighting: str = "alignment",
                 uniform_weight_share: float = 0.0) -> None:
        super().__init__(seed)
        self.iterations, self.scope, self.options = iterations, scope, (consensus_weighting, uniform_weight_share)
        self.segments: list[int] | None = None  # the parameters' sizes in the updates' order, set by aggregate

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self.segments = [models.current[name].numel() for name in models.current if name in models.parameter_names]
        return super().aggregate(models)

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor, generator: torch.Generator):
        whole = self.scope == "model" or not self.segments or sum(self.segments) != updates.shape[1]
        parts = [global_gradient_alignment(part, weights, self.iterations, *self.options)
                 for part in ([updates] if whole else updates.split(self.segments, dim=1))]
        aggregated, alignment_weights = torch.cat([a for a, _ in parts]), torch.stack([w for _, w in parts]).mean(0)
        return aggregated, {"weights": alignment_weights.tolist(), "fedavg_weights": weights.tolist()}


class GlobalAlignmentStrategy(FedAvgStrategy):
    """FedGaLA's server: ``aggregation`` (global alignment by default, or a composed server rule) and, with
    ``send_reference``, the global model's last change sent to every client as ``reference/<parameter>``."""

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


AUTHORS_CODE = {"compared_gradient": "gradient", "alignment_threshold": -0.1, "global_alignment_scope": "per_parameter",
                "consensus_weighting": "size_and_alignment"}


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
        compared_gradient: ``step`` (−g, the paper's rationale) or ``gradient`` (+g: ``utils.py`` ``client_update``).
        global_alignment_scope: ``model`` (Algorithm 1) or ``per_parameter`` (``utils.py`` ``Aggregation_by_Alignment``).
        consensus_weighting: ``alignment`` (Algorithm 1) or ``size_and_alignment`` (``utils.py`` ``AbyA``'s input).
        uniform_weight_share: γ of ``utils.py`` ``AbyA`` (``main.py`` ``--gamma``, 0; not in the paper).
        reading: ``authors_code`` sets :data:`AUTHORS_CODE` for the switches not given; ``paper`` changes nothing.
    """

    objective: Literal[tuple(OBJECTIVES)] = "simclr"
    local_alignment: bool = True
    global_alignment: bool = True
    alignment_threshold: float = Field(0.0, ge=-1, le=1)
    alignment_iterations: int = Field(3, ge=0)
    unaligned_update: Literal["discard", "reweight"] = "discard"
    reweight_factor: float = Field(0.01, gt=0, le=1)
    compared_gradient: Literal["step", "gradient"] = "step"
    global_alignment_scope: Literal["model", "per_parameter"] = "model"
    consensus_weighting: Literal["alignment", "size_and_alignment"] = "alignment"
    uniform_weight_share: float = Field(0.0, ge=0, le=1)
    reading: Literal["paper", "authors_code"] = "paper"

    @model_validator(mode="before")
    @classmethod
    def _reading(cls, data: Any) -> Any:
        return {**AUTHORS_CODE, **data} if isinstance(data, dict) and data.get("reading") == "authors_code" else data


class FedGaLATrainer(SelfSupervisedTrainer):
    """A self-supervised client with FedGaLA's local alignment between backward and step."""

    hparams: FedGaLAHyperparameters

    def begin_round(self, model: SelfSupervisedModel, payload: Payload, state: dict[str, Any]) -> None:
        super().begin_round(model, payload, state)
        reference = reference_of(payload)
        hp = self.hparams
        self.local_alignment = (LocalAlignment(model, reference, hp.alignment_threshold, hp.unaligned_update,
                                               hp.reweight_factor, hp.compared_gradient)
                                if hp.local_alignment and reference else None)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.local_alignment is not None:
            self.local_alignment(optimizer)

    def round_metrics(self, state: dict[str, Any]) -> dict[str, float]:
        return self.local_alignment.metrics() if self.local_alignment is not None else {}


FEDGALA_RUN_SETTINGS = {"rounds": 100, "local_epochs": 7, "batch_size": 128, "image_size": 32}
"""FedGaLA's run settings on PACS, Office-Home, TerraIncognita and DomainNet: "100 communication rounds with 7
local epochs" (Sec. 4; App. B.3), "a batch size of 128" (App. B.3), images "resized to 32 x 32" (App. B.1). The
paper's DomainNet (20 classes, three training and three test domains) is not FedBed's: only the budget applies."""


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
    measured_failures = {"PACS": "at 32 px from scratch (hfedf_cnn, 1 local epoch a round, one seed) its linear probe is below "
                         "FedSimCLR's on every target at 20 rounds, and on photo falls further behind by 60 rounds (16.4 "
                         "points; its local alignment discards half of the steps throughout) (docs/results/pacs32-fedgala.md)"}

    def build_objective(self, hparams: FedGaLAHyperparameters) -> Objective:
        return OBJECTIVES[hparams.objective].from_hyperparameters(hparams)

    def create_strategy(self, hparams: FedGaLAHyperparameters, context: AlgorithmContext) -> GlobalAlignmentStrategy:
        aggregation = (GlobalAlignmentAggregation(context.seed, hparams.alignment_iterations, hparams.global_alignment_scope,
                                                  hparams.consensus_weighting, hparams.uniform_weight_share)
                       if hparams.global_alignment else GlobalAlignmentAggregation(context.seed, 0))  # "w/o GA": FedAvg
        return GlobalAlignmentStrategy(context.seed, aggregation, send_reference=hparams.local_alignment)


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


def global_gradient_alignment(updates: torch.Tensor, weights: torch.Tensor, iterations: int = 3,
                              consensus_weighting: str = "alignment", uniform_weight_share: float = 0.0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """FedGaLA's global gradient alignment (``fedgala.md``, Sec. 3.3, Algorithm 1 lines 5-10).

    From the FedAvg update ``ĝ = Σ_k (n_k/n) g_k`` (line 6), ``iterations`` times (``iter``, line 7; 0 gives
    FedAvg): ``w_k = (cos(g_k, ĝ) + 1) / 2`` (line 8), ``w_k ← w_k / Σ_j w_j`` (line 9), ``ĝ = Σ_k w_k g_k``
    (line 10); nobody is dropped, an all-zero update has cosine 0. ``size_and_alignment`` (the authors' ``AbyA``):
    the consensus is ``Σ_k w_k (n_k/n) g_k`` from w = 1/K; ``uniform_weight_share`` γ: w ← (1 − γ) w + γ/K.

    ``updates`` ``[K, P]`` are ``g_k = Θ_k − Θ^{t−1}``, ``weights`` ``[K]`` n_k / n (summing to 1); returns
    ``(Σ_k w_k g_k [P], w [K])`` in float64, w summing to 1 (were every cosine −1, impossible for a consensus of the
    same vectors, w falls back to ``weights``). Raises ``ValueError`` on other shapes or ``iterations < 0``.
    """
    if updates.dim() != 2 or updates.shape[0] < 1:
        raise ValueError(f"updates must be [K, P] with K >= 1, got shape {tuple(updates.shape)}")
    if weights.shape != (updates.shape[0],):
        raise ValueError(f"weights must be [K] = [{updates.shape[0]}], got shape {tuple(weights.shape)}")
    if iterations < 0:
        raise ValueError(f"the number of alignment iterations must be >= 0, got {iterations}")
    updates, current = updates.to(torch.float64), weights.to(torch.float64)
    sizes = current if consensus_weighting == "size_and_alignment" else torch.ones_like(current)
    if consensus_weighting == "size_and_alignment":
        current = torch.full_like(sizes, 1.0 / len(sizes))
    for _ in range(iterations):
        consensus = (current * sizes) @ updates
        alignment = (cosine_similarities(updates, consensus[None, :])[:, 0] + 1.0) / 2.0
        total = float(alignment.sum())
        current = alignment / total if total > 0 else weights.to(torch.float64)
    current = (1.0 - uniform_weight_share) * current + uniform_weight_share / len(current)
    return current @ updates, current


def update_alignment(step: torch.Tensor, reference: torch.Tensor) -> float:
    """Cosine of one parameter tensor's update direction with a reference change of it (Algorithm 1 line 18;
    the caller makes both parameter changes or passes the gradient by choice); ``nan`` when either is all zeros
    (undefined: the caller decides). Raises ``ValueError`` when their numbers of elements differ."""
    if step.numel() != reference.numel():
        raise ValueError(f"an update of {step.numel()} elements cannot be compared with a reference of {reference.numel()}")
    a, b = step.detach().reshape(-1).to(torch.float64), reference.detach().reshape(-1).to(torch.float64)
    scale = float(a.norm() * b.norm())
    return float(a @ b) / scale if scale > 0 else float("nan")


__all__ = ["FedAvgGlobalAlignment", "FedGaLA", "FedGaLAHyperparameters", "GlobalAlignmentStrategy", "LocalAlignment",
           "reference_of"]
