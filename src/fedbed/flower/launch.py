"""Run one FedBed job on Flower: its simulation engine (``flower-sim``) or a real deployment
(``flower-deployment``: one SuperLink and one SuperNode per client on 127.0.0.1).

Flower is kept offline and quiet: telemetry, update checks and runtime dependency installation
are off, and every deployment gets a private ``FLWR_HOME``. Every process started here is
stopped by its PID, also on Ctrl-C and on failure.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from fedbed.experiment import ConfigError, ExperimentConfig, validate

BACKENDS = ("in-process", "flower-sim", "flower-deployment")


class FlowerError(RuntimeError):
    """Raised when a Flower run cannot go on: nodes missing or lost, a Flower process failed."""

OFFLINE_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}
"""Environment for every Flower process (DESIGN.md: no telemetry, no update check, no installs)."""


def with_absolute_paths(config: ExperimentConfig) -> ExperimentConfig:
    """The config with absolute paths: Flower's apps may run in another working directory."""
    updates: dict[str, Any] = {"run_dir": config.resolved_run_dir().resolve()}
    if config.data_root is not None:
        updates["data_root"] = config.data_root.resolve()
    if config.pretrained_weights is not None:
        updates["pretrained_weights"] = config.pretrained_weights.resolve()
    return config.model_copy(update=updates)


def run_flower_simulation(config: ExperimentConfig, *, progress: bool = False, echo: Callable[..., Any] = print,
                          cpus: int | None = None) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine (Ray): one virtual SuperNode per client,
    one CPU per client actor; return the summary (as :func:`fedbed.experiment.run_experiment`).

    Args:
        config: the run.
        progress: show the engine's progress bar.
        echo: where one-line messages go.
        cpus: CPUs Ray may use (default: all cores); client actors = ``cpus`` (one CPU each).

    Raises:
        ConfigError: invalid settings.
        fedbed.flower.apps.FlowerError: the simulation ended without a result (the cause is chained).
    """
    validate(config)
    os.environ.update(OFFLINE_ENVIRONMENT)
    from flwr.simulation import run_simulation

    from fedbed.flower.apps import cached_run, make_apps

    config = with_absolute_paths(config)
    num_clients = len(cached_run(config.model_dump_json()).partitions)
    outcome: dict[str, Any] = {}
    server, client = make_apps(config, "flower-sim", outcome, progress=progress, echo=echo)
    cpus = cpus or os.cpu_count() or 1
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False, "log_to_driver": False},
    }
    try:
        run_simulation(server_app=server, client_app=client, num_supernodes=num_clients, backend_config=backend_config)
    except Exception as error:  # Flower re-raises the ServerApp's exception; keep its message
        raise FlowerError(f"the Flower simulation failed: {error}") from error
    if "summary" not in outcome:
        raise FlowerError("the Flower simulation ended without a result; see Flower's log above")
    return outcome["summary"]


def run_on_backend(config: ExperimentConfig, backend: str, **options: Any) -> dict[str, Any]:
    """Run ``config`` in-process (the default), on ``flower-sim`` or on ``flower-deployment``.

    Raises:
        ConfigError: an unknown backend or invalid settings.
    """
    if backend == "in-process":
        from fedbed.experiment import run_experiment

        return run_experiment(config, **options)
    if backend == "flower-sim":
        return run_flower_simulation(config, **options)
    if backend == "flower-deployment":
        from fedbed.flower.deployment import run_flower_deployment

        return run_flower_deployment(config, **options)
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
