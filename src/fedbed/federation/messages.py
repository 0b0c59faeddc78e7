"""Messages between server and clients, mirroring Flower's Message API records.

``Payload`` maps to an ``ArrayRecord`` (``arrays``) plus a ``ConfigRecord`` (``config``);
``Reply`` to an ``ArrayRecord`` plus a ``MetricRecord`` (``metrics`` and ``num_examples``).
Only tensors and scalars cross the boundary, never data samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Scalar = int | float | str | bool


@dataclass
class Payload:
    """What the server sends one client for one round.

    Attributes:
        arrays: named tensors (e.g. the global model's state dict); may differ per client.
        config: named scalars (e.g. the round number, a proximal coefficient).
    """

    arrays: dict[str, torch.Tensor]
    config: dict[str, Scalar] = field(default_factory=dict)


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


@dataclass(frozen=True)
class ClientInfo:
    """What the server may know of a client before training.

    Attributes:
        client_id: 0-based id.
        num_examples: training samples it holds.
        domains: ids of the source domains it holds (known to the server only where a protocol allows).
    """

    client_id: int
    num_examples: int
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
