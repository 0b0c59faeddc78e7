"""FedIIR: federated learning of implicit invariant relationships (Guo, Guo, Cao, Wu and Chang,
"Out-of-Distribution Generalization of Federated Learning via Implicit Invariant Relationships",
ICML 2023).

The paper's body was not available (only its OpenReview abstract: "implicitly reduce [the
prediction disagreement] through inter-client gradient alignment"), so everything here follows
the authors' code, ``YamingGuo98/FedIIR`` (commit 3e7a785), ``domainbed/algorithms.py``, and no
equation is cited. Client k minimises on every batch (``FedIIR.update``)

    CE_k(θ) + λ Σ_{p ∈ classifier} ‖∇_p CE_k(θ; batch) − ḡ_p‖²,

the gradient taken w.r.t. the classifier's parameters only, with ``create_graph=True``, so the
penalty also trains the featurizer (double back-propagation); the squared norm is summed over
every classifier tensor, not normalised. ḡ is the server's exponential moving average of the mean
classifier gradient of the global model (``FedIIR.mean_grad``): ḡ ← ema·ḡ + (1 − ema)·ḡ_new,
ḡ = 0 at the start, no bias correction (round 1 pulls towards 0.05 ḡ_new), ḡ_new the mean over
every batch of one full pass over each sampled client's data. Defaults (``hparams_registry.py``):
λ (``penalty``) 1e-2 on RotatedMNIST, 5e-3 VLCS, 1e-3 PACS, 5e-4 OfficeHome, 1e-3 elsewhere;
``ema`` 0.95 everywhere.

**FedBed's federated reading** (one message each way per round; the server never sees data).
The code computes ḡ_new on the server from the clients' data before the round's training, which
a federation could only do with a second exchange. Here it lags one round: at the start of its
round each client computes, with the global model it received, its mean classifier gradient
g_k (:func:`mean_head_gradient`: the mean of the per-batch gradients of the batch-mean task loss
over one pass of its data in data order, in batches of the run's batch size, without
augmentation, in train mode with the BatchNorm statistics restored afterwards and its random
draws on a forked generator, so that the training itself is FedAvg's when λ = 0), and returns it
with its model. The payload's ``arrays`` carry one slot per classifier parameter,
``fediir_mean_gradient/<parameter>`` (``fediir_mean_gradient/classifier.weight`` ``[C, d]``, ...),
holding ḡ (zeros in round 1); the client's reply returns g_k in the same slots. The server
(:class:`FedIIRStrategy`) strips the slots, folds Σ_k (n_k/n) g_k into the EMA and hands the
stripped replies to :class:`FedAvgStrategy`'s aggregation (the run's or a composed server rule).
The round's log holds the clients' mean penalty (``mean_penalty``) and ‖ḡ‖ (``ema_gradient_norm``).

Differences from the authors' code:

- the one-round lag above (ḡ of round r is built from the gradients of round r − 1's global model);
- the model average: the code's is uniform (1/K, ``FedAvg.aggregation_client``), FedBed's n_k/n
  by default (``weighting: uniform`` gives the code's); ḡ_new weights client k by n_k/n, where the
  code weights its batches equally (the same up to each client's last, smaller batch);
- the code's ResNets freeze BatchNorm and its classifier is ``Linear(d, d/2) → ReLU →
  Linear(d/2, C)`` except on RotatedMNIST: both are the run's model settings here
  (``freeze_batchnorm``; FedBed's classifier is linear), not the method's;
- its client optimiser is SGD with momentum 0.9, weight decay 0 and lr 1e-2 (RotatedMNIST),
  1e-3 (VLCS, OfficeHome), 2.5e-3 (PACS) at batch 64/32/32/32; FedIIR keeps FedBed's shared one;
- its mean gradient sees the training loader's augmented batches in random order.

The gradient slots are payload ``arrays`` that the strategy declares auxiliary
(``auxiliary_array_prefixes``), so the engine checks them with the model but leaves them out of
the updates its alignment telemetry and ``update_norm_factor`` check measure. The server needs each
client's own gradient unclipped and unnoised (client-side clipping would scale the gradient with
the model): robust aggregation and differential privacy are refused for FedIIR.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
    SupervisedTrainer,
    task_loss,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy, ModelAggregation
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.search_space import Choice
from fedbed.federation.arrays import weighted_average
from fedbed.federation.devices import HOST
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.models import HEAD_PREFIX

GRADIENT_PREFIX = "fediir_mean_gradient/"
"""Prefix of the payload and reply slots of the mean classifier gradient: the slot of the model's
parameter ``classifier.weight`` is ``fediir_mean_gradient/classifier.weight``."""


class FedIIRHyperparameters(LocalTrainingHyperparameters):
    """FedIIR's hyperparameters and their search (the authors' ``domainbed/hparams_registry.py``).

    Attributes:
        penalty_weight: λ, the weight of the gradient penalty (``penalty``: 1e-3 on datasets
            without their own value; RotatedMNIST 1e-2, VLCS 5e-3, PACS 1e-3, OfficeHome 5e-4).
        gradient_ema: the EMA coefficient of the mean gradient ḡ (``ema`` 0.95; grid 0.9, 0.95, 0.99).
        weighting: the model average's client weights: ``num_examples`` (n_k/n, FedBed's) or
            ``uniform`` (1/K, the authors' ``aggregation_client``); ḡ is always n_k/n-weighted.
    """

    penalty_weight: float = Field(1e-3, ge=0)
    gradient_ema: float = Field(0.95, ge=0, le=1)
    weighting: Literal["num_examples", "uniform"] = "num_examples"
    search_space = {  # as the authors' random search draws them, on RotatedMNIST, VLCS, PACS and OfficeHome
        "penalty_weight": Choice([1e-2, 5e-3, 1e-3, 5e-4, 1e-4], source="FedIIR's hparams_registry.py: penalty"),
        "gradient_ema": Choice([0.9, 0.95, 0.99], source="FedIIR's hparams_registry.py: ema")}


def head_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters of ``model.classifier`` by their names in the model
    (``classifier.weight``, ...).

    Raises:
        ValueError: the model has no ``classifier`` with a trainable parameter.
    """
    head = getattr(model, "classifier", None)
    parameters = {} if head is None else {HEAD_PREFIX + n: p for n, p in head.named_parameters() if p.requires_grad}
    if not parameters:
        raise ValueError("FedIIR penalises the gradients of the classifier: the model needs a trainable 'classifier'")
    return parameters


def gradient_penalty(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, mean_gradient: dict[str, torch.Tensor],
                     task: str = "classification", create_graph: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's task loss and Σ_p ‖∇_p loss − ḡ_p‖² over the classifier's parameters p.

    Args:
        model: a :class:`~fedbed.models.DomainClassifier`.
        inputs: ``[B, C, H, W]``; targets: ``[B]``.
        mean_gradient: ḡ, one tensor per name of :func:`head_parameters`, shaped as its parameter.
        create_graph: differentiate the penalty too (through the features into the featurizer);
            ``False`` gives its value only (λ = 0), keeping the loss's graph for its backward.

    Returns:
        ``(loss, penalty)``, two scalars.
    """
    parameters = head_parameters(model)
    loss = task_loss(task, model(inputs), targets)
    gradients = torch.autograd.grad(loss, list(parameters.values()), create_graph=create_graph, retain_graph=True)
    penalty = sum(((g - mean_gradient[name]) ** 2).sum() for name, g in zip(parameters, gradients))
    return loss, penalty


def mean_head_gradient(model: nn.Module, data: ClientData, batch_size: int, task: str = "classification",
                       device: torch.device = HOST) -> dict[str, torch.Tensor]:
    """The mean over the batches of one pass of ``data`` (data order, batches of ``batch_size``,
    the last possibly smaller, no augmentation) of ∇_classifier of the batch-mean task loss.

    The model runs in train mode (as the authors' ``mean_grad``); its buffers (BatchNorm's running
    statistics) are restored afterwards and its random draws (dropout) come from a forked
    generator, so the pass leaves the model and the round's training untouched.

    Args:
        model: a :class:`~fedbed.models.DomainClassifier` on ``device``.
        data: the client's samples (images ``[n, C, H, W]``, targets ``[n]``).

    Returns:
        One tensor per name of :func:`head_parameters`, shaped as its parameter, on ``device``.
    """
    parameters = head_parameters(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    total = {name: torch.zeros_like(p.detach()) for name, p in parameters.items()}
    was_training, batches = model.training, 0
    model.train()
    with torch.random.fork_rng():
        for start, inputs in zip(range(0, len(data), batch_size), data.input_chunks(batch_size)):
            loss = task_loss(task, model(inputs.to(device)), data.targets[start:start + batch_size].to(device))
            for name, gradient in zip(parameters, torch.autograd.grad(loss, list(parameters.values()))):
                total[name] += gradient
            batches += 1
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    model.train(was_training)
    return {name: gradient / max(batches, 1) for name, gradient in total.items()}


def gradient_slots(model: nn.Module) -> nn.Module:
    """A module of zero buffers, one per classifier parameter and named as it inside the classifier:
    added to the client's model as ``fediir_mean_gradient/classifier``, its state-dict names are the
    gradient slots, so the slots load with the payload and leave with the reply."""
    slots = nn.Module()
    for name, parameter in head_parameters(model).items():
        *path, leaf = name.removeprefix(HEAD_PREFIX).split(".")
        module = slots
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_buffer(leaf, torch.zeros_like(parameter.detach()))
    return slots


class FedIIRTrainer(SupervisedTrainer):
    """The FedIIR client: computes g_k with the received model (:func:`mean_head_gradient`), trains
    on the task loss plus λ times :func:`gradient_penalty` towards the received ḡ (logged as
    ``penalty``), and returns g_k in the gradient slots."""

    hparams: FedIIRHyperparameters

    def __init__(self, hparams: FedIIRHyperparameters, context: AlgorithmContext) -> None:
        super().__init__(hparams, context)
        self.model.add_module(GRADIENT_PREFIX + HEAD_PREFIX.rstrip("."), gradient_slots(self.model).to(self.device))

    def slot(self, model: nn.Module, name: str) -> torch.Tensor:
        """The buffer of ``model`` holding the gradient slot of the classifier parameter ``name``."""
        return model.get_buffer(GRADIENT_PREFIX + name)

    def starting_arrays(self, payload: Payload, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        missing = [name for name in head_parameters(self.model) if GRADIENT_PREFIX + name not in payload.arrays]
        if missing:
            raise ValueError(f"FedIIR's client needs the server's mean gradient: the payload has no {GRADIENT_PREFIX}"
                             f"{missing[0]} (run it with FedIIR's strategy)")
        return payload.arrays

    def train_round(self, model: nn.Module, data: ClientData, hparams: LocalTrainingHyperparameters,
                    generator: torch.Generator, payload: Payload, state: dict[str, Any]) -> float:
        fresh = mean_head_gradient(model, data, self.budget.batch_size, self.task, self.device)
        loss = super().train_round(model, data, hparams, generator, payload, state)
        with torch.no_grad():
            for name, gradient in fresh.items():
                self.slot(model, name).copy_(gradient)
        return loss

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        weight = self.hparams.penalty_weight
        target = {name: self.slot(model, name) for name in head_parameters(model)}  # ḡ as received
        loss, penalty = gradient_penalty(model, batch.inputs, batch.targets, target, self.task, create_graph=weight > 0)
        self.log_metric("penalty", penalty)
        return loss + weight * penalty


class FedIIRStrategy(FedAvgStrategy):
    """FedAvg that sends ḡ in the payload's gradient slots and folds the clients' returned
    gradients into it: ḡ ← ema·ḡ + (1 − ema)·Σ_k (n_k/n) g_k; the model arrays go on to
    :attr:`aggregation`. Logs ``ema_gradient_norm``, ‖ḡ‖ after the round (what the next round's
    clients receive).

    Args:
        seed: the run's seed.
        gradient_ema: ema ∈ [0, 1].
        uniform: average the models with weight 1 per client (the authors' 1/K) instead of n_k.
        aggregation: the averaging seam (FedAvg's by default).
    """

    auxiliary_array_prefixes = (GRADIENT_PREFIX,)  # the slots are not the model: no update telemetry

    def __init__(self, seed: int = 0, gradient_ema: float = 0.95, uniform: bool = False,
                 aggregation: ModelAggregation | None = None) -> None:
        super().__init__(seed, aggregation)
        self.gradient_ema = gradient_ema
        self.uniform = uniform
        self.mean_gradient: dict[str, torch.Tensor] = {}

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        self.mean_gradient = {name: torch.zeros_like(p.detach()) for name, p in head_parameters(model).items()}
        super().initialize(model, clients)

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        payloads = super().configure_round(round_number, selected)
        slots = {GRADIENT_PREFIX + name: gradient.clone() for name, gradient in self.mean_gradient.items()}
        for payload in payloads.values():
            payload.arrays = {**payload.arrays, **slots}
        return payloads

    def client_weights(self, replies: dict[int, Reply], order: list[int]) -> list[float]:
        return [1.0] * len(order) if self.uniform else super().client_weights(replies, order)

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        order = sorted(replies)
        fresh = weighted_average([{name: replies[c].arrays[GRADIENT_PREFIX + name] for name in self.mean_gradient}
                                  for c in order], [replies[c].num_examples for c in order])
        ema = self.gradient_ema
        self.mean_gradient = {name: ema * old + (1 - ema) * fresh[name] for name, old in self.mean_gradient.items()}
        stripped = {c: replace(reply, arrays={n: t for n, t in reply.arrays.items() if not n.startswith(GRADIENT_PREFIX)})
                    for c, reply in replies.items()}
        summary = super().aggregate(round_number, stripped)
        summary.metrics["ema_gradient_norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in self.mean_gradient.values())))
        return summary

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mean_gradient": {n: g.clone() for n, g in self.mean_gradient.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.mean_gradient = {n: g.clone() for n, g in state["mean_gradient"].items()}


@register_algorithm
class FedIIR(SupervisedAlgorithm):
    """FedIIR (Guo et al., ICML 2023; the authors' code): classifier-gradient alignment to the
    server's moving-average mean gradient, sent one round late."""

    name = "fediir"
    secure_aggregation_compatible = False  # the server reads each client's own gradient (module docstring)
    summary = ("FedIIR (Guo et al., ICML 2023; authors' code YamingGuo98/FedIIR): CE + λ Σ ‖∇_classifier CE − ḡ‖², "
               "ḡ the server's EMA of the clients' mean classifier gradient, one round late; FedAvg average.")
    hyperparameters = FedIIRHyperparameters
    trainer_class = FedIIRTrainer
    dataset_defaults = {  # domainbed/hparams_registry.py, 'penalty'
        "RotatedMNIST": {"penalty_weight": 1e-2},
        "VLCS": {"penalty_weight": 5e-3},
        "PACS": {"penalty_weight": 1e-3},
        "OfficeHome": {"penalty_weight": 5e-4},
    }

    def create_strategy(self, hparams: FedIIRHyperparameters, context: AlgorithmContext) -> FedIIRStrategy:
        return FedIIRStrategy(context.seed, hparams.gradient_ema, uniform=hparams.weighting == "uniform")


__all__ = ["FedIIR", "FedIIRStrategy", "FedIIRTrainer", "gradient_penalty", "mean_head_gradient"]
