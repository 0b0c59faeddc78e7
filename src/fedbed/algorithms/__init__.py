"""Federated methods, registered by name. Importing this package registers every method."""

from fedbed.algorithms import (  # noqa: F401  (registration)
    fedadg,
    fedavg,
    fedgala,
    fedprox,
    fedsr,
    gradient_agreement,
    hypernetwork,
    local_only,
    mcgdm,
    ppdg,
    self_supervised,
)
from fedbed.algorithms.registry import (
    ALGORITHMS,
    Algorithm,
    AlgorithmContext,
    AlgorithmError,
    Hyperparameters,
    TrainingBudget,
    get_algorithm,
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
]
