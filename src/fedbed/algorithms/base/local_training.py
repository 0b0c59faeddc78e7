"""Supervised local training shared by every method that trains a classifier on a client."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.client_reports import (
    gap_of_received_model,
    gap_requested,
    gap_samples,
    remember_local_risk,
)
from fedbed.algorithms.base.registry import (
    Algorithm,
    AlgorithmContext,
    Hyperparameters,
    TrainingBudget,
)
from fedbed.algorithms.base.search_space import LogUniform, SearchSpaceDeclaration
from fedbed.data.augmentation import Augmentation
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.devices import (
    HOST,
    autocast,
    gradient_scaler,
    to_device,
    to_host,
)
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer
from fedbed.seeding import derive_seed

LearningRateSchedule = Literal["constant", "cosine", "step"]
"""The client learning-rate schedules (:func:`round_hyperparameters`)."""

OPTIMIZER_STATE_KEY = "optimizer_state"
"""The entry of a client's persistent state that holds its optimiser's per-parameter state under
``client_optimizer_state: kept`` (:func:`train_locally`)."""


class LocalTrainingHyperparameters(Hyperparameters):
    """The client optimiser, shared by every method.

    Defaults: Adam with learning rate 1e-3 and weight decay 1e-4, the values hFedF selected for
    FedAvg on PACS (``hfedf.txt``, Table 10) and DomainBed's default optimiser and learning rate.
    hFedF's Algorithm 2 writes plain gradient steps; ``client_optimizer=sgd`` (with
    ``client_momentum``) follows it literally.

    Search distributions (``search_space``, :mod:`fedbed.algorithms.base.search_space`): the
    learning rate 10^U(−4.5, −2.5) and the weight decay 10^U(−6, −2), DomainBed's
    (``hparams_registry.py``; the sources are in the declarations). The optimiser, its momentum
    and schedule are choices of a comparison, not searched; the batch size and the local epochs
    are run settings that fix the budget (B and E control a round's computation, McMahan et al.
    2017, "The FederatedAveraging Algorithm"), kept out of the search.

    Attributes:
        client_optimizer: ``adam`` or ``sgd``.
        client_lr: the learning rate (of round 1 under a schedule).
        client_weight_decay: L2 weight decay of the optimiser.
        client_momentum: SGD's momentum (ignored by Adam).
        client_lr_schedule: ``constant``; ``cosine``: a decay across the run's rounds from
            ``client_lr`` to ``client_final_lr`` (:func:`cosine_learning_rate`; MCGDM's
            Implementation Details, ``mcgdm.md``); or ``step``: ``client_lr`` times
            ``client_lr_step_factor`` after every ``client_lr_step_fraction`` of the run's rounds
            (:func:`step_learning_rate`; the ``--lr_policy step`` of FedDG-GA's and FedOMG's code).
        client_final_lr: the learning rate of the last round under the ``cosine`` schedule
            (unused by the others).
        client_lr_step_fraction: the ``step`` schedule's period as a fraction of the run's rounds
            (0.8: the authors' ``StepLR(step_size=int(0.8 × total epochs))``, one tenth of the
            rate for the last 20% of the rounds).
        client_lr_step_factor: the ``step`` schedule's multiplier (γ; the authors' 0.1).
        client_optimizer_state: ``fresh``: a new optimiser every round, as FedAvg's client
            update is written (McMahan et al. 2017, Algorithm 1) and the papers' algorithms
            read; or ``kept``: each client's optimiser state (SGD's momentum buffers, Adam's
            moments and step count) carried from the last round it trained in, in its
            persistent state (:func:`train_locally`'s ``kept_state``), as FedDG-GA's and
            FedOMG's code builds one SGD per site for the whole run (``utils/trainval_func.py``,
            ``GetFedModel``).
    """

    client_optimizer: Literal["adam", "sgd"] = "adam"
    client_lr: float = Field(1e-3, gt=0)
    client_weight_decay: float = Field(1e-4, ge=0)
    client_momentum: float = Field(0.0, ge=0, lt=1)
    client_lr_schedule: LearningRateSchedule = "constant"
    client_final_lr: float = Field(1e-4, gt=0)
    client_lr_step_fraction: float = Field(0.8, gt=0, le=1)
    client_lr_step_factor: float = Field(0.1, gt=0, le=1)
    client_optimizer_state: Literal["fresh", "kept"] = "fresh"

    search_space: ClassVar[SearchSpaceDeclaration] = {
        "client_lr": LogUniform(10 ** -4.5, 10 ** -2.5, source=(
            "DomainBed's hparams_registry.py, lr on its small-image datasets, trained from scratch as FedBed's "
            "default models are (its 10^U(-5, -3.5) fine-tunes an ImageNet ResNet-50 and excludes this default)")),
        "client_weight_decay": LogUniform(1e-6, 1e-2, source=(
            "DomainBed's hparams_registry.py, weight_decay on its image datasets (it fixes 0 on MNIST; FedBed's "
            "defaults are not 0 on any dataset)")),
    }


def cosine_learning_rate(round_number: int, rounds: int, initial: float, final: float) -> float:
    """The learning rate of round ``round_number`` (1-based) of ``rounds`` under a cosine decay
    from ``initial`` (round 1) to ``final`` (round ``rounds``):
    final + (initial − final)(1 + cos(π (t − 1) / (R − 1))) / 2; ``initial`` for a single round.

    MCGDM (``mcgdm.md``, Implementation Details) "decayed by the cosine schedule from 0.001 to
    0.0001 during training", read per round.
    """
    if rounds <= 1:
        return initial
    progress = (round_number - 1) / (rounds - 1)
    return final + (initial - final) * (1.0 + math.cos(math.pi * progress)) / 2.0


def step_learning_rate(round_number: int, rounds: int, initial: float, step_fraction: float, factor: float) -> float:
    """The learning rate of round ``round_number`` (1-based) of ``rounds`` under a step decay:
    ``initial × factor ** ⌊(t − 1) / (f R)⌋``, one decay after every ``step_fraction`` f of the R
    rounds (f read as the decimal it prints as, exactly: 0.29 × 100 is 29 rounds, not 28.999...).

    FedDG-GA's and FedOMG's code (``--lr_policy step``, ``utils/trainval_func.py``): each client's
    ``StepLR(step_size=int(0.8 × local_epochs × comm), gamma=0.1)``, stepped after every local
    epoch. Read per round here: equal to it at every round's start wherever f × local epochs × R
    is a whole number of epochs (40 or 100 rounds at 0.8: the learning rate / 10 from round 33,
    from round 81); a decay the code makes inside a round starts here at the next round's start.
    """
    fraction = Fraction(repr(step_fraction))
    decays = ((round_number - 1) * fraction.denominator) // (fraction.numerator * rounds)
    return initial * factor ** decays


def round_hyperparameters(hparams: LocalTrainingHyperparameters, payload: Payload) -> LocalTrainingHyperparameters:
    """``hparams`` with the learning rate of this round under ``client_lr_schedule``
    (:func:`cosine_learning_rate`, :func:`step_learning_rate`).

    The round and the run's total come from the engine's payload config (``round``, ``rounds``),
    so a resumed run continues the schedule exactly; a resumption that changes the total number
    of rounds changes the schedule from then on.
    """
    if hparams.client_lr_schedule == "constant":
        return hparams
    round_number, rounds = int(payload.config["round"]), int(payload.config["rounds"])
    if hparams.client_lr_schedule == "step":
        lr = step_learning_rate(round_number, rounds, hparams.client_lr, hparams.client_lr_step_fraction,
                                hparams.client_lr_step_factor)
    else:
        lr = cosine_learning_rate(round_number, rounds, hparams.client_lr, hparams.client_final_lr)
    return hparams.model_copy(update={"client_lr": lr})


def make_optimizer(parameters, hparams: LocalTrainingHyperparameters) -> torch.optim.Optimizer:
    """The client optimiser named by ``hparams`` over ``parameters`` (fresh every round)."""
    if hparams.client_optimizer == "adam":
        return torch.optim.Adam(parameters, lr=hparams.client_lr, weight_decay=hparams.client_weight_decay)
    return torch.optim.SGD(
        parameters, lr=hparams.client_lr, weight_decay=hparams.client_weight_decay, momentum=hparams.client_momentum
    )


def task_loss(task: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``[B, C]`` vs labels ``[B]``, or, for ``task="regression"``, the mean
    squared error of outputs ``[B, 1]`` vs targets ``[B]``."""
    if task == "regression":
        return nn.functional.mse_loss(outputs.squeeze(1), targets)
    return nn.functional.cross_entropy(outputs, targets)


