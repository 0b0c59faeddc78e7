"""Federated methods, registered by name. Importing this package registers every method.

Layout (``docs/architecture.md``): one file per method here; :mod:`fedbed.algorithms.base` holds
the seams methods are built on (the registry, the client trainers' and the averaging servers'
bases, model and update aggregation, the self-supervised machinery); :mod:`fedbed.algorithms.options`
holds the run options that ``fedbed.build`` wires around any method (robust aggregation,
differential privacy, knowledge vote). A method named ``CLIENT+SERVER`` trains one method's
clients under another's server rule (:mod:`fedbed.algorithms.base.composition`).
"""

from fedbed.algorithms import (  # noqa: F401  (registration)
    fedadg,
    fedavg,
    feddg_ga,
    fedema,
    fediir,
    fedgala,
    fedomg,
    fedprox,
    fedsam,
    fedsr,
    gradient_agreement,
    hypernetwork,
    local_only,
    mcgdm,
    ppdg,
    self_supervised_baselines,
)
from fedbed.algorithms.base.composition import get_algorithm, server_rules
from fedbed.algorithms.base.registry import (
    ALGORITHMS,
    Algorithm,
    AlgorithmContext,
    AlgorithmError,
    Hyperparameters,
    TrainingBudget,
    register_algorithm,
    resolve_hyperparameters,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmError",
    "Hyperparameters",
    "TrainingBudget",
    "get_algorithm",
    "register_algorithm",
    "resolve_hyperparameters",
    "server_rules",
]
