"""FedMoCo: MoCo clients under FedAvg, a baseline of FedGaLA's Table 1 (sources in
:mod:`fedbed.algorithms.base.self_supervised` and :mod:`fedbed.algorithms.base.self_supervised_objectives`)."""

from __future__ import annotations

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm
from fedbed.algorithms.base.self_supervised_objectives import (
    MoCoHyperparameters,
    MoCoObjective,
)


@register_algorithm
class FedMoCo(SelfSupervisedAlgorithm):
    """FedMoCo (``fedgala.md`` Sec. 4): MoCo clients (momentum encoder and queue stay local), FedAvg."""

    name = "fedmoco"
    summary = ("FedMoCo (FedGaLA's baseline): MoCo (He et al. 2020) with a local momentum encoder and queue, "
               "FedAvg of encoder + projector.")
    hyperparameters = MoCoHyperparameters
    objective = MoCoObjective
