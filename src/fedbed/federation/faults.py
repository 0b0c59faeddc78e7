"""Faulty and Byzantine clients on purpose: a test and evaluation harness, never part of a method.

:class:`FaultyClientTrainer` wraps any method's :class:`~fedbed.federation.strategy.ClientTrainer`
and makes some clients misbehave in one of the ways a real federation sees: a client that raises,
one slower than the run's ``client_timeout``, a reply with non-finite values, an array of the wrong
shape or dtype, a missing array, an update a million times too large, or a Byzantine update
(the client's honest update sign-flipped and scaled x10: the sign-flipping attack of the
Byzantine-robust learning literature, made strong enough to dominate a plain average). The
run's ``attack`` and ``attacking_clients`` settings wrap the trainer on every backend (the
wrapper knows its client from the payload's ``client``), so the engine's reply checks and the
server's robust aggregation are exercised by the same code in-process and on Flower.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer

FAULTS = ("exception", "slow", "non_finite", "wrong_shape", "wrong_dtype", "missing_array", "norm_1e6",
          "sign_flip_scale10")
"""What a faulty client does (:class:`FaultyClientTrainer`)."""

SLOW_SECONDS = 5.0
"""How long a ``slow`` client sleeps after its fit unless told otherwise, in seconds."""


def _first_floating(arrays: dict[str, torch.Tensor]) -> str:
    return next(name for name, array in arrays.items() if array.is_floating_point())


def _scaled_update(reply: Reply, payload: Payload, factor: float) -> dict[str, torch.Tensor]:
    """``payload + factor · (reply − payload)`` on every floating-point array the payload sent."""
    return {name: (payload.arrays[name] + factor * (array - payload.arrays[name])).to(array.dtype)
            if array.is_floating_point() and name in payload.arrays else array
            for name, array in reply.arrays.items()}


def corrupt(reply: Reply, payload: Payload, fault: str) -> Reply:
    """The reply a client with ``fault`` sends instead of ``reply`` (a new :class:`Reply`; the
    ``exception`` and ``slow`` faults happen in :meth:`FaultyClientTrainer.fit`, not here).

    Raises:
        ValueError: an unknown fault.
    """
    arrays = dict(reply.arrays)
    if fault in ("exception", "slow"):
        pass
    elif fault == "non_finite":
        name = _first_floating(arrays)
        arrays[name] = arrays[name].clone()
        arrays[name].view(-1)[0] = float("nan")
    elif fault == "wrong_shape":
        name = _first_floating(arrays)
        arrays[name] = torch.cat([arrays[name].reshape(-1), arrays[name].new_zeros(1)])
    elif fault == "wrong_dtype":
        name = _first_floating(arrays)
        arrays[name] = arrays[name].to(torch.float64 if arrays[name].dtype != torch.float64 else torch.float32)
    elif fault == "missing_array":
        arrays.pop(next(iter(arrays)))
    elif fault == "norm_1e6":
        arrays = _scaled_update(reply, payload, 1e6)
    elif fault == "sign_flip_scale10":
        arrays = _scaled_update(reply, payload, -10.0)
    else:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    return Reply(arrays=arrays, num_examples=reply.num_examples, metrics=dict(reply.metrics))


class FaultyClientTrainer(ClientTrainer):
    """A method's trainer whose ``faulty_clients`` misbehave as ``fault`` says (a harness).

    The other clients train exactly as the wrapped trainer does. A faulty client trains too
    (so its reply is built from a real update) and then corrupts it (:func:`corrupt`), raises
    ``RuntimeError`` (``exception``) or sleeps ``slow_seconds`` (``slow``).

    Args:
        inner: the method's client half.
        fault: one of :data:`FAULTS`.
        faulty_clients: the client ids that misbehave (read from the payload's ``client``).
        slow_seconds: how long a ``slow`` client sleeps after its fit (:data:`SLOW_SECONDS`).

    Raises:
        ValueError: an unknown fault.
    """

    def __init__(self, inner: ClientTrainer, fault: str, faulty_clients: set[int] | frozenset[int],
                 slow_seconds: float = SLOW_SECONDS) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
        self.inner, self.fault, self.faulty_clients = inner, fault, frozenset(faulty_clients)
        self.slow_seconds = slow_seconds

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        reply = self.inner.fit(payload, data, state)
        if int(payload.config.get("client", -1)) not in self.faulty_clients:
            return reply
        if self.fault == "exception":
            raise RuntimeError(f"injected fault on client {payload.config['client']}")
        if self.fault == "slow":
            time.sleep(self.slow_seconds)
        return corrupt(reply, payload, self.fault)
