"""What every part of FedBed's Flower support shares: its error, the offline environment of every
Flower process, and absolute paths for apps that run in another working directory."""

from __future__ import annotations

from typing import Any

from fedbed.config import ExperimentConfig
from fedbed.federation.transport import TransportError


class FlowerError(TransportError):
    """Raised when a Flower run cannot go on: nodes missing or lost, a Flower process failed."""


OFFLINE_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
    # Ray's FutureWarning about overriding CUDA_VISIBLE_DEVICES when no GPU is requested: FedBed
    # requests none, and this setting is the one Ray's message names to turn it off.
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}
"""Environment for every Flower process: no telemetry, no update check, no installs at run time,
no warning a FedBed user cannot act on."""


def with_absolute_paths(config: ExperimentConfig) -> ExperimentConfig:
    """The config with absolute paths: Flower's apps may run in another working directory."""
    updates: dict[str, Any] = {"run_dir": config.resolved_run_dir().resolve()}
    if config.data_root is not None:
        updates["data_root"] = config.data_root.resolve()
    if config.pretrained_weights is not None:
        updates["pretrained_weights"] = config.pretrained_weights.resolve()
    return config.model_copy(update=updates)
