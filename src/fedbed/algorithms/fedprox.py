"""FedProx (Li et al., MLSys 2020)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.fedavg import FedAvg
from fedbed.algorithms.local_training import LocalTrainingHyperparameters, SupervisedTrainer
from fedbed.algorithms.registry import register_algorithm
from fedbed.federation.local_data import Batch
from fedbed.federation.messages import Payload


class FedProxHyperparameters(LocalTrainingHyperparameters):
    """FedProx's proximal coefficient μ.

    Default μ = 0.01, hFedF's selected "L2 regularizer" for FedProx on PACS (``hfedf.txt``,
    Table 10); PPDG uses μ = 0.1 on RotatedMNIST (Sec. 4.4).
    """

    mu: float = Field(0.01, ge=0)


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


class FedProxTrainer(SupervisedTrainer):
    """Cross-entropy plus :func:`proximal_term` around the model the server sent (the payload's
    arrays, Li et al. 2020, Eq. 2): the simplest use of the batch-loss hook."""

    hparams: FedProxHyperparameters

    def batch_loss(self, model: nn.Module, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        return super().batch_loss(model, batch, payload, state) + proximal_term(model, payload.arrays, self.hparams.mu)


@register_algorithm
class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020): FedAvg with a proximal term in each client's loss."""

    name = "fedprox"
    summary = "FedProx (Li et al. 2020): local loss + mu/2 ||theta - theta_global||^2, FedAvg aggregation."
    hyperparameters = FedProxHyperparameters
    trainer_class = FedProxTrainer
    dataset_defaults = {}  # hfedf.txt Table 10: FedProx's values are the same on PACS, Office-Home and VLCS
