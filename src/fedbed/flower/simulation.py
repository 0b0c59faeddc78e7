"""Run one FedBed job on Flower's simulation engine (``flower-sim``, Ray): one virtual SuperNode
per client, the same ServerApp and ClientApp as a real deployment (:mod:`fedbed.flower.apps`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from fedbed.config import (
    ClientResources,
    ExperimentConfig,
    ValidatedConfig,
    as_validated,
)
from fedbed.federation.devices import gpu_count
from fedbed.flower.common import OFFLINE_ENVIRONMENT, FlowerError


def _run_simulation_notice(record: logging.LogRecord) -> bool:
    """A logging filter dropping Flower 1.41's notice that ``run_simulation`` is deprecated in
    favour of ``flwr run``: FedBed calls it in-process on purpose (one process, the apps built
    from a closure), and ``fedbed run --backend flower-deployment`` is its ``flwr run`` path."""
    return "`run_simulation` function is deprecated" not in record.getMessage()


def run_flower_simulation(config: ExperimentConfig | ValidatedConfig, *, progress: bool = False, echo: Callable[..., Any] = print,
                          cpus: int | None = None) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine (Ray): one virtual SuperNode per client,
    one CPU per client actor; return the summary (as :func:`fedbed.experiment.run_experiment`).

    Args:
        config: the run: validated settings (:func:`fedbed.config.validate`, as
            :func:`fedbed.backends.run_on_backend` hands them), or a config, validated here; the
            apps receive them validated and do not validate them again.
        progress: show the engine's progress bar.
        echo: where one-line messages go.
        cpus: CPUs Ray may use (default: all cores); client actors = ``cpus`` / the config's
            ``client_resources.cpus`` (one CPU each by default), each with its
            ``client_resources.gpus`` share of a GPU (Ray then sees this machine's GPUs).

    Raises:
        ConfigError: invalid settings, or data spread over machines missing a domain here.
        fedbed.flower.common.FlowerError: the simulation ended without a result (the cause is chained).
    """
    validated = as_validated(config).with_absolute_paths()
    os.environ.update(OFFLINE_ENVIRONMENT)
    from flwr.simulation import run_simulation

    from fedbed.flower.apps import cached_run, make_apps

    built = cached_run(validated.config.model_dump_json(), validated.digest)  # the ServerApp's, in this process
    built.require_every_domain()  # one machine: every simulated site reads this machine's data
    num_clients = len(built.partitions)
    outcome: dict[str, Any] = {}
    server, client = make_apps(validated, "flower-sim", outcome, progress=progress, echo=echo)
    cpus = cpus or os.cpu_count() or 1
    resources = validated.config.client_resources or ClientResources()
    backend_config = {
        "client_resources": {"num_cpus": resources.cpus, "num_gpus": resources.gpus},
        "init_args": {"num_cpus": cpus, "num_gpus": gpu_count() if resources.gpus else 0, "include_dashboard": False,
                      "log_to_driver": False},
    }
    flower_log = logging.getLogger("flwr")
    flower_log.addFilter(_run_simulation_notice)
    try:
        run_simulation(server_app=server, client_app=client, num_supernodes=num_clients, backend_config=backend_config)
    except Exception as error:  # Flower re-raises the ServerApp's exception; keep its message
        raise FlowerError(f"the Flower simulation failed: {error}") from error
    finally:
        flower_log.removeFilter(_run_simulation_notice)
    if "summary" not in outcome:
        raise FlowerError("the Flower simulation ended without a result; see Flower's log above")
    return outcome["summary"]
