"""FedSimCLR: SimCLR clients under FedAvg, a baseline of FedGaLA's Table 1 (sources in
:mod:`fedbed.algorithms.base.self_supervised` and :mod:`fedbed.algorithms.base.self_supervised_objectives`)."""

from __future__ import annotations

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm
from fedbed.algorithms.base.self_supervised_objectives import (
    SimCLRHyperparameters,
    SimCLRObjective,
)


@register_algorithm
class FedSimCLR(SelfSupervisedAlgorithm):
    """FedSimCLR (``fedgala.md`` Sec. 4 "Baselines"): SimCLR clients, FedAvg."""

    name = "fedsimclr"
    summary = ("FedSimCLR (FedGaLA's baseline): SimCLR (Chen et al. 2020), NT-Xent on two views per client, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimCLRHyperparameters
    objective = SimCLRObjective
