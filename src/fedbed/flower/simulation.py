"""Run one FedBed job on Flower's simulation engine (``flower-sim``, Ray): one virtual SuperNode
per client, the same ServerApp and ClientApp as a real deployment (:mod:`fedbed.flower.apps`).

The job goes the way Flower 1.41 documents for simulations (its ``run_simulation`` is deprecated
in favour of ``flwr run``): a SuperLink in simulation mode on 127.0.0.1 (``flower-superlink
--simulation``, on a free port, with a private ``FLWR_HOME``; :func:`fedbed.flower.deployment.local_federation`)
and ``flwr run`` of the job's Flower App (:func:`fedbed.flower.deployment.write_app`) with the
federation's size and Ray's resources as ``--federation-config``. The SuperLink starts
``flwr-simulation``, which runs the ServerApp and keeps one Ray actor per CPU share for the
ClientApps; an actor lives through the run and serves many clients, building the run's data once
(:func:`fedbed.flower.apps.cached_run`) and keeping the last 8 clients' shares it served.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from fedbed.config import (
    ClientResources,
    ConfigError,
    ExperimentConfig,
    ValidatedConfig,
    as_validated,
)
from fedbed.federation.devices import gpu_count
from fedbed.flower.common import FlowerError
from fedbed.run_directory import SUMMARY_NAME


def federation_config(validated: ValidatedConfig, cpus: int | None = None) -> dict[str, Any]:
    """The ``flwr run --federation-config`` entries of a simulation of ``validated``: one virtual
    SuperNode per client, Ray on ``cpus`` CPUs (default: all cores) and as many GPUs as this
    machine has when clients get a share of one, each client actor with the config's
    ``client_resources`` (one CPU each by default), no Ray worker output in the driver's log.

    Raises:
        ConfigError: ``client_resources.cpus`` is not a whole number (Flower 1.41's federation
            config takes whole CPUs per client actor).
    """
    resources = validated.config.client_resources or ClientResources()
    if resources.cpus != int(resources.cpus):
        raise ConfigError(f"client_resources.cpus must be a whole number of CPUs on flower-sim (Flower's federation "
                          f"config takes whole CPUs per client actor), got {resources.cpus:g}")
    return {
        "num-supernodes": validated.num_clients,
        "backend": "ray",
        "client-resources-num-cpus": int(resources.cpus),
        "client-resources-num-gpus": float(resources.gpus),
        "init-args-num-cpus": int(cpus or os.cpu_count() or 1),
        "init-args-num-gpus": gpu_count() if resources.gpus else 0,
        "init-args-log-to-driver": False,
    }


def run_flower_simulation(config: ExperimentConfig | ValidatedConfig, *, progress: bool = False, echo: Callable[..., Any] = print,
                          cpus: int | None = None, work_dir: Path | None = None, timeout: float = 86400.0) -> dict[str, Any]:
    """Run ``config`` on Flower's simulation engine (Ray): one virtual SuperNode per client, one
    CPU per client actor; return the summary (as :func:`fedbed.experiment.run_experiment`).

    Args:
        config: the run: validated settings (:func:`fedbed.config.validate`, as
            :func:`fedbed.backends.run_on_backend` hands them), or a config, validated here; the
            apps receive them with their digest and do not validate them again.
        progress: show ``flwr``'s stream of the ServerApp's log.
        echo: where one-line messages go.
        cpus: CPUs Ray may use (default: all cores); client actors = ``cpus`` / the config's
            ``client_resources.cpus`` (one CPU each by default), each with its
            ``client_resources.gpus`` share of a GPU (Ray then sees this machine's GPUs).
        work_dir: the SuperLink's logs and ``FLWR_HOME`` (default: a temporary folder).
        timeout: seconds the run may take.

    Raises:
        ConfigError: invalid settings, fractional ``client_resources.cpus``, or data spread over
            machines missing a domain here (every simulated site reads this machine's data).
        fedbed.flower.common.FlowerError: the simulation ended without a result; the logs are
            copied into ``<run_dir>/flower-logs``, which the message names.
    """
    from fedbed.build import build_run
    from fedbed.flower.deployment import keep_logs, local_federation, submit_run, write_app

    validated = as_validated(config).with_absolute_paths()
    settings = validated.config
    entries = federation_config(validated, cpus)
    if settings.declared_names() is not None:  # data spread over machines: this machine must hold every domain
        build_run(validated).require_every_domain()
    summary_path = settings.resolved_run_dir() / SUMMARY_NAME
    summary_path.unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedbed-flower-sim-")))
        app = write_app(work_dir / "app", validated, backend="flower-sim")
        try:
            with local_federation(0, work_dir, simulation=True) as (_, environment):
                echo(f"flower-sim: {entries['num-supernodes']} simulated SuperNodes on Ray ({entries['init-args-num-cpus']} "
                     f"CPUs); logs in {work_dir}")
                return submit_run(app, environment, work_dir, progress, timeout, summary_path, entries)
        except FlowerError as error:
            kept = keep_logs(work_dir, settings.resolved_run_dir())
            raise FlowerError(str(error).replace(str(work_dir), str(kept))) from None
