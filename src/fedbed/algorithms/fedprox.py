"""FedProx (Li et al., MLSys 2020)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedTrainer,
    proximal_term,
)
from fedbed.algorithms.base.search_space import LogUniform
from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.fedavg import FedAvg
from fedbed.federation.local_data import Batch
from fedbed.federation.messages import Payload


class FedProxHyperparameters(LocalTrainingHyperparameters):
    """FedProx's proximal coefficient μ.

    Default μ = 0.01, hFedF's selected "L2 regularizer" for FedProx on PACS (``hfedf.txt``,
    Table 10); PPDG uses μ = 0.1 on RotatedMNIST (Sec. 4.4). Searched over 10^U(−3, 0): the
    FedProx paper tunes μ over {0.001, 0.01, 0.1, 1} (Li et al. 2020, Sec. 5), which holds hFedF's
    grid {1e-3, 1e-2, 1e-1}.
    """

    mu: float = Field(0.01, ge=0)

    search_space = {"mu": LogUniform(1e-3, 1.0, source="FedProx (Li et al. 2020, Sec. 5): mu tuned over "
                                                       "{0.001, 0.01, 0.1, 1}")}


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
    server_rule = False  # a client technique on FedAvg's server
    dataset_defaults = {}  # hfedf.txt Table 10: FedProx's values are the same on PACS, Office-Home and VLCS
