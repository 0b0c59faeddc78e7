"""Where a run executes: in this process (the default) or on Flower.

The in-process backend needs nothing of Flower: ``fedbed.flower`` (and ``flwr``) are imported only
when a Flower backend is chosen.
"""

from __future__ import annotations

from typing import Any

from fedbed.config import ConfigError, ExperimentConfig, validate
from fedbed.run_result import RunResult
from fedbed.federation.transport import TransportError

BACKENDS = ("in-process", "flower-sim", "flower-deployment")

__all__ = ["BACKENDS", "TransportError", "run_on_backend"]


def run_on_backend(config: ExperimentConfig, backend: str, *, overwrite: bool = False, **options: Any) -> RunResult:
    """Run ``config`` in-process (the default), on ``flower-sim`` or on ``flower-deployment``;
    return the run as data (:class:`fedbed.results.RunResult`, also its summary as a mapping).

    The run directory is checked before any data is loaded or any Flower process starts
    (:func:`fedbed.experiment.check_run_dir`); with ``overwrite`` an earlier run there is deleted.

    Raises:
        ConfigError: an unknown backend, invalid settings, or a run directory holding another run.
        TransportError: a Flower run failed (its subclass :class:`fedbed.flower.common.FlowerError`).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    from fedbed.experiment import check_run_dir, recorded_settings, remove_run

    names = validate(config)
    run_dir = config.resolved_run_dir()
    if overwrite:
        remove_run(run_dir)
    resume = bool(options.get("resume", False))
    check_run_dir(run_dir, recorded_settings(config, config.model or names.dataset.default_model, names.hparams), resume)
    if backend == "in-process":
        from fedbed.experiment import run_experiment

        return run_experiment(config, **options)
    from fedbed.run_result import load_run

    if backend == "flower-sim":
        from fedbed.flower.simulation import run_flower_simulation

        run_flower_simulation(config, **options)
    else:
        from fedbed.flower.deployment import run_flower_deployment

        run_flower_deployment(config, **options)
    return load_run(run_dir)
