"""Supervised local training shared by every method that trains a classifier on a client."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.registry import (
    Algorithm,
    AlgorithmContext,
    Hyperparameters,
    TrainingBudget,
)
from fedbed.data.augmentation import Augmentation
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer
from fedbed.seeding import derive_seed


class LocalTrainingHyperparameters(Hyperparameters):
    """The client optimiser, shared by every method.

    Defaults: Adam with learning rate 1e-3 and weight decay 1e-4, the values hFedF selected for
    FedAvg on PACS (``hfedf.txt``, Table 10) and DomainBed's default optimiser and learning rate.
    hFedF's Algorithm 2 writes plain gradient steps; ``client_optimizer=sgd`` (with
    ``client_momentum``) follows it literally.

    Attributes:
        client_optimizer: ``adam`` or ``sgd``.
        client_lr: the learning rate (of round 1 under a schedule).
        client_weight_decay: L2 weight decay of the optimiser.
        client_momentum: SGD's momentum (ignored by Adam).
        client_lr_schedule: ``constant``, or ``cosine``: a decay across the run's rounds from
            ``client_lr`` to ``client_final_lr`` (:func:`cosine_learning_rate`; MCGDM's
            Implementation Details, ``mcgdm.md``).
        client_final_lr: the learning rate of the last round under the ``cosine`` schedule
            (unused by ``constant``).
    """

    client_optimizer: Literal["adam", "sgd"] = "adam"
    client_lr: float = Field(1e-3, gt=0)
    client_weight_decay: float = Field(1e-4, ge=0)
    client_momentum: float = Field(0.0, ge=0, lt=1)
    client_lr_schedule: Literal["constant", "cosine"] = "constant"
    client_final_lr: float = Field(1e-4, gt=0)


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


def round_hyperparameters(hparams: LocalTrainingHyperparameters, payload: Payload) -> LocalTrainingHyperparameters:
    """``hparams`` with the learning rate of this round under ``client_lr_schedule``.

    The round and the run's total come from the engine's payload config (``round``, ``rounds``),
    so a resumed run continues the schedule exactly; a resumption that changes the total number
    of rounds changes the schedule from then on.
    """
    if hparams.client_lr_schedule == "constant":
        return hparams
    lr = cosine_learning_rate(int(payload.config["round"]), int(payload.config["rounds"]),
                              hparams.client_lr, hparams.client_final_lr)
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

    Returns:
        ``(mean loss over the steps taken, number of steps)``.
    """
    total, steps = 0.0, 0
    max_steps = budget.local_steps
    epochs = budget.local_epochs
    epoch = 0
    while (epochs is None or epoch < epochs) and (max_steps is None or steps < max_steps):
        for batch in data.batches(budget.batch_size, generator, augmentation, augmentation_seed,
                                  first_number + steps, augment_inputs):
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
    **batch_options: Any,
) -> float:
    """Minimise ``batch_loss(batch)`` on ``data`` for the budget with one optimiser.

    Args:
        model: trained in place (its parameters are optimised).
        data: the client's samples.
        hparams: the optimiser.
        budget: ``local_epochs`` full passes, or ``local_steps`` batches (cycling through epochs).
        generator: drives the batch order (seeded by the engine per round and client).
        batch_loss: the differentiable loss of one batch (task loss plus any method term).
        extra_parameters: further tensors optimised alongside the model (e.g. FedSR's prior).
        before_step: called after ``backward`` and before the optimiser's step with the
            optimiser; it may edit or drop (set to ``None``) the gradients of any parameter
            group (FedGaLA's local alignment).
        after_step: called after every optimiser step (a momentum encoder's or a target
            network's moving average: MoCo, BYOL).
        batch_options: passed to :func:`run_batches` (augmentation and its seed).

    Returns:
        The mean training loss over the steps taken.
    """
    model.train()
    optimizer = make_optimizer([*model.parameters(), *extra_parameters], hparams)

    def step(batch: Batch) -> float:
        loss = batch_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if before_step is not None:
            before_step(optimizer)
        optimizer.step()
        if after_step is not None:
            after_step()
        return float(loss.detach())

    return run_batches(data, budget, generator, step, **batch_options)[0]


AUGMENTATION_PURPOSE = 0xA5
"""Mixed into a client's batch seed to seed its augmentations (the batch order keeps its own draws)."""


def augmentation_seed(payload: Payload) -> int:
    """The seed of a client's augmented views this round, from the engine's ``batch_seed``."""
    return derive_seed(int(payload.config["batch_seed"]), AUGMENTATION_PURPOSE)


class SupervisedTrainer(ClientTrainer):
    """Load the payload's state dict, train on the task loss, send the trained state dict back.

    The client half of FedAvg, Central and Local-only; subclasses change the objective through
    :meth:`batch_loss` (which sees the payload, the batch and the client's persistent state) and
    train tensors of their own kept in that state through :meth:`local_parameters`. With the
    run's ``augmentation`` setting, each batch is replaced by its augmented view.
    """

    def __init__(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> None:
        self.hparams = hparams
        self.budget = context.budget
        self.task = context.task
        self.augmentation = context.augmentation
        self.model = context.model_factory()

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        """The objective of one batch (:func:`task_loss` of ``batch.inputs`` by default).

        Args:
            model: the local model being trained.
            batch: the batch (its ``inputs`` are augmented when the run augments).
            payload: what the server sent this round (arrays and read-only arrays).
            state: the client's persistent state (read and write).
        """
        return task_loss(self.task, model(batch.inputs), batch.targets)

    def local_parameters(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """Tensors of the client's persistent ``state`` trained alongside the model and never
        sent (FedSR's class priors); none by default. :meth:`fit` trains them on a copy of the
        state that replaces the state only when the round succeeds (a client that fails keeps
        its state as it was, on every backend), frozen again, so the state at rest holds no
        autograd history."""
        return []

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        model = self.model
        model.load_state_dict(payload.arrays)
        generator = torch.Generator().manual_seed(int(payload.config["batch_seed"]))
        working = copy.deepcopy(state)
        local = [tensor.requires_grad_(True) for tensor in self.local_parameters(working)]
        hparams = round_hyperparameters(self.hparams, payload)
        loss = train_locally(
            model, data, hparams, self.budget, generator,
            lambda batch: self.batch_loss(model, batch, payload, working), local,
            augmentation=self.augmentation, augmentation_seed=augmentation_seed(payload),
            augment_inputs=self.augmentation is not None,
        )
        for tensor in local:
            tensor.requires_grad_(False)
        state.clear()
        state.update(working)
        metrics = {"loss": loss} if hparams is self.hparams else {"loss": loss, "lr": hparams.client_lr}
        return Reply(arrays=clone_arrays(model.state_dict()), num_examples=len(data), metrics=metrics)


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