BatchStep = Callable[[Batch], float]
"""One training step on one batch (forward, backward, optimiser steps); returns the batch's loss."""


def run_batches(
    data: ClientData,
    budget: TrainingBudget,
    generator: torch.Generator,
    step: BatchStep,
    *,
    augmentation: Augmentation | None = None,
    augmentation_seed: int = 0,
    augment_inputs: bool = False,
    first_number: int = 0,
    device: torch.device = HOST,
) -> tuple[float, int]:
    """One training phase: feed ``data``'s batches to ``step`` for the budget.

    A trainer with several phases (several optimisers, several objectives: FedADG's
    classification then alignment epochs) calls this once per phase with its own ``step`` and
    budget; ``first_number`` continues the batch numbering, so every batch of a round draws
    distinct augmentations.

    Args:
        data: the client's samples.
        budget: ``local_epochs`` full passes, or ``local_steps`` batches (cycling through epochs).
        generator: drives the batch order (seeded by the engine per round and client).
        step: trains on one batch and returns its loss.
        augmentation: adds its views to every batch (:class:`~fedbed.federation.local_data.Batch`).
        augmentation_seed: seed of the views (:meth:`ClientData.batches`).
        augment_inputs: the batch's ``inputs`` are its first view.
        first_number: the number of this phase's first batch.
        device: where ``step`` computes: each batch's ``uint8`` images move there from the
            client's data (which stays on the CPU) and are augmented and scaled there.

    Returns:
        ``(mean loss over the steps taken, number of steps)``.
    """
    total, steps = 0.0, 0
    max_steps = budget.local_steps
    epochs = budget.local_epochs
    epoch = 0
    while (epochs is None or epoch < epochs) and (max_steps is None or steps < max_steps):
        for batch in data.batches(budget.batch_size, generator, augmentation, augmentation_seed,
                                  first_number + steps, augment_inputs, device):
            total += step(batch)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        epoch += 1
    return total / max(steps, 1), steps


