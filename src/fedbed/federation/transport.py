"""Where the clients run: the boundary between the engine's rounds and the clients' training.

The engine decides what each selected client receives (``ServerStrategy.configure_round``) and
what to do with the replies (``aggregate``); a :class:`ClientTransport` only carries payloads
to the clients and replies back. :class:`InProcessClients` runs every client one after another
in this process (the default); ``fedbed.flower`` carries the same payloads as Flower messages
to ClientApps on Flower's simulation engine or on real SuperNodes. Both call :func:`fit_client`,
so a client computes the same reply wherever it runs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedbed.federation import phase_timings
from fedbed.federation.arrays import clip_update
from fedbed.federation.client_evaluation import ClientEvaluator
from fedbed.federation.client_states import ClientStates
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import CLIPPING_NORM, FIT_SECONDS, Payload, Reply
from fedbed.federation.strategy import ClientTrainer


class TransportError(RuntimeError):
    """Raised when a transport cannot carry a run on (on Flower: nodes missing or lost, a Flower
    process failed); the message says what failed and where its log is."""




def fit_client(trainer: ClientTrainer, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
    """One client's local training for one round, seeded from ``payload.config["batch_seed"]``.

    The engine puts ``round``, ``rounds`` (the run's total), ``client`` (the client's id) and
    ``batch_seed`` (derived from the run's seed, the round and the client id) into every
    payload's config; seeding torch's global generator from it makes dropout and any other
    global draw of the client reproducible wherever the client runs. The reply's metrics gain
    :data:`FIT_SECONDS`, the wall-clock time of ``fit``; under client-side differential privacy
    (the payload's config holds :data:`CLIPPING_NORM`) the reply's update ``reply − payload`` is
    clipped to that norm here, on the client (:func:`fedbed.federation.arrays.clip_update`).

    Raises:
        KeyError: the payload carries no ``batch_seed`` (it did not come from the engine).
        Exception: whatever the trainer raises (the engine drops the client for the round).
    """
    torch.manual_seed(int(payload.config["batch_seed"]))
    began = time.perf_counter()
    reply = trainer.fit(payload, data, state)
    seconds = time.perf_counter() - began
    if CLIPPING_NORM in payload.config:
        reply.arrays = clip_update(reply.arrays, payload.arrays, float(payload.config[CLIPPING_NORM]))[0]
    reply.metrics[FIT_SECONDS] = seconds
    phase_timings.record("training", seconds, role="client", client=payload.config.get("client"),
                         round=payload.config.get("round"))
    return reply


def _tensors(payload: Payload) -> list[torch.Tensor]:
    return [*payload.arrays.values(), *payload.read_only_arrays.values()]


def _same_values(tensor: torch.Tensor, original: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``original``'s shape, dtype and values (NaN equal to NaN)."""
    if tensor.shape != original.shape or tensor.dtype != original.dtype:
        return False
    if torch.equal(tensor, original):
        return True
    return tensor.is_floating_point() and bool(((tensor == original) | (tensor.isnan() & original.isnan())).all())


class PayloadSnapshot:
    """A copy of every distinct tensor of a round's payloads, taken before any client fits, to
    find a client that edited a tensor it was sent in place, and to put the tensor back.

    In this process a trainer receives the very tensors the server holds: a strategy may send its
    own state (MCGDM's heads of the previous round, read-only) and one tensor to every client
    (FedAvg sends all clients the same arrays). An in-place edit would change the server's state,
    what later clients of the round start from, and the update the engine measures; so it must
    not pass. The check compares values with the copy after each client's fit (``torch.equal``),
    not the tensors' ``_version`` counters: those miss writes through ``tensor.data``, through
    ``tensor.numpy()``, and through a model parameter whose ``.data`` was set to the tensor
    (an optimiser step then writes the payload's memory without counting a version). The cost is
    one copy of each distinct payload tensor per round and one comparison per client and tensor.

    On Flower a client receives deserialised copies, so an edit there cannot reach the server;
    only :class:`InProcessClients` takes a snapshot.
    """

    def __init__(self, payloads: Iterable[Payload]) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for payload in payloads:
            for tensor in _tensors(payload):
                if id(tensor) not in self._copies:
                    self._copies[id(tensor)] = (tensor, tensor.detach().clone())

    def restore_edits(self, payload: Payload) -> str | None:
        """Why the client that received ``payload`` is dropped, when it edited one of its tensors
        in place (every edited tensor is put back first), or ``None``."""
        edited = []
        for kind, arrays in (("a payload array", payload.arrays), ("a read-only payload array", payload.read_only_arrays)):
            for name, tensor in arrays.items():
                original = self._copies[id(tensor)][1]
                if _same_values(tensor, original):
                    continue
                edited.append((kind, name))
                with torch.no_grad():
                    if tensor.shape == original.shape and tensor.dtype == original.dtype:
                        tensor.copy_(original)
                    else:
                        tensor.set_(original.clone())
        if not edited:
            return None
        (kind, name), more = edited[0], len(edited) - 1
        return (f"edited {kind} {name!r} in place" + (f" (and {more} more)" if more else "")
                + ": a trainer must not change the tensors it is sent (it loads them into its own model)")


def handed_to_trainer(payload: Payload) -> Payload:
    """The payload as a trainer receives it in this process: the same tensors, in new dicts, so
    that a trainer that adds, replaces or removes an entry (or replaces ``config``) does not
    change what the server or another client holds. Tensors cannot be made read-only in torch;
    :class:`PayloadSnapshot` finds the in-place edits."""
    return Payload(dict(payload.arrays), dict(payload.config), dict(payload.read_only_arrays))


def unshared_reply(reply: Reply, payload: Payload) -> Reply:
    """``reply`` with every array that shares memory with a tensor of ``payload`` (a trainer that
    returned, or kept a view of, a tensor it was sent) replaced by a copy: the values are the same,
    but the server, which may keep reply arrays as its state, never holds a payload tensor twice.
    Nothing is copied in the common case (a trainer returns its own model's arrays)."""
    sent = {tensor.untyped_storage().data_ptr() for tensor in _tensors(payload) if tensor.numel()}
    shared = [name for name, array in reply.arrays.items()
              if array.numel() and array.untyped_storage().data_ptr() in sent]
    if shared:
        reply.arrays = {name: array.clone() if name in shared else array for name, array in reply.arrays.items()}
    return reply


def trained_on(trainer: ClientTrainer) -> str | None:
    """The device a trainer trains on, as a string for the records (``None`` for a trainer that
    has none, e.g. a test's)."""
    device = getattr(trainer, "device", None)
    return None if device is None else str(device)


class ClientTransport(ABC):
    """Carries one round's payloads to the selected clients and their replies back.

    Attributes:
        client_devices: client id -> the device its last reply says it trained on (what the
            run's summary reports as ``client_devices``).
    """

    client_devices: dict[int, str]

    @property
    @abstractmethod
    def num_clients(self) -> int:
        """How many clients the federation has (client ids are ``0 .. num_clients - 1``)."""

    @abstractmethod
    def fit_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        """Run ``fit`` on every client of ``payloads``.

        Returns:
            Per client id, its :class:`Reply`, or a one-line reason why there is none (the
            client raised, its node was lost, it timed out); the engine drops those clients.
        """

    @abstractmethod
    def evaluate_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        """Have every client of ``payloads`` score the models it received on its own id-holdout
        share (:class:`~fedbed.federation.client_evaluation.ClientEvaluator`).

        Returns:
            Per client id, its reply (statistics as metrics) or a one-line reason why there is none.
        """

    def state_dict(self) -> Any:
        """The clients' persistent states for a checkpoint, or ``None`` where they live on the
        clients' own machines."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what :meth:`state_dict` returned."""


@dataclass
class InProcessClients(ClientTransport):
    """Every client in this process, one after another.

    Attributes:
        trainer: the client half of the method (one instance, reused by every client).
        data: training data per client id (index = client id): views of the dataset's images
            (:meth:`ClientData.from_dataset`), so a thousand clients hold indices, not images.
        states: the persistent per-client states (see :meth:`ClientTrainer.fit`), checkpointed:
            kept only for clients whose method has one, in files in the run folder for many
            clients (:class:`~fedbed.federation.client_states.ClientStates`; default: in memory).
        evaluator: the client half of id evaluation on clients (``None``: the server evaluates).
        holdouts: each client's id-holdout share, for ``evaluator``.
    """

    trainer: ClientTrainer
    data: list[ClientData]
    states: ClientStates | None = None
    evaluator: ClientEvaluator | None = None
    holdouts: list[ClientData] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.states is None:
            self.states = ClientStates(len(self.data))
        self.client_devices = {}

    @property
    def num_clients(self) -> int:
        return len(self.data)

    def fit_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        """Fit the clients one after another; each gets :func:`handed_to_trainer` of its payload.

        A client that edited a tensor of its payload in place is dropped with the reason and the
        tensor is put back before the next client fits (:class:`PayloadSnapshot`); a reply array
        that shares memory with a payload tensor is replaced by a copy (:func:`unshared_reply`).
        """
        snapshot = PayloadSnapshot(payloads.values())
        outcomes: dict[int, Reply | str] = {}
        for client, payload in payloads.items():
            state = self.states[client]
            try:
                outcome: Reply | str = fit_client(self.trainer, handed_to_trainer(payload), self.data[client], state)
            except Exception as error:  # a failing client is dropped from the round, never fatal
                outcome = f"raised {type(error).__name__}: {error}"
            self.states.keep(client, state)
            edited = snapshot.restore_edits(payload)
            if edited is not None:
                outcome = edited if isinstance(outcome, Reply) else f"{outcome}; it also {edited}"
            outcomes[client] = unshared_reply(outcome, payload) if isinstance(outcome, Reply) else outcome
            if isinstance(outcome, Reply) and trained_on(self.trainer) is not None:
                self.client_devices[client] = trained_on(self.trainer)
        return outcomes

    def evaluate_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        if self.evaluator is None:
            return {client: "this run evaluates on the server (no client evaluator)" for client in payloads}
        outcomes: dict[int, Reply | str] = {}
        for client, payload in payloads.items():
            try:
                outcomes[client] = self.evaluator.evaluate(payload, self.holdouts[client])
            except Exception as error:  # a failing client leaves its domains unscored, never fatal
                outcomes[client] = f"raised {type(error).__name__}: {error}"
        return outcomes

    def state_dict(self) -> list[dict[str, Any]] | dict[str, Any]:
        return self.states.state_dict()

    def load_state_dict(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        self.states.load_state_dict(state)
