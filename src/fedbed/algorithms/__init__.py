"""Federated methods, registered by name. Importing this package registers every method."""

from fedbed.algorithms import fedadg, fedavg, fedprox, fedsr, gradient_agreement, hypernetwork, local_only, mcgdm, ppdg  # noqa: F401  (registration)
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
