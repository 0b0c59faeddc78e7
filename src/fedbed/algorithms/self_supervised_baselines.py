"""FedSimCLR, FedMoCo, FedBYOL and FedSimSiam: the federated self-supervised baselines of FedGaLA's
Table 1 (``fedgala.md`` Sec. 4 "Baselines"), each its objective's clients under FedAvg of the
encoder and projector. The objectives and their settings are in
:mod:`fedbed.algorithms.base.self_supervised_objectives`, the client machinery (what stays on the
client, the regularisers of Table 7, the linear probe) in :mod:`fedbed.algorithms.base.self_supervised`.
"""

from __future__ import annotations

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import SelfSupervisedAlgorithm
from fedbed.algorithms.base.self_supervised_objectives import (
    BYOLHyperparameters,
    BYOLObjective,
    MoCoHyperparameters,
    MoCoObjective,
    SimCLRHyperparameters,
    SimCLRObjective,
    SimSiamHyperparameters,
    SimSiamObjective,
)


@register_algorithm
class FedSimCLR(SelfSupervisedAlgorithm):
    """FedSimCLR (``fedgala.md`` Sec. 4 "Baselines"): SimCLR clients, FedAvg."""

    name = "fedsimclr"
    summary = ("FedSimCLR (FedGaLA's baseline): SimCLR (Chen et al. 2020), NT-Xent on two views per client, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimCLRHyperparameters
    objective = SimCLRObjective


@register_algorithm
class FedMoCo(SelfSupervisedAlgorithm):
    """FedMoCo (``fedgala.md`` Sec. 4): MoCo clients (momentum encoder and queue stay local), FedAvg."""

    name = "fedmoco"
    summary = ("FedMoCo (FedGaLA's baseline): MoCo (He et al. 2020) with a local momentum encoder and queue, "
               "FedAvg of encoder + projector.")
    hyperparameters = MoCoHyperparameters
    objective = MoCoObjective


@register_algorithm
class FedBYOL(SelfSupervisedAlgorithm):
    """FedBYOL (``fedgala.md`` Sec. 4; Zhuang et al. 2021): predictor and target stay local."""

    name = "fedbyol"
    summary = ("FedBYOL (FedGaLA's baseline): BYOL (Grill et al. 2020) with a local predictor and target, "
               "FedAvg of online encoder + projector.")
    hyperparameters = BYOLHyperparameters
    objective = BYOLObjective


@register_algorithm
class FedSimSiam(SelfSupervisedAlgorithm):
    """FedSimSiam (``fedgala.md`` Sec. 4; Zhuang et al. 2021): the predictor stays local."""

    name = "fedsimsiam"
    summary = ("FedSimSiam (FedGaLA's baseline): SimSiam (Chen and He 2021) with a local predictor, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimSiamHyperparameters
    objective = SimSiamObjective
