"""FedSimSiam: SimSiam clients under FedAvg, a baseline of FedGaLA's Table 1 (sources in
:mod:`fedbed.algorithms.base.self_supervised` and :mod:`fedbed.algorithms.base.self_supervised_objectives`)."""

from __future__ import annotations

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm
from fedbed.algorithms.base.self_supervised_objectives import (
    SimSiamHyperparameters,
    SimSiamObjective,
)


@register_algorithm
class FedSimSiam(SelfSupervisedAlgorithm):
    """FedSimSiam (``fedgala.md`` Sec. 4; Zhuang et al. 2021): the predictor stays local."""

    name = "fedsimsiam"
    summary = ("FedSimSiam (FedGaLA's baseline): SimSiam (Chen and He 2021) with a local predictor, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimSiamHyperparameters
    objective = SimSiamObjective
