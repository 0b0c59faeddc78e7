"""FedSAM and FedASAM, with the server-side SWA option (Caldarola, Caputo, Ciccone, "Improving
Generalization in Federated Learning by Seeking Flat Minima", ECCV 2022, arXiv 2203.11834).

**Sources.** The paper's text was not available: only its abstract and first page, which say
that the clients minimise with SAM (Foret et al., ICLR 2021) or ASAM (Kwon et al., ICML 2021) and
that the server averages stochastic weights (SWA, Izmailov et al., UAI 2018). Everything below is
read from the authors' code, ``debcaldarola/fedsam``: ``models/clients/minimizers.py`` (the
``SAM`` and ``ASAM`` steps, identical to ``SamsungLabs/ASAM``'s ``asam.py``), driven per batch by
``models/clients/sam_client.py`` and ``asam_client.py``; ``models/main.py`` and
``models/servers/fedavg_server.py`` (SWA); ``models/utils/main_utils.py`` (the cyclical learning
rate); ``paper_experiments/cifar10.sh`` (the values). No equation number of the paper is cited.

**The local step** (per minibatch, w every model parameter with a gradient, g its gradient):

1. forward, loss, backward at w (the loss the reply logs is this first one);
2. ascent: w ← w + e(w), with e of the shape of each w; SAM: e = ρ g / (‖g‖₂ + 1e-16), ‖g‖₂
   the L2 norm over all parameters' gradients together; ASAM: e = ρ T_w² g / (‖T_w g‖₂ + 1e-16)
   with T_w = |w| + η element-wise on the parameters whose name contains ``weight`` (conv and
   linear weights, BatchNorm's γ) and T = 1 on the others (biases);
3. the gradients are cleared, and forward, loss and backward run again on the same batch at w + e;
4. w is restored, and the base optimiser steps with the gradient taken at w + e.

FedBed does this in the trainer's hooks: :meth:`FedSAMTrainer.batch_loss` remembers the batch and
:meth:`FedSAMTrainer.before_step` runs steps 2-4 before ``train_locally`` calls the optimiser.
Two choices differ from the authors' code, each by the rounding of floating point or in models
their CIFAR CNN does not have: w is restored by copying it back (the authors subtract e), and
the second forward leaves the model's buffers as the first set them (the authors' code updates
BatchNorm's running statistics twice per step; their CNN has no BatchNorm). Dropout draws a fresh
mask in the second forward, as theirs does. ``precision: fp16`` is refused: its gradient scaler
would have to see the second backward.

**Defaults.** FedSAM ρ = 0.1; FedASAM ρ = 0.7, η = 0.2: ``paper_experiments/cifar10.sh`` of the
authors' repository (commit f466cc3a; its first commit had placeholders ρ = 0.5, η = 0). The base
optimiser is FedBed's, as for every supervised method (:class:`LocalTrainingHyperparameters`:
Adam, lr 1e-3, weight decay 1e-4, and FedAvg's per-dataset values), so that FedSAM differs from
FedAvg only by the SAM step; the paper's scripts use SGD, lr 0.01, weight decay 4e-4, momentum 0
(``client_optimizer=sgd, client_lr=0.01, client_weight_decay=4e-4``).

**SWA on the server** (``swa: true``; off by default, ``models/main.py``). Rounds count from 1
here, from 0 in the authors' code: their ``swa_start = int(0.75 · num_rounds)`` is FedBed's round
S = int(0.75 R) + 1 unless ``swa_start_round`` sets it. The SWA model is a copy of the global
model at the start of round S; after the aggregation of every round r > S with (r − S) mod c = 0
(c = ``swa_cycle_rounds``) it becomes the running mean swa ← (1 − α) swa + α θ_global,
α = 1 / (n + 1) after n such updates (the first, α = 1, replaces the copy). The authors average
``parameters()`` only; FedBed averages the trainable floating-point parameters and takes the
buffers from the current global model. With c > 1 the clients' learning rate from round S on is
cyclical: t = ((r − 1) mod c + 1) / c, lr = (1 − t) lr₁ + t lr₂ with lr₁ = ``client_lr`` and
lr₂ = ``swa_lr`` (``schedule_cycling_lr``); with c = 1 it stays ``client_lr``. The authors'
scripts use c = 10 on CIFAR-10 and lr₂ = 1e-4 (their ``--swa-lr`` default). As in their code the
averaged models are those of rounds S + kc, whose place in the cycle depends on S mod c (their
CIFAR-10 run, ``--swa-start 7500`` counted from 0 and c = 10, averages at t = 1/c, the highest rate),
not always the cycle's end (t = 1) as in Izmailov et al. The SWA model, once it exists, is the
evaluated model
(``global_model()``); the clients keep receiving the running global model. Under
``target_adaptation: knowledge_vote`` the target model would be merged into the SWA model, not
into the model the clients receive: do not combine the two.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedTrainer,
)
from fedbed.algorithms.base.model_aggregation import (
    FedAvgStrategy,
    ModelAggregation,
    trainable_parameter_names,
)
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.fedavg import FedAvg
from fedbed.federation.local_data import Batch
from fedbed.federation.messages import Payload, Reply, RoundSummary
from fedbed.federation.strategy import ServerStrategy


class FedSAMHyperparameters(LocalTrainingHyperparameters):
    """FedSAM's neighbourhood and the server-side SWA option (module docstring for the sources).

    Attributes:
        neighborhood_radius: ρ, the radius of the neighbourhood SAM ascends in (the authors'
            ``--rho``; 0.1 for FedSAM in ``paper_experiments/cifar10.sh``). ρ = 0 trains as
            FedAvg, bit for bit in a model without dropout.
        swa: average the global models on the server (SWA) and evaluate the average.
        swa_start_round: the round S (from 1) whose starting global model the SWA model copies;
            ``None``: int(0.75 R) + 1 of the run's R rounds (the authors' default, from 0).
        swa_cycle_rounds: c, the rounds of one learning-rate cycle and between two averaged
            models (the authors' ``--swa-c``: default 1, a constant rate; 10 on CIFAR-10).
        swa_lr: lr₂, the cycle's last learning rate (the authors' ``--swa-lr`` default, 1e-4).

    Raises:
        ValueError: (pydantic's ``ValidationError``) ``swa`` with a ``client_lr_schedule``
            other than ``constant``: SWA's cycle sets the rate from round S on.
    """

    neighborhood_radius: float = Field(0.1, ge=0)
    swa: bool = False
    swa_start_round: int | None = Field(None, ge=1)
    swa_cycle_rounds: int = Field(1, ge=1)
    swa_lr: float = Field(1e-4, gt=0)

    @model_validator(mode="after")
    def _one_schedule(self) -> FedSAMHyperparameters:
        if self.swa and self.client_lr_schedule != "constant":
            raise ValueError("swa sets the clients' learning rate from its start on; use client_lr_schedule: constant")
        return self


class FedASAMHyperparameters(FedSAMHyperparameters):
    """FedASAM's adaptive neighbourhood: ρ = 0.7 and η = 0.2 (``paper_experiments/cifar10.sh``).

    Attributes:
        adaptive_offset: η of T_w = |w| + η, which keeps the neighbourhood open along weights
            near zero (the authors' ``--eta``).
    """

    neighborhood_radius: float = Field(0.7, ge=0)
    adaptive_offset: float = Field(0.2, ge=0)


def ascent_perturbation(parameters: Sequence[tuple[str, torch.Tensor, torch.Tensor]], radius: float,
                        adaptive_offset: float | None = None) -> list[torch.Tensor]:
    """SAM's (``adaptive_offset=None``) or ASAM's ascent e(w) (module docstring, step 2).

    Args:
        parameters: ``(name, w, g)`` per parameter, g of w's shape (any shapes).
        radius: ρ >= 0.
        adaptive_offset: η of ASAM's T_w = |w| + η on the names containing ``weight``.

    Returns:
        e per parameter, of its w's shape: ρ g / (‖g‖ + 1e-16), or ρ T_w² g / (‖T_w g‖ + 1e-16).
    """
    scales = [w.abs() + adaptive_offset if adaptive_offset is not None and "weight" in name else None
              for name, w, _ in parameters]
    scaled = [g if scale is None else scale * g for scale, (_, _, g) in zip(scales, parameters)]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in scaled])) + 1e-16
    return [(x if scale is None else scale * x) * (radius / norm) for scale, x in zip(scales, scaled)]


def swa_start_round(hparams: FedSAMHyperparameters, rounds: int | None) -> int:
    """The round S (from 1) the SWA model starts at: ``swa_start_round``, or int(0.75 R) + 1.

    Raises:
        ValueError: ``swa_start_round`` is unset and the run's number of rounds is unknown.
    """
    if hparams.swa_start_round is not None:
        return hparams.swa_start_round
    if rounds is None:
        raise ValueError("SWA starts at 3/4 of the run: the run's number of 'rounds' is needed (a payload's config, the context)")
    return int(0.75 * int(rounds)) + 1


def cyclical_learning_rate(hparams: FedSAMHyperparameters, config: Mapping[str, Any]) -> float | None:
    """The clients' rate of the round in ``config`` (``round``, ``rounds``) under SWA's cycle, or
    ``None`` (the rate is ``client_lr``: SWA off, c = 1, or a round before S)."""
    cycle = hparams.swa_cycle_rounds
    if not hparams.swa or cycle == 1 or int(config["round"]) < swa_start_round(hparams, config.get("rounds")):
        return None
    t = ((int(config["round"]) - 1) % cycle + 1) / cycle
    return (1 - t) * hparams.client_lr + t * hparams.swa_lr


def running_mean(average: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
                 parameter_names: frozenset[str], weight: float) -> dict[str, torch.Tensor]:
    """SWA's update of state dicts: (1 − α) average + α current on ``parameter_names``, the
    other entries (buffers) copied from ``current``; α = ``weight``."""
    return {name: average[name] * (1.0 - weight) + tensor * weight if name in parameter_names else tensor.clone()
            for name, tensor in current.items()}


class FedSAMTrainer(SupervisedTrainer):
    """SAM's two passes per batch through the hooks (module docstring, steps 1-4)."""

    hparams: FedSAMHyperparameters
    adaptive: ClassVar[bool] = False

    def round_hyperparameters(self, payload: Payload) -> LocalTrainingHyperparameters:
        hparams = super().round_hyperparameters(payload)
        lr = cyclical_learning_rate(self.hparams, payload.config)
        return hparams if lr is None else hparams.model_copy(update={"client_lr": lr})

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        self._sam_inputs = (model, batch, payload, state)  # for this step's second pass only
        return super().batch_loss(model, batch, payload, state)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Ascend to w + e, take the batch's gradient there, restore w and the buffers."""
        inputs, self._sam_inputs = self._sam_inputs, None
        model = inputs[0]
        named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
        if not named:
            return
        offset = self.hparams.adaptive_offset if self.adaptive else None
        with torch.no_grad():
            ascent = ascent_perturbation([(name, p, p.grad) for name, p in named], self.hparams.neighborhood_radius, offset)
            originals = [p.detach().clone() for _, p in named]
            for (_, p), e in zip(named, ascent):
                p.add_(e)
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.batch_loss(*inputs)
        loss.backward()
        self._sam_inputs = None
        with torch.no_grad():
            for (_, p), w in zip(named, originals):
                p.copy_(w)
            for buffer, value in buffers:
                buffer.copy_(value)


class FedASAMTrainer(FedSAMTrainer):
    """ASAM's adaptive ascent, T_w = |w| + η on the weights."""

    hparams: FedASAMHyperparameters
    adaptive = True


class SWAStrategy(FedAvgStrategy):
    """FedAvg plus the running mean of the global models from round S on (module docstring);
    the mean is the evaluated model, the running global model is what the clients receive.

    Attributes:
        average: the SWA model (``None`` before round S).
        averaged: n, the global models averaged into it so far.
    """

    def __init__(self, seed: int, hparams: FedSAMHyperparameters, rounds: int | None,
                 aggregation: ModelAggregation | None = None) -> None:
        super().__init__(seed, aggregation)
        self.hparams = hparams
        self.rounds = rounds
        self.average: nn.Module | None = None
        self.averaged = 0

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        start = swa_start_round(self.hparams, self.rounds)
        if self.average is None and round_number >= start:
            self.average = copy.deepcopy(self.model)  # the global model at the start of round S
        summary = super().aggregate(round_number, replies)
        if self.average is not None and round_number > start and (round_number - start) % self.hparams.swa_cycle_rounds == 0:
            self.average.load_state_dict(running_mean(self.average.state_dict(), self.model.state_dict(),
                                                      trainable_parameter_names(self.model), 1.0 / (self.averaged + 1)))
            self.averaged += 1
        if self.average is not None:
            summary.telemetry["swa_models_averaged"] = self.averaged
        return summary

    def global_model(self) -> nn.Module:
        return self.model if self.average is None else self.average

    def state_dict(self) -> dict[str, Any]:
        average = None if self.average is None else copy.deepcopy(self.average.state_dict())
        return {**super().state_dict(), "swa": {"model": average, "averaged": self.averaged}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        swa = state.get("swa", {"model": None, "averaged": 0})
        if swa["model"] is None:
            self.average = None
        else:
            self.average = self.average if self.average is not None else copy.deepcopy(self.model)
            self.average.load_state_dict(swa["model"])
        self.averaged = int(swa["averaged"])


@register_algorithm
class FedSAM(FedAvg):
    """FedSAM (Caldarola et al., ECCV 2022): SAM local steps, FedAvg's average, optional SWA."""

    name = "fedsam"
    summary = "FedSAM (Caldarola et al. 2022): SAM local steps (rho 0.1), FedAvg aggregation, optional server SWA."
    hyperparameters = FedSAMHyperparameters
    trainer_class = FedSAMTrainer
    server_rule = False  # a client technique on FedAvg's server (SWA only reads the average)
    precisions = ("fp32", "bf16")  # fp16's gradient scaler would have to see the second backward

    def create_strategy(self, hparams: FedSAMHyperparameters, context: AlgorithmContext) -> ServerStrategy:
        return SWAStrategy(context.seed, hparams, context.rounds) if hparams.swa else FedAvgStrategy(context.seed)


@register_algorithm
class FedASAM(FedSAM):
    """FedASAM (Caldarola et al., ECCV 2022): ASAM local steps, FedAvg's average, optional SWA."""

    name = "fedasam"
    summary = "FedASAM (Caldarola et al. 2022): ASAM local steps (rho 0.7, eta 0.2), FedAvg aggregation, optional server SWA."
    hyperparameters = FedASAMHyperparameters
    trainer_class = FedASAMTrainer