def train_locally(
    model: nn.Module,
    data: ClientData,
    hparams: LocalTrainingHyperparameters,
    budget: TrainingBudget,
    generator: torch.Generator,
    batch_loss: Callable[[Batch], torch.Tensor],
    extra_parameters: Sequence[torch.Tensor] = (),
    before_step: Callable[[torch.optim.Optimizer], None] | None = None,
    after_step: Callable[[], None] | None = None,
    precision: str | None = None,
    kept_state: dict[str, Any] | None = None,
    **batch_options: Any,
) -> float:
    """Minimise ``batch_loss(batch)`` on ``data`` for the budget with one optimiser.

    Args:
        model: trained in place (its parameters are optimised), on the device ``batch_options``
            names (the CPU by default).
        data: the client's samples.
        hparams: the optimiser.
        budget: ``local_epochs`` full passes, or ``local_steps`` batches (cycling through epochs).
        generator: drives the batch order (seeded by the engine per round and client).
        batch_loss: the differentiable loss of one batch (task loss plus any method term).
        extra_parameters: further tensors optimised alongside the model (e.g. FedSR's prior).
        before_step: called after ``backward`` and before the optimiser's step with the
            optimiser; it may edit or drop (set to ``None``) the gradients of any parameter
            group (FedGaLA's local alignment). Under ``fp16`` it sees the unscaled gradients.
        after_step: called after every optimiser step (a momentum encoder's or a target
            network's moving average: MoCo, BYOL).
        precision: ``bf16`` or ``fp16``: ``batch_loss`` runs under ``torch.autocast``
            (:func:`fedbed.federation.devices.autocast`), with a gradient scaler for ``fp16``;
            ``fp32`` or ``None``: as written.
        kept_state: the client's persistent state (the round's copy) when the optimiser's state
            carries over between rounds (``client_optimizer_state: kept``): the per-parameter
            state of ``optimizer.state_dict()`` is loaded from ``kept_state[OPTIMIZER_STATE_KEY]``
            before the first step, when there, and stored there after the last (the parameters
            in the same order every round); the learning rate and the other settings stay this
            round's ``hparams``. ``None``: a fresh optimiser.
        batch_options: passed to :func:`run_batches` (augmentation, its seed, the device).

    Returns:
        The mean training loss over the steps taken.
    """
    model.train()
    optimizer = make_optimizer([*model.parameters(), *extra_parameters], hparams)
    if kept_state is not None and OPTIMIZER_STATE_KEY in kept_state:
        load_kept_optimizer_state(optimizer, kept_state[OPTIMIZER_STATE_KEY])
    device = batch_options.get("device", HOST)
    scaler = gradient_scaler(device, precision)

    def step(batch: Batch) -> float:
        with autocast(device, precision):
            loss = batch_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        if before_step is not None:
            before_step(optimizer)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if after_step is not None:
            after_step()
        return float(loss.detach())

    loss = run_batches(data, budget, generator, step, **batch_options)[0]
    if kept_state is not None:
        kept_state[OPTIMIZER_STATE_KEY] = optimizer.state_dict()["state"]
    return loss


