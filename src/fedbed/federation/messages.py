"""Messages between server and clients, mirroring Flower's Message API records.

``Payload`` maps to two ``ArrayRecord``s (``arrays``, the model the client trains and sends back, and
``read_only_arrays``, what else the server sends) plus a ``ConfigRecord`` (``config``);
``Reply`` to an ``ArrayRecord`` plus a ``MetricRecord`` (``metrics`` and ``num_examples``).
Only tensors and scalars cross the boundary, never data samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Scalar = int | float | str | bool


def array_bytes(arrays: dict[str, torch.Tensor]) -> int:
    """Total size in bytes of named tensors (elements x element size)."""
    return sum(t.numel() * t.element_size() for t in arrays.values())


FIT_SECONDS = "fit_seconds"
"""The reply metric :func:`fedbed.federation.transport.fit_client` adds: wall-clock seconds of the client's ``fit``, which
the engine compares with the run's ``client_timeout``."""

CLIPPING_NORM = "clipping_norm"
"""The payload config key of client-side fixed clipping: when present, :func:`fedbed.federation.transport.fit_client` clips
the reply's update to this L2 norm before it leaves the client (Flower's ``fixedclipping_mod``)."""

@dataclass
class Payload:
    """What the server sends one client for one round.

    Attributes:
        arrays: the model the client starts from (e.g. the global model's state dict); may
            differ per client. A reply must send back an array of the same name, shape and
            dtype for each of them (the engine drops it otherwise), and the alignment
            telemetry measures the client's update against them.
        config: named scalars (e.g. the round number, a proximal coefficient).
        read_only_arrays: further named tensors the client may read but does not train or send
            back (other clients' heads, the global model's last change, models to score): no
            reply check, loading, averaging or alignment telemetry sees them; the round's
            communication telemetry counts their bytes.

    A client treats every tensor of its payload as read-only: in-process the tensors may be
    shared with the server's state and with the other clients' payloads (on Flower each client
    gets its own copy), so editing one in place would make the backends differ.
    """

    arrays: dict[str, torch.Tensor]
    config: dict[str, Scalar] = field(default_factory=dict)
    read_only_arrays: dict[str, torch.Tensor] = field(default_factory=dict)

    def num_bytes(self) -> int:
        """Bytes of every tensor sent (``arrays`` and ``read_only_arrays``)."""
        return array_bytes(self.arrays) + array_bytes(self.read_only_arrays)


@dataclass
class Reply:
    """What one client returns after its local training.

    Attributes:
        arrays: named tensors (e.g. the trained state dict).
        num_examples: number of training samples the client used (n_k), always present.
        metrics: named scalars (e.g. the mean training loss).
    """

    arrays: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def num_bytes(self) -> int:
        """Bytes of every tensor returned."""
        return array_bytes(self.arrays)


@dataclass(frozen=True)
class ClientInfo:
    """What the server may know of a client before training.

    Attributes:
        client_id: 0-based id.
        num_examples: training samples it holds; ``None`` for a server that does not hold the
            client's data (data spread over machines): a strategy weights by each reply's
            ``num_examples`` instead.
        domains: ids of the source domains it holds (known to the server only where a protocol allows).
    """

    client_id: int
    num_examples: int | None
    domains: tuple[int, ...]


@dataclass
class RoundSummary:
    """What a strategy reports after aggregating one round.

    Attributes:
        metrics: named scalars logged for the round (e.g. the mean client loss).
        telemetry: JSON-serialisable details of the aggregation (weights, masks, cosines).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
