"""Where a run executes: in this process (the default) or on Flower.

The in-process backend needs nothing of Flower: ``fedbed.flower`` (and ``flwr``) are imported only
when a Flower backend is chosen.
"""

from __future__ import annotations

from typing import Any

from fedbed.config import ConfigError, ExperimentConfig, ValidatedConfig, as_validated
from fedbed.run_result import RunResult
from fedbed.federation.transport import TransportError

BACKENDS = ("in-process", "flower-sim", "flower-deployment")

__all__ = ["BACKENDS", "TransportError", "check_backend_options", "check_before_running", "run_on_backend"]


def check_backend_options(backend: str, *, resume: bool = False, overwrite: bool = False, tls: bool = False) -> None:
    """Whether the backend exists and the run's options apply to it: ``resume`` in-process only
    (on Flower the client states live on the clients' nodes), ``tls`` on ``flower-deployment``
    only, and not ``overwrite`` with ``resume``.

    Raises:
        ConfigError: one line naming the option that does not apply.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "in-process" and resume:
        raise ConfigError(f"--resume works in-process only: on {backend} the client states live on the clients' nodes")
    if tls and backend != "flower-deployment":
        raise ConfigError("--tls applies to --backend flower-deployment only")
    if overwrite and resume:
        raise ConfigError("--overwrite deletes the run that --resume would continue; give one of them")


def check_before_running(config: ExperimentConfig | ValidatedConfig, backend: str, *, resume: bool = False,
                         check_folder: bool = True) -> ValidatedConfig:
    """What :func:`run_on_backend` checks before anything of a run starts, changing nothing: the
    backend, the settings (:func:`fedbed.config.validate`, unless ``config`` is already a
    :class:`~fedbed.config.ValidatedConfig`) and, with ``check_folder``, the run directory
    (:func:`fedbed.experiment.check_run_dir`). ``fedbed run`` checks every target's run this way
    before the first starts, and hands the validated settings returned to :func:`run_on_backend`.

    Raises:
        ConfigError: an unknown backend, invalid settings, or a run directory holding another run
            (or, with ``resume``, no run to continue).
    """
    check_backend_options(backend)
    validated = as_validated(config)
    if check_folder:
        from fedbed.experiment import check_run_dir, hyperparameter_defaults, recorded_settings

        settings = validated.config
        check_run_dir(settings.resolved_run_dir(),
                      recorded_settings(settings, settings.model or validated.dataset.default_model, validated.hparams),
                      resume, hyperparameter_defaults(validated.hparams))
    return validated


def run_on_backend(config: ExperimentConfig | ValidatedConfig, backend: str, *, overwrite: bool = False,
                   resume: bool = False, tls: bool = False, **options: Any) -> RunResult:
    """Run ``config`` in-process (the default), on ``flower-sim`` or on ``flower-deployment``;
    return the run as data (:class:`fedbed.run_result.RunResult`, also its summary as a mapping).

    The settings are validated once, here (or not at all when ``config`` is already a
    :class:`~fedbed.config.ValidatedConfig`); the backend receives the validated settings. The
    run directory is checked before any data is loaded or any Flower process starts
    (:func:`fedbed.experiment.check_run_dir`); with ``overwrite`` an earlier run there is deleted.

    Args:
        resume: continue the run from its checkpoint (in-process only).
        tls: TLS everywhere (``flower-deployment`` only).
        options: the backend's own (``progress``, ``echo``, ...).

    Raises:
        ConfigError: an unknown backend, an option that does not apply to it
            (:func:`check_backend_options`), invalid settings, or a run directory holding another run.
        TransportError: a Flower run failed (its subclass :class:`fedbed.flower.common.FlowerError`).
    """
    from fedbed.experiment import remove_run
    from fedbed.federation import phase_timings

    phase_timings.record_process_start("launcher")
    check_backend_options(backend, resume=resume, overwrite=overwrite, tls=tls)
    # With overwrite nothing is deleted for a run that cannot start: the settings are checked first.
    validated = check_before_running(config, backend, resume=resume, check_folder=not overwrite)
    run_dir = validated.config.resolved_run_dir()
    if overwrite:
        remove_run(run_dir)
    if backend == "in-process":
        from fedbed.experiment import run_experiment

        return run_experiment(validated, resume=resume, **options)
    from fedbed.run_result import load_run

    if backend == "flower-sim":
        from fedbed.flower.simulation import run_flower_simulation

        run_flower_simulation(validated, **options)
    else:
        from fedbed.flower.deployment import run_flower_deployment

        run_flower_deployment(validated, tls=tls, **options)
    return load_run(run_dir)