def load_kept_optimizer_state(optimizer: torch.optim.Optimizer, kept: dict[int, dict[str, Any]]) -> None:
    """Load the per-parameter state a client kept from its last round (``client_optimizer_state:
    kept``) into this round's fresh ``optimizer``, keeping the optimiser's own settings (this
    round's learning rate). Torch moves each buffer to its parameter's device (no copy for a
    buffer already there, as the client's state is on the round's device); the 0-dimensional
    entries (Adam's ``step`` counts) go to the host first, where torch keeps them, so that a step
    does not wait on a device-to-host read.

    Raises:
        ValueError: the kept state does not fit the optimiser's parameters (another number of
            parameters, or a buffer of another shape than its parameter): the method's trained
            tensors changed between rounds.
    """
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for index, entry in kept.items():
        shapes = {tuple(value.shape) for value in entry.values() if isinstance(value, torch.Tensor) and value.dim() > 0}
        if index >= len(parameters) or shapes - {tuple(parameters[index].shape)}:
            raise ValueError(f"the client's kept optimiser state does not fit this round's {len(parameters)} trained "
                             f"tensors (entry {index}): the trained tensors changed between rounds; "
                             "use client_optimizer_state: fresh")
    hosted = {index: {key: to_host(value) if isinstance(value, torch.Tensor) and value.dim() == 0 else value
                      for key, value in entry.items()} for index, entry in kept.items()}
    optimizer.load_state_dict({"state": hosted, "param_groups": optimizer.state_dict()["param_groups"]})


AUGMENTATION_PURPOSE = 0xA5
"""Mixed into a client's batch seed to seed its augmentations (the batch order keeps its own draws)."""


def augmentation_seed(payload: Payload) -> int:
    """The seed of a client's augmented views this round, from the engine's ``batch_seed``."""
    return derive_seed(int(payload.config["batch_seed"]), AUGMENTATION_PURPOSE)


