"""What every part of FedBed's Flower support shares: its error and the offline environment of
every Flower process. (Absolute paths for apps that run in another working directory:
:meth:`fedbed.config.ValidatedConfig.with_absolute_paths`.)"""

from __future__ import annotations

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

