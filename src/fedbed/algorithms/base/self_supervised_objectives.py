"""The self-supervised objectives that FedSimCLR, FedMoCo, FedBYOL, FedSimSiam, FedEMA and FedGaLA
train their clients on, with each objective's hyperparameters (sources in
:mod:`fedbed.algorithms.base.self_supervised`'s docstring).

Each :class:`Objective` scores the two views of a batch, passed through a network as one
concatenated batch of 2B images, so BatchNorm sees both views, as in SimCLR's global BN.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.self_supervised import (
    Objective,
    SelfSupervisedHyperparameters,
    projection_head,
)


def nt_xent_loss(first: torch.Tensor, second: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, Eq. 1), mean over the 2B anchors.

    With the 2B projections L2-normalised, ``s_ij = z_i·z_j / τ``, anchor i's positive is the other
    view of its image and ``ℓ_i = −log(exp(s_i,pos) / Σ_{k≠i} exp(s_ik))``.

    Args:
        first: ``[B, d]`` projections of the first views.
        second: ``[B, d]`` projections of the second views (row b is the same image as ``first[b]``).
        temperature: τ > 0.

    Raises:
        ValueError: shapes that differ or are not ``[B, d]``, or τ <= 0.
    """
    if first.dim() != 2 or first.shape != second.shape:
        raise ValueError(f"NT-Xent needs two [B, d] projections of one shape, got {tuple(first.shape)} and {tuple(second.shape)}")
    if temperature <= 0:
        raise ValueError(f"the NT-Xent temperature must be positive, got {temperature}")
    count = first.shape[0]
    z = nn.functional.normalize(torch.cat([first, second]), dim=1)
    logits = (z @ z.T / temperature).masked_fill(torch.eye(2 * count, dtype=torch.bool, device=z.device), float("-inf"))
    positives = torch.cat([torch.arange(count, device=z.device) + count, torch.arange(count, device=z.device)])
    return nn.functional.cross_entropy(logits, positives)