class LocalTrainer(ClientTrainer):
    """The whole of a client's round, which a method changes only through the hooks below.

    :meth:`fit` (not to be overridden) loads the round's starting model, seeds the batch order
    from the engine's ``batch_seed``, works on a copy of the client's persistent state that
    replaces it only when the round succeeds (a client that fails keeps its state as it was, on
    every backend), trains, and builds the reply: the trained state dict, ``len(data)`` examples,
    and the metrics ``loss`` (the mean training loss), ``lr`` (under a learning-rate schedule),
    the batch mean of every metric :meth:`log_metric` recorded, and :meth:`round_metrics`. When
    the server's rule asks for it (FedDG-GA), it also reports the client's generalization gap
    (:mod:`fedbed.algorithms.base.client_reports`).

    Hooks, in the order :meth:`fit` calls them (one vocabulary for every method):

    - :meth:`round_hyperparameters`: this round's optimiser settings (a learning-rate schedule);
    - :meth:`starting_arrays`: the arrays the round starts from (the payload's; FedEMA mixes in
      the client's own model);
    - :meth:`begin_round`: build what this round needs from the payload and the state (MCGDM
      reads nothing here; FedGaLA builds its local-alignment hook, the self-supervised methods
      restore their client-side networks);
    - :meth:`local_parameters`: tensors of the state trained alongside the model, never sent;
    - :meth:`train_round` — the phases; by default one phase of :func:`train_locally` over
      :meth:`training_data` with :meth:`batch_loss`, :meth:`before_step` and :meth:`after_step`
      (FedADG has two phases and three optimisers);
    - :meth:`end_round`: store in the state what the next round needs;
    - :meth:`round_metrics`: metrics of the whole round (FedGaLA's discard ratio).

    The augmentation is declared once, in ``__init__``: the run's ``augmentation`` setting
    (``augment_inputs``: each batch's ``inputs`` are its augmented view), or the method's own
    (MCGDM's RandAugment views, the self-supervised methods' two views; ``augment_inputs =
    False``: ``inputs`` stay the images and the views are in ``batch.views``). Objects a hook
    builds for one round may live on ``self`` for that round only (a trainer runs one ``fit`` at
    a time); nothing per client is kept on ``self`` between rounds (in-process one trainer serves
    every client).

    Attributes:
        hparams: the method's hyperparameters.
        budget: the local training budget.
        task: ``classification`` or ``regression``.
        augmentation: the views drawn for every batch, or ``None``.
        augment_inputs: ``batch.inputs`` is the first view.
        model: the trained model (reused every round).
    """

    def __init__(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> None:
        self.hparams = hparams
        self.budget = context.budget
        self.task = context.task
        self.augmentation: Augmentation | None = context.augmentation
        self.augment_inputs = True
        self.device = context.device
        self.precision = context.precision
        self.model = context.model_factory().to(self.device)
        self._logged: dict[str, list[float]] = {}

    def round_hyperparameters(self, payload: Payload) -> LocalTrainingHyperparameters:
        """This round's optimiser settings: :attr:`hparams` under ``client_lr_schedule``
        (:func:`round_hyperparameters`) by default; a method with its own schedule replaces it
        (FedSAM's cyclical learning rate under SWA). The reply reports ``lr`` whenever the
        result is not :attr:`hparams` itself."""
        return round_hyperparameters(self.hparams, payload)

    def starting_arrays(self, payload: Payload, state: dict[str, Any]) -> Mapping[str, torch.Tensor]:
        """The state dict the round starts from: the payload's arrays by default.

        Args:
            payload: what the server sent.
            state: the round's working copy of the client state (read and write).
        """
        return payload.arrays

    def begin_round(self, model: nn.Module, payload: Payload, state: dict[str, Any]) -> None:
        """Prepare the round after the starting model is loaded (nothing by default)."""

    def local_parameters(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """Tensors of the client's persistent ``state`` trained alongside the model and never
        sent (FedSR's class priors); none by default. They are trained on the round's copy of
        the state and frozen again after it, so the state at rest holds no autograd history."""
        return []

    def training_data(self, data: ClientData) -> ClientData:
        """The samples the round trains on (the self-supervised methods hide the labels)."""
        return data

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        """The objective of one batch (:func:`task_loss` of ``batch.inputs`` by default).

        Args:
            model: the local model being trained.
            batch: the batch (its ``inputs`` are augmented when the run augments).
            payload: what the server sent this round (arrays and read-only arrays).
            state: the client's persistent state (the round's copy; read and write).

        Returns:
            A scalar tensor to minimise.
        """
        return task_loss(self.task, model(batch.inputs), batch.targets)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after ``backward`` and before the optimiser's step; may edit or drop (set to
        ``None``) any parameter's gradient (FedGaLA's local alignment). Nothing by default."""

    def after_step(self) -> None:
        """Called after every optimiser step (a momentum encoder's or target network's moving
        average). Nothing by default."""

    def train_round(self, model: nn.Module, data: ClientData, hparams: LocalTrainingHyperparameters,
                    generator: torch.Generator, payload: Payload, state: dict[str, Any]) -> float:
        """Train for the round and return the mean training loss over its steps.

        One phase by default: :func:`train_locally` with one optimiser over the model and
        :meth:`local_parameters`. A method with several phases (FedADG) overrides this and calls
        :func:`run_batches` once per phase with :meth:`batch_options`.

        Args:
            model: loaded with :meth:`starting_arrays`.
            data: :meth:`training_data` of the client's samples.
            hparams: this round's optimiser settings (:func:`round_hyperparameters`).
            generator: the batch order's generator, seeded by the engine per round and client.
            payload: what the server sent.
            state: the round's copy of the client state.
        """
        local = [tensor.requires_grad_(True) for tensor in self.local_parameters(state)]
        loss = train_locally(model, data, hparams, self.budget, generator,
                             lambda batch: self.batch_loss(model, batch, payload, state), local,
                             before_step=self.before_step, after_step=self.after_step, precision=self.precision,
                             kept_state=state if hparams.client_optimizer_state == "kept" else None,
                             **self.batch_options(payload))
        for tensor in local:
            tensor.requires_grad_(False)
        return loss

    def batch_options(self, payload: Payload) -> dict[str, Any]:
        """The augmentation options of :func:`run_batches` this round (views, their seed, and
        whether ``inputs`` is the first view)."""
        return {"augmentation": self.augmentation, "augmentation_seed": augmentation_seed(payload),
                "augment_inputs": self.augment_inputs and self.augmentation is not None, "device": self.device}

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's mixed-precision context, for a trainer that writes its own steps (FedADG)."""
        return autocast(self.device, self.precision)

    def end_round(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Store in the round's copy of the state what the next round needs (nothing by default)."""

    def round_metrics(self, state: dict[str, Any]) -> dict[str, float]:
        """Metrics of the whole round, added to the reply (none by default)."""
        return {}

    def log_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Record one batch's value of a method's term (e.g. MCGDM's ``intra``); the reply
        carries the mean over the batches that logged it, and the server averages it over the
        round's clients (``mean_<name>`` in ``rounds.jsonl``)."""
        self._logged.setdefault(name, []).append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        """One round on this client (class docstring); never overridden by a method."""
        model = self.model
        working = to_device(copy.deepcopy(state), self.device)
        model.load_state_dict(self.starting_arrays(payload, working))
        generator = torch.Generator().manual_seed(int(payload.config["batch_seed"]))
        hparams = self.round_hyperparameters(payload)
        self._logged = {}
        reporting_gap = gap_requested(payload)
        scored = gap_samples(payload, data) if reporting_gap else data
        reported = gap_of_received_model(model, scored, self.task, working) if reporting_gap else {}
        self.begin_round(model, payload, working)
        loss = self.train_round(model, self.training_data(data), hparams, generator, payload, working)
        self.end_round(model, working)
        if reporting_gap:
            remember_local_risk(model, scored, self.task, working)
        metrics = {"loss": loss} if hparams is self.hparams else {"loss": loss, "lr": hparams.client_lr}
        metrics.update(reported)
        metrics.update({name: sum(values) / len(values) for name, values in self._logged.items()})
        metrics.update(self.round_metrics(working))
        state.clear()
        state.update(to_host(working))
        return Reply(arrays=to_host(clone_arrays(model.state_dict())), num_examples=len(data), metrics=metrics)


class SupervisedTrainer(LocalTrainer):
    """The client half of FedAvg, Central and Local-only: the task loss on each batch's inputs
    (augmented when the run augments). Methods change the objective through :meth:`batch_loss`
    (FedProx, FedSR, MCGDM) and train tensors of their own kept in the client state through
    :meth:`local_parameters` (FedSR's priors)."""


class SupervisedAlgorithm(Algorithm):
    """A method whose clients train with :class:`SupervisedTrainer` (or ``trainer_class``); a
    subclass provides the server half."""

    trainer_class: ClassVar[type[SupervisedTrainer]] = SupervisedTrainer

    def create_trainer(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> SupervisedTrainer:
        return self.trainer_class(hparams, context)


def proximal_term(model: nn.Module, anchor: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term ``μ/2 · ||θ − θ_global||²`` (Li et al. 2020, Eq. 2), squared norm.

    Args:
        model: the local model θ; only its parameters (not buffers) enter the norm.
        anchor: the global model's state dict θ_global (no gradient flows into it).
        mu: μ >= 0.

    Returns:
        A scalar tensor, differentiable with respect to the model's parameters.
    """
    squared = sum(((p - anchor[name].detach()) ** 2).sum() for name, p in model.named_parameters())
    return 0.5 * mu * squared
