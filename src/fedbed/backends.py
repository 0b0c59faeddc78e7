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

__all__ = ["BACKENDS", "TransportError", "check_before_running", "run_on_backend"]


def check_before_running(config: ExperimentConfig, backend: str, *, resume: bool = False, check_folder: bool = True) -> None:
    """What :func:`run_on_backend` checks before anything of a run starts, changing nothing: the
    backend, the settings (:func:`fedbed.config.validate`) and, with ``check_folder``, the run
    directory (:func:`fedbed.experiment.check_run_dir`). ``fedbed run --target all`` checks every
    target's run this way before the first starts.

    Raises:
        ConfigError: an unknown backend, invalid settings, or a run directory holding another run
            (or, with ``resume``, no run to continue).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    names = validate(config)
    if check_folder:
        from fedbed.experiment import check_run_dir, recorded_settings

        check_run_dir(config.resolved_run_dir(), recorded_settings(config, config.model or names.dataset.default_model,
                                                                   names.hparams), resume)


def run_on_backend(config: ExperimentConfig, backend: str, *, overwrite: bool = False, **options: Any) -> RunResult:
    """Run ``config`` in-process (the default), on ``flower-sim`` or on ``flower-deployment``;
    return the run as data (:class:`fedbed.run_result.RunResult`, also its summary as a mapping).

    The run directory is checked before any data is loaded or any Flower process starts
    (:func:`fedbed.experiment.check_run_dir`); with ``overwrite`` an earlier run there is deleted.

    Raises:
        ConfigError: an unknown backend, invalid settings, or a run directory holding another run.
        TransportError: a Flower run failed (its subclass :class:`fedbed.flower.common.FlowerError`).
    """
    from fedbed.experiment import remove_run

    resume = bool(options.get("resume", False))
    if overwrite:
        check_before_running(config, backend, check_folder=False)  # nothing is deleted for a run that cannot start
        remove_run(config.resolved_run_dir())
    check_before_running(config, backend, resume=resume)
    run_dir = config.resolved_run_dir()
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