def queue_contrastive_loss(queries: torch.Tensor, keys: torch.Tensor, queue: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo's InfoNCE (He et al. 2020, Eq. 1): each query against its own key (positive) and the
    queue's keys (negatives), cross-entropy with the positive as class 0, batch mean.

    Args:
        queries: ``[N, d]`` (L2-normalised here; gradients flow).
        keys: ``[N, d]`` (L2-normalised here; no gradient flows).
        queue: ``[K, d]`` unit-norm keys of earlier batches.
        temperature: τ > 0.
    """
    q = nn.functional.normalize(queries, dim=1)
    k = nn.functional.normalize(keys.detach(), dim=1)
    logits = torch.cat([(q * k).sum(dim=1, keepdim=True), q @ queue.detach().T], dim=1) / temperature
    return nn.functional.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


def negative_cosine(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``−cos(p, sg(z))`` averaged over rows (SimSiam Eq. 1 with the stop-gradient of Eq. 3);
    BYOL's ``‖p̄ − z̄‖² = 2 − 2 cos`` is ``2 + 2·`` this. ``[N, d], [N, d] -> []``."""
    return -nn.functional.cosine_similarity(predictions, targets.detach(), dim=1).mean()


@torch.no_grad()
def moving_average(average: nn.Module, current: nn.Module, decay: float) -> None:
    """``ξ ← decay·ξ + (1 − decay)·θ`` for each parameter pair of two modules of one architecture
    (BYOL's target, MoCo's momentum encoder); buffers are left to the averaged module's own
    forward passes."""
    for kept, new in zip(average.parameters(), current.parameters()):
        kept.mul_(decay).add_(new.detach(), alpha=1.0 - decay)


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """Rows ``[first half; second half] -> [second half; first half]`` (the other view of each row)."""
    half = tensor.shape[0] // 2
    return torch.cat([tensor[half:], tensor[:half]])


@dataclasses.dataclass
class SimCLRObjective(Objective):
    """SimCLR (Chen et al. 2020): :func:`nt_xent_loss` of the two views' projections."""

    name: ClassVar[str] = "simclr"
    temperature: float = 0.5

    def loss(self, model, views, modules, buffers):
        first, second = model.embed(views).chunk(2)
        return nt_xent_loss(first, second, self.temperature)


@dataclasses.dataclass
class MoCoObjective(Objective):
    """MoCo (He et al. 2020), symmetrised, with a momentum encoder and a queue on the client."""

    name: ClassVar[str] = "moco"
    temperature: float = 0.1
    queue_size: int = 4096
    key_momentum: float = 0.99

    def local_modules(self, model):
        return {"key_network": copy.deepcopy(model.online_network())}

    def initial_buffers(self, model):
        queue = nn.functional.normalize(torch.randn(self.queue_size, model.projection_dim), dim=1)
        return {"queue": queue, "queue_position": torch.zeros((), dtype=torch.long)}

    def loss(self, model, views, modules, buffers):
        queries = model.embed(views)
        with torch.no_grad():
            keys = nn.functional.normalize(modules["key_network"](swap_halves(views)), dim=1)
        queue, half = buffers["queue"].clone(), len(views) // 2
        loss = (queue_contrastive_loss(queries[:half], keys[:half], queue, self.temperature)
                + queue_contrastive_loss(queries[half:], keys[half:], queue, self.temperature))
        # Enqueue (replacing the oldest keys) after the loss has read the queue.
        keys = keys[-self.queue_size:]
        position = int(buffers["queue_position"])
        buffers["queue"][(position + torch.arange(len(keys), device=keys.device)) % self.queue_size] = keys.to(buffers["queue"].dtype)
        buffers["queue_position"].fill_((position + len(keys)) % self.queue_size)
        return loss

    def after_step(self, model, modules):
        moving_average(modules["key_network"], model.online_network(), self.key_momentum)


@dataclasses.dataclass
class BYOLObjective(Objective):
    """BYOL (Grill et al. 2020): predictor on the online projection, EMA target network."""

    name: ClassVar[str] = "byol"
    trained_modules: ClassVar[tuple[str, ...]] = ("predictor",)
    target_decay: float = 0.99
    predictor_hidden_dim: int = 4096

    def local_modules(self, model):
        modules = {"target_network": copy.deepcopy(model.online_network())}
        if model.predictor is None:  # FedBYOL: the predictor stays on the client; FedEMA's is the model's
            modules["predictor"] = projection_head(model.projection_dim, self.predictor_hidden_dim, model.projection_dim)
        return modules

    def loss(self, model, views, modules, buffers):
        predictions = modules.get("predictor", model.predictor)(model.embed(views))
        with torch.no_grad():
            targets = swap_halves(modules["target_network"](views))
        return 2.0 * (2.0 + 2.0 * negative_cosine(predictions, targets))

    def after_step(self, model, modules):
        moving_average(modules["target_network"], model.online_network(), self.target_decay)


@dataclasses.dataclass
class SimSiamObjective(Objective):
    """SimSiam (Chen and He 2021): predictor, stop-gradient on the other view's projection."""

    name: ClassVar[str] = "simsiam"
    trained_modules: ClassVar[tuple[str, ...]] = ("predictor",)
    predictor_hidden_dim: int = 512

    def local_modules(self, model):
        return {"predictor": projection_head(model.projection_dim, self.predictor_hidden_dim, model.projection_dim)}

    def loss(self, model, views, modules, buffers):
        projections = model.embed(views)
        return negative_cosine(modules["predictor"](projections), swap_halves(projections))


OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (SimCLRObjective, MoCoObjective, BYOLObjective, SimSiamObjective)}
"""Objective name -> class."""


class SimCLRHyperparameters(SelfSupervisedHyperparameters):
    """FedSimCLR: Adam 3e-3 (App. B.3); NT-Xent temperature 0.5 (Chen et al. 2020, App. B.9)."""

    temperature: float = Field(0.5, gt=0)


class MomentumSGDHyperparameters(SelfSupervisedHyperparameters):
    """The baselines' optimiser (App. B.3): SGD, learning rate 0.03, momentum 0.9, weight decay 3e-4."""

    client_optimizer: Literal["adam", "sgd"] = "sgd"
    client_lr: float = Field(0.03, gt=0)
    client_momentum: float = Field(0.9, ge=0, lt=1)
    client_weight_decay: float = Field(3e-4, ge=0)


class MoCoHyperparameters(MomentumSGDHyperparameters):
    """FedMoCo: learning rate 0.025 (App. B.3); queue 4096, projection 128, key momentum 0.99,
    temperature 0.1 (MoCo's CIFAR-10 setting, module docstring)."""

    client_lr: float = Field(0.025, gt=0)
    projection_dim: int = Field(128, gt=0)
    temperature: float = Field(0.1, gt=0)
    queue_size: int = Field(4096, gt=0)
    key_momentum: float = Field(0.99, ge=0, lt=1)


class BYOLHyperparameters(MomentumSGDHyperparameters):
    """FedBYOL: target decay 0.99 (FedU, FedEMA), predictor hidden width 4096 (App. B.2)."""

    target_decay: float = Field(0.99, ge=0, lt=1)
    predictor_hidden_dim: int = Field(4096, gt=0)


class SimSiamHyperparameters(MomentumSGDHyperparameters):
    """FedSimSiam: predictor hidden width 512 (Chen and He 2021, Sec. 3)."""

    predictor_hidden_dim: int = Field(512, gt=0)
