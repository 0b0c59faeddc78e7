"""What every part of FedBed's Flower support shares: its error, the offline environment of
every Flower process and the fingerprint of a site's key. (Absolute paths for apps that run in
another working directory: :meth:`fedbed.config.ValidatedConfig.with_absolute_paths`.)"""

from __future__ import annotations

import base64
import hashlib

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


def key_fingerprint(public_key: bytes) -> str:
    """The OpenSSH fingerprint of a site's public key (``SHA256:`` and the unpadded base64 of the
    SHA-256 of its OpenSSH encoding, as ``ssh-keygen -lf site.pub`` prints it), given as PEM (as
    Flower's SuperLink holds a SuperNode's key) or as an OpenSSH line (a ``.pub`` file).

    Raises:
        ValueError: ``public_key`` is neither.
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = (serialization.load_pem_public_key(public_key) if public_key.lstrip().startswith(b"-----")
               else serialization.load_ssh_public_key(public_key.strip()))
        line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:
        raise ValueError(f"not a public key in PEM or OpenSSH format ({error})") from None
    digest = hashlib.sha256(base64.b64decode(line.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")
