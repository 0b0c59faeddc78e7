"""FedBYOL: BYOL clients under FedAvg, a baseline of FedGaLA's Table 1 (sources in
:mod:`fedbed.algorithms.base.self_supervised` and :mod:`fedbed.algorithms.base.self_supervised_objectives`)."""

from __future__ import annotations

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm
from fedbed.algorithms.base.self_supervised_objectives import (
    BYOLHyperparameters,
    BYOLObjective,
)


@register_algorithm
class FedBYOL(SelfSupervisedAlgorithm):
    """FedBYOL (``fedgala.md`` Sec. 4; Zhuang et al. 2021): predictor and target stay local."""

    name = "fedbyol"
    summary = ("FedBYOL (FedGaLA's baseline): BYOL (Grill et al. 2020) with a local predictor and target, "
               "FedAvg of online encoder + projector.")
    hyperparameters = BYOLHyperparameters
    objective = BYOLObjective
