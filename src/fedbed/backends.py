"""Where a run executes: in this process (the default) or on Flower.

The in-process backend needs nothing of Flower: ``fedbed.flower`` (and ``flwr``) are imported only
when a Flower backend is chosen.
"""

from __future__ import annotations

from typing import Any

from fedbed.config import ConfigError, ExperimentConfig
from fedbed.federation.transport import TransportError as BackendError

BACKENDS = ("in-process", "flower-sim", "flower-deployment")

__all__ = ["BACKENDS", "BackendError", "run_on_backend"]


def run_on_backend(config: ExperimentConfig, backend: str, **options: Any) -> dict[str, Any]:
    """Run ``config`` in-process (the default), on ``flower-sim`` or on ``flower-deployment``;
    return the run's summary.

    Raises:
        ConfigError: an unknown backend or invalid settings.
        BackendError: a Flower run failed.
    """
    if backend == "in-process":
        from fedbed.experiment import run_experiment

        return run_experiment(config, **options)
    if backend == "flower-sim":
        from fedbed.flower.simulation import run_flower_simulation

        return run_flower_simulation(config, **options)
    if backend == "flower-deployment":
        from fedbed.flower.deployment import run_flower_deployment

        return run_flower_deployment(config, **options)
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
