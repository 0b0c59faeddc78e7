"""MCGDM: Multi-source Collaborative Gradient Discrepancy Minimization (``mcgdm.md``).

Each client i trains its featurizer F_i and classifier head C_i on (Eq. 8)

    L_loc = ½ (CE(x) + CE(A(x))) + λ · L_intra + (1 − λ) · L_inter,

- L_intra = 1 − cos(g_i, g'_i) (Eq. 2), with g_i = ∇_{C_i} CE(x; F_i ∘ C_i) (Eq. 3) and
  g'_i = ∇_{C_i} CE(A(x); F_i ∘ C_i) (Eq. 4): the head's gradients on the original batch and on
  its augmented view A(x) (RandAugment, the paper's default);
- L_inter = Σ_j (1 − cos(g'_i, g_j^{t−1})) (Eq. 5-7), with g_j^{t−1} = ∇_{C_j^{t−1}} CE(x; F_i ∘
  C_j^{t−1}): the gradient of client j's head from the previous round, applied to this client's
  features of the original batch.

Gradients are taken with respect to the classifier head only (the paper's Remark) and with
``create_graph=True``, so both matching losses train the featurizer end to end through g_i, g'_i
and g_j (the heads C_j^{t−1} themselves are constants).

The server (Eq. 9) averages the clients' models weighted by n_k / n and sends every client the
global model and, as read-only payload arrays, every replying client's head of the previous round
(``head<j>/<parameter>``); they are neither averaged nor echoed, and their bytes appear in the
round's communication telemetry. Rows whose loss reads no head (Table 4 without L_inter, Table
5's KL and SupCon) get none: their payloads are FedAvg's.

Readings where the paper leaves a choice (each tested):

- **Which heads j.** Eq. 5 sums over j = 1..n and Fig. 2(c) draws {C_j^{t−1}}_{j=1}^n, while the
  text says "other domains". The default follows the equation (the client's own previous head
  included, ``include_own_head=True``); ``include_own_head=false`` follows the text.
- **Round 1** has no previous heads: L_inter = 0 (the loss is then ½(CE + CE') + λ L_intra).
- **Sum or mean over the heads.** Eq. 5 sums the n terms (the default, ``inter_reduction: sum``);
  the authors' training code (``weiyikang/FedGM_torch``, ``train.py``) divides the sum by the
  number of source heads (``inter_reduction: mean``), which makes L_inter n times weaker against
  the cross-entropy.
- **One cosine or one per parameter.** Eq. 2 and 5 take sim(·, ·) of the head's gradients, read
  here as one cosine of the flattened gradient (weight and bias together; the default,
  ``gradient_cosine: flattened``). The authors' code takes one cosine per parameter tensor: for
  the weight ``[C, d]`` the mean over its C rows (one per class) of the rows' cosines, for the
  bias ``[C]`` the cosine of the vectors, and 1 − cosine averaged over the head's parameters
  (``gradient_cosine: per_parameter``).
- **CE** is the batch mean, not Eq. 1's sum over the batch (the cosines are unchanged by the
  scale; the classification term is the usual mean).
- **Learning rate.** "decayed by the cosine schedule from 0.001 to 0.0001 during training", read
  per round: round t of R trains at lr_min + (lr_max − lr_min)(1 + cos(π (t − 1) / (R − 1))) / 2, so
  round 1 uses 1e-3 and round R 1e-4 (the shared ``client_lr_schedule: cosine`` of
  :mod:`fedbed.algorithms.base.local_training`, MCGDM's default, which any supervised method can use:
  Table 4's Baseline is FedAvg with the same schedule); the client reads t and R from the
  engine's payload config, so a resumed run continues the schedule exactly.

The alternative alignments of Table 5 replace both matching terms by one term between x and A(x)
(``alignment``; the loss is then ½(CE(x) + CE(A(x))) + alignment_weight · L_align):

- ``kl``: KL(p(x) ‖ p(A(x))) of the softmax of the logits, batch mean (StyleNeo's logit-level
  consistency, Kang et al. 2022);
- ``supcon``: the supervised contrastive loss (Khosla et al. 2020, Eq. 2) over the 2B
  L2-normalised features of x and A(x), positives = the other views of the same class,
  temperature ``supcon_temperature``;
- ``cofc``: collaboration of frozen classifiers (COPA, Wu and Gong 2021): the previous heads the
  server sent (the other clients', and the client's own unless ``include_own_head=false``),
  frozen, classify this client's features of A(x); their mean cross-entropy.

Defaults (Implementation Details): SGD with momentum 0.9 and weight decay 5e-4, learning rate 1e-3
decayed to 1e-4 (Office-Home 2e-3), λ = 0.3 on PACS and 0.8 on Office-Home and VLCS. Batch 16
(Office-Home 30), 40 rounds of 1 local epoch and MixStyle in the featurizer (Table 4: MCGDM is its
Baseline, FedAvg + MixStyle, plus RandAugment and the two matching terms) are run settings: on
PACS, VLCS and Office-Home they fill the settings a run leaves unset
(:attr:`MCGDM.dataset_run_settings`), so ``fedbed run --algorithm mcgdm --dataset PACS`` trains
with them; on other datasets (RotatedMNIST) the general run defaults apply. Table 4's rows: Baseline =
``algorithm: fedavg, mixstyle: true``; + RandAug = ``mcgdm`` with ``use_intra=false,
use_inter=false`` (½(CE(x) + CE(A(x))); FedAvg with the run's ``augmentation`` would train on
A(x) alone); + intra, + inter, both = the switches.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
    SupervisedTrainer,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.data.augmentation import AUGMENTATIONS, Augmentation
from fedbed.federation.local_data import Batch
from fedbed.federation.messages import Payload, Reply, RoundSummary
from fedbed.models import HEAD_PREFIX

class MCGDMHyperparameters(LocalTrainingHyperparameters):
    """MCGDM's hyperparameters (``mcgdm.md``, Implementation Details; ablations of Tables 4 and 6).

    Attributes:
        matching_lambda: λ of Eq. 8, the weight of L_intra against L_inter (PACS 0.3).
        client_lr_schedule: ``cosine`` (from ``client_lr`` 1e-3 to ``client_final_lr`` 1e-4).
        use_intra: include L_intra (Table 4's ablation).
        use_inter: include L_inter (Table 4's ablation).
        include_own_head: whether Eq. 5's sum includes the client's own previous head.
        inter_reduction: ``sum`` (Eq. 5) or ``mean`` (the authors' code) over the previous heads.
        gradient_cosine: ``flattened`` (one cosine of the head's gradient, Eq. 2 and 5) or
            ``per_parameter`` (the authors' code; see the module docstring).
        augmentation: A(x), a name of :mod:`fedbed.data.augmentation` (RandAugment).
        alignment: ``gradient`` (MCGDM) or one of Table 5's alternatives, ``kl``, ``supcon``,
            ``cofc`` (see the module docstring).
        alignment_weight: the weight of an alternative alignment term.
        supcon_temperature: τ of the supervised contrastive loss.
    """

    client_optimizer: Literal["adam", "sgd"] = "sgd"
    client_lr: float = Field(1e-3, gt=0)
    client_momentum: float = Field(0.9, ge=0, lt=1)
    client_weight_decay: float = Field(5e-4, ge=0)
    client_lr_schedule: Literal["constant", "cosine"] = "cosine"
    client_final_lr: float = Field(1e-4, gt=0)
    matching_lambda: float = Field(0.3, ge=0, le=1)
    use_intra: bool = True
    use_inter: bool = True
    include_own_head: bool = True
    inter_reduction: Literal["sum", "mean"] = "sum"
    gradient_cosine: Literal["flattened", "per_parameter"] = "flattened"
    augmentation: Literal[tuple(AUGMENTATIONS)] = "randaugment"
    alignment: Literal["gradient", "kl", "supcon", "cofc"] = "gradient"
    alignment_weight: float = Field(1.0, ge=0)
    supcon_temperature: float = Field(0.1, gt=0)

    @property
    def uses_previous_heads(self) -> bool:
        """Whether the client's loss reads the previous round's heads: L_inter (Eq. 5) or CoFC."""
        return (self.alignment == "gradient" and self.use_inter) or self.alignment == "cofc"


def head_gradient(head: nn.Module, parameters: dict[str, torch.Tensor], features: torch.Tensor,
                  targets: torch.Tensor) -> list[torch.Tensor]:
    """∇ of CE(head(features), targets) with respect to the head's ``parameters`` (a dict of
    tensors that require gradients), one tensor per parameter in its shape, kept differentiable
    (``create_graph=True``) with respect to ``features`` and the parameters (Eq. 3, 4, 7).

    Args:
        head: the classifier module (its own parameters are replaced by ``parameters``).
        parameters: name -> tensor, the head's parameters to differentiate against.
        features: ``[B, d]``.
        targets: ``[B]`` labels.
    """
    logits = functional_call(head, parameters, (features,))
    loss = nn.functional.cross_entropy(logits, targets)
    return list(torch.autograd.grad(loss, list(parameters.values()), create_graph=True))


def comparable_gradient(gradients: list[torch.Tensor], cosine: str = "flattened") -> list[torch.Tensor]:
    """A head's per-parameter gradients (:func:`head_gradient`) in the form sim(·, ·) compares
    (:func:`gradient_discrepancy`).

    Args:
        gradients: one tensor per head parameter.
        cosine: ``flattened``: one vector ``[P]``, the concatenation of the flattened gradients
            (Eq. 2 and 5 read literally); ``per_parameter``: the tensors as they are (the authors'
            code).

    Raises:
        ValueError: an unknown ``cosine``.
    """
    if cosine == "flattened":
        return [torch.cat([g.reshape(-1) for g in gradients])]
    if cosine == "per_parameter":
        return gradients
    raise ValueError(f"unknown gradient_cosine {cosine!r}; choose flattened or per_parameter")


def gradient_discrepancy(first: list[torch.Tensor], second: list[torch.Tensor]) -> torch.Tensor:
    """1 − sim(first, second) of two gradients of the same head (Eq. 2, 5), a scalar in [0, 2],
    from :func:`comparable_gradient`: one vector each gives 1 − its cosine; per-parameter tensors
    give, per parameter, the mean over rows of the rows' cosines for a tensor of two or more
    dimensions (a linear head's weight ``[C, d]``: one row per class) or the cosine of the
    vectors (a bias ``[C]``), and then 1 − cosine averaged over the parameters (the authors' code).
    """
    if len(first) == 1 and first[0].dim() == 1:
        return 1.0 - nn.functional.cosine_similarity(first[0], second[0], dim=0)
    similarities = [nn.functional.cosine_similarity(a.reshape(len(a), -1), b.reshape(len(b), -1), dim=1).mean()
                    if a.dim() > 1 else nn.functional.cosine_similarity(a, b, dim=0) for a, b in zip(first, second)]
    return (1.0 - torch.stack(similarities)).mean()


def matching_losses(model: nn.Module, inputs: torch.Tensor, augmented: torch.Tensor, targets: torch.Tensor,
                    previous_heads: list[dict[str, torch.Tensor]], inter_reduction: str = "sum",
                    gradient_cosine: str = "flattened") -> dict[str, torch.Tensor]:
    """The terms of Eq. 8 on one batch.

    Args:
        model: a :class:`~fedbed.models.DomainClassifier` (``featurizer`` F_i, ``classifier`` C_i).
        inputs: the original batch x ``[B, C, H, W]``.
        augmented: its augmented view A(x), same shape.
        targets: ``[B]``.
        previous_heads: each C_j^{t−1} as a dict of its parameters (names of ``model.classifier``).
        inter_reduction: ``sum`` (Eq. 5) or ``mean`` of the terms over the previous heads.
        gradient_cosine: how sim(·, ·) compares two head gradients (:func:`comparable_gradient`).

    Returns:
        ``{"ce", "ce_augmented", "intra", "inter"}`` scalar tensors (``inter`` is 0 without heads).

    Raises:
        ValueError: an unknown ``inter_reduction`` or ``gradient_cosine``.
    """
    if inter_reduction not in ("sum", "mean"):
        raise ValueError(f"unknown inter_reduction {inter_reduction!r}; choose sum or mean")
    head = model.classifier
    parameters = dict(head.named_parameters())
    features, features_augmented = model.featurizer(inputs), model.featurizer(augmented)
    ce = nn.functional.cross_entropy(head(features), targets)
    ce_augmented = nn.functional.cross_entropy(head(features_augmented), targets)
    g = comparable_gradient(list(torch.autograd.grad(ce, list(parameters.values()), create_graph=True)), gradient_cosine)
    g_augmented = comparable_gradient(list(torch.autograd.grad(ce_augmented, list(parameters.values()), create_graph=True)),
                                      gradient_cosine)
    intra = gradient_discrepancy(g, g_augmented)
    inter = features.new_zeros(())
    for previous in previous_heads:
        frozen = {name: tensor.detach().clone().requires_grad_(True) for name, tensor in previous.items()}
        g_j = comparable_gradient(head_gradient(head, frozen, features, targets), gradient_cosine)
        inter = inter + gradient_discrepancy(g_augmented, g_j)
    if inter_reduction == "mean" and previous_heads:
        inter = inter / len(previous_heads)
    return {"ce": ce, "ce_augmented": ce_augmented, "intra": intra, "inter": inter}


def supervised_contrastive_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Khosla et al. 2020, Eq. 2 (L^sup_out): for each anchor i of the N features,
    −1/|P(i)| Σ_{p∈P(i)} log(exp(z_i·z_p/τ) / Σ_{a≠i} exp(z_i·z_a/τ)), P(i) the other samples of
    its class; the mean over anchors that have a positive.

    Args:
        features: ``[N, d]`` (L2-normalised here).
        labels: ``[N]``.
        temperature: τ > 0.
    """
    z = nn.functional.normalize(features, dim=1)
    logits = z @ z.T / temperature
    self_mask = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_probability = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    positives = (labels[:, None] == labels[None, :]) & ~self_mask
    counts = positives.sum(dim=1)
    has_positive = counts > 0
    per_anchor = -(log_probability.masked_fill(~positives, 0.0)).sum(dim=1)[has_positive] / counts[has_positive]
    return per_anchor.mean() if bool(has_positive.any()) else features.new_zeros(())


def alternative_alignment(name: str, model: nn.Module, inputs: torch.Tensor, augmented: torch.Tensor, targets: torch.Tensor,
                          previous_heads: list[dict[str, torch.Tensor]], temperature: float) -> dict[str, torch.Tensor]:
    """The classification terms and one of Table 5's alignment terms (``kl``, ``supcon``, ``cofc``).

    Returns:
        ``{"ce", "ce_augmented", "align"}`` scalar tensors (``cofc`` without heads: 0).

    Raises:
        ValueError: an unknown ``name``.
    """
    features, features_augmented = model.featurizer(inputs), model.featurizer(augmented)
    logits, logits_augmented = model.classifier(features), model.classifier(features_augmented)
    terms = {"ce": nn.functional.cross_entropy(logits, targets),
             "ce_augmented": nn.functional.cross_entropy(logits_augmented, targets)}
    if name == "kl":
        terms["align"] = nn.functional.kl_div(nn.functional.log_softmax(logits_augmented, dim=1),
                                              nn.functional.log_softmax(logits, dim=1), reduction="batchmean", log_target=True)
    elif name == "supcon":
        terms["align"] = supervised_contrastive_loss(torch.cat([features, features_augmented]), torch.cat([targets, targets]), temperature)
    elif name == "cofc":
        losses = [nn.functional.cross_entropy(functional_call(model.classifier, {k: v.detach() for k, v in head.items()},
                                                              (features_augmented,)), targets) for head in previous_heads]
        terms["align"] = torch.stack(losses).mean() if losses else features.new_zeros(())
    else:
        raise ValueError(f"unknown alignment {name!r}; choose gradient, kl, supcon or cofc")
    return terms


def previous_heads_of(payload: Payload) -> list[dict[str, torch.Tensor]]:
    """The heads C_j^{t−1} the server sent (read-only arrays ``head<j>/<parameter>``), by j."""
    heads: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in payload.read_only_arrays.items():
        if name.startswith("head"):
            client, _, parameter = name.partition("/")
            heads.setdefault(int(client.removeprefix("head")), {})[parameter] = tensor
    return [heads[j] for j in sorted(heads)]


class MCGDMTrainer(SupervisedTrainer):
    """The MCGDM client: Eq. 8 on every batch (CE on x and on its RandAugment view, the matching
    terms weighted by λ and 1 − λ), with the round's cosine-decayed learning rate; the matching
    terms' batch means go to the reply (``intra``, ``inter``, or ``align`` for Table 5's
    alternatives)."""

    hparams: MCGDMHyperparameters

    def __init__(self, hparams: MCGDMHyperparameters, context: AlgorithmContext) -> None:
        super().__init__(hparams, context)
        self.augmentation = Augmentation(hparams.augmentation)  # x stays x; RandAugment(x) is the batch's view
        self.augment_inputs = False

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        hparams = self.hparams
        heads = previous_heads_of(payload) if hparams.uses_previous_heads else []
        if hparams.alignment != "gradient":
            terms = alternative_alignment(hparams.alignment, model, batch.inputs, batch.views[0], batch.targets, heads,
                                          hparams.supcon_temperature)
            self.log_metric("align", terms["align"])
            return 0.5 * (terms["ce"] + terms["ce_augmented"]) + hparams.alignment_weight * terms["align"]
        terms = matching_losses(model, batch.inputs, batch.views[0], batch.targets, heads,
                                hparams.inter_reduction, hparams.gradient_cosine)
        self.log_metric("intra", terms["intra"])
        self.log_metric("inter", terms["inter"])
        loss = 0.5 * (terms["ce"] + terms["ce_augmented"])
        if hparams.use_intra:
            loss = loss + hparams.matching_lambda * terms["intra"]
        if hparams.use_inter:
            loss = loss + (1.0 - hparams.matching_lambda) * terms["inter"]
        return loss


class MCGDMStrategy(FedAvgStrategy):
    """FedAvg (Eq. 9) that also sends every client the previous round's heads as read-only arrays.

    Args:
        seed: the run's seed.
        include_own_head: send a client its own previous head too (Eq. 5's j = i term).
        send_heads: ``False`` for the ablations whose loss reads no head (Table 4 without
            L_inter, Table 5's KL and SupCon): the server then sends none, so their payloads
            and the bytes in the telemetry are FedAvg's.
    """

    def __init__(self, seed: int = 0, include_own_head: bool = True, send_heads: bool = True) -> None:
        super().__init__(seed)
        self.include_own_head = include_own_head
        self.send_heads = send_heads
        self.heads: dict[int, dict[str, torch.Tensor]] = {}

    def initialize(self, model: nn.Module, clients) -> None:
        if not any(name.startswith(HEAD_PREFIX) for name in model.state_dict()):
            raise ValueError("MCGDM matches the gradients of the classifier head: the model needs a 'classifier'")
        super().initialize(model, clients)

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        payloads = super().configure_round(round_number, selected)
        if not self.send_heads:
            return payloads
        for client, payload in payloads.items():
            payload.read_only_arrays = {
                f"head{j}/{name}": tensor for j, head in sorted(self.heads.items())
                if self.include_own_head or j != client for name, tensor in head.items()
            }
        return payloads

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        if self.send_heads:
            self.heads = {client: {name.removeprefix(HEAD_PREFIX): tensor.clone() for name, tensor in reply.arrays.items()
                                   if name.startswith(HEAD_PREFIX)} for client, reply in replies.items()}
        return super().aggregate(round_number, replies)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "heads": {c: {n: t.clone() for n, t in h.items()} for c, h in self.heads.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.heads = state["heads"]


PAPER_RUN_SETTINGS = {"rounds": 40, "local_epochs": 1, "batch_size": 16, "mixstyle": True}
"""MCGDM's run settings on PACS and VLCS (Office-Home: batch 30). Implementation Details: 40
rounds of 1 local epoch, batch 16; Table 4: MCGDM is its Baseline (FedAvg + MixStyle) plus
RandAugment and the matching terms (Table 1's MCGDM, 86.2 on PACS, is Table 4's last row)."""


@register_algorithm
class MCGDM(SupervisedAlgorithm):
    """MCGDM (``mcgdm.md``): intra- and inter-domain gradient matching on the classifier head."""

    name = "mcgdm"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    summary = ("MCGDM (Wei and Han, AAAI 2024; mcgdm.md): CE on x and RandAugment(x) + λ intra-domain "
               "+ (1−λ) inter-domain gradient matching on the classifier head (Eq. 8); FedAvg server sending "
               "every client's previous head (Eq. 9) to the losses that read them.")
    hyperparameters = MCGDMHyperparameters
    trainer_class = MCGDMTrainer
    draws_its_own_views = True
    dataset_defaults = {  # mcgdm.md, Implementation Details
        "OfficeHome": {"matching_lambda": 0.8, "client_lr": 2e-3},
        "VLCS": {"matching_lambda": 0.8},
    }
    dataset_run_settings = {
        "PACS": PAPER_RUN_SETTINGS,
        "VLCS": PAPER_RUN_SETTINGS,
        "OfficeHome": {**PAPER_RUN_SETTINGS, "batch_size": 30},
    }

    def create_strategy(self, hparams: MCGDMHyperparameters, context: AlgorithmContext) -> MCGDMStrategy:
        return MCGDMStrategy(context.seed, hparams.include_own_head, send_heads=hparams.uses_previous_heads)


__all__ = ["MCGDM", "MCGDMStrategy", "MCGDMTrainer", "matching_losses"]
