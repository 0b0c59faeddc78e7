"""Supervised local training shared by every method that trains a classifier on a client."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.registry import Algorithm, AlgorithmContext, Hyperparameters, TrainingBudget
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer
from fedbed.gradients import clone_arrays


class LocalTrainingHyperparameters(Hyperparameters):
    """The client optimiser, shared by every method.

    Defaults: Adam with learning rate 1e-3 and weight decay 1e-4, the values hFedF selected for
    FedAvg on PACS (``hfedf.txt``, Table 10) and DomainBed's default optimiser and learning rate.
    hFedF's Algorithm 2 writes plain gradient steps; ``client_optimizer=sgd`` (with
    ``client_momentum``) follows it literally.
    """

    client_optimizer: Literal["adam", "sgd"] = "adam"
    client_lr: float = Field(1e-3, gt=0)
    client_weight_decay: float = Field(1e-4, ge=0)
    client_momentum: float = Field(0.0, ge=0, lt=1)


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


def train_locally(
    model: nn.Module,
    data: ClientData,
    hparams: LocalTrainingHyperparameters,
    budget: TrainingBudget,
    generator: torch.Generator,
    batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    extra_parameters: Sequence[torch.Tensor] = (),
) -> float:
    """Minimise ``batch_loss(inputs, targets)`` on ``data`` for the budget.

    Args:
        model: trained in place (its parameters are optimised).
        data: the client's samples.
        hparams: the optimiser.
        budget: ``local_epochs`` full passes, or ``local_steps`` batches (cycling through epochs).
        generator: drives the batch order (seeded by the engine per round and client).
        batch_loss: the differentiable loss of one batch (task loss plus any method term).
        extra_parameters: further tensors optimised alongside the model (e.g. FedSR's prior).

    Returns:
        The mean training loss over the steps taken.
    """
    model.train()
    optimizer = make_optimizer([*model.parameters(), *extra_parameters], hparams)
    total, steps = 0.0, 0
    max_steps = budget.local_steps if budget.local_steps is not None else None
    epochs = budget.local_epochs if budget.local_epochs is not None else None
    epoch = 0
    while (epochs is None or epoch < epochs) and (max_steps is None or steps < max_steps):
        for inputs, targets in data.batches(budget.batch_size, generator):
            loss = batch_loss(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        epoch += 1
    return total / max(steps, 1)


class SupervisedTrainer(ClientTrainer):
    """Load the payload's state dict, train on the task loss, send the trained state dict back.

    The client half of FedAvg, Central and Local-only; subclasses change the objective through
    :meth:`loss` or add a term built from the payload through :meth:`extra_loss`.
    """

    def __init__(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> None:
        self.hparams = hparams
        self.budget = context.budget
        self.task = context.task
        self.model = context.model_factory()
        self.extra_parameters: list[torch.Tensor] = []

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The objective of one batch (:func:`task_loss` by default)."""
        return task_loss(self.task, model(inputs), targets)

    def extra_loss(self, payload: Payload) -> Callable[[nn.Module], torch.Tensor] | None:
        """An additional loss term built from the payload (none by default)."""
        return None

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        self.model.load_state_dict(payload.arrays)
        generator = torch.Generator().manual_seed(int(payload.config["batch_seed"]))
        extra = self.extra_loss(payload)
        model = self.model

        def batch_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = self.loss(model, inputs, targets)
            return loss if extra is None else loss + extra(model)

        loss = train_locally(model, data, self.hparams, self.budget, generator, batch_loss, self.extra_parameters)
        return Reply(arrays=clone_arrays(model.state_dict()), num_examples=len(data), metrics={"loss": loss})


class SupervisedAlgorithm(Algorithm):
    """A method whose clients train with :class:`SupervisedTrainer` (or ``trainer_class``); a
    subclass provides the server half."""

    trainer_class: ClassVar[type[SupervisedTrainer]] = SupervisedTrainer

    def create_trainer(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> SupervisedTrainer:
        return self.trainer_class(hparams, context)
