"""A run's checkpoint (``run_dir/checkpoint.pt``): the strategy's state and the clients'
persistent states after a round, written whole or not at all, and read back to resume.

:class:`EngineError` is defined here, beside :func:`load_checkpoint` that raises it, so that this
module needs no import of :mod:`fedbed.federation.engine`; callers import it from the engine.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from fedbed.federation.devices import HOST


class EngineError(RuntimeError):
    """Raised when a run cannot go on (a method that needs every selected client lost one, a
    checkpoint is unusable)."""


def save_checkpoint(path: Path, round_number: int, strategy: Any, clients: Any) -> None:
    """Write ``{"round", "strategy", "client_states"}`` to ``path`` (through ``path.partial`` and
    an atomic rename, so a crash never leaves a half-written checkpoint).

    Args:
        path: the checkpoint file.
        round_number: the round just completed (1-based).
        strategy: the run's :class:`~fedbed.federation.strategy.ServerStrategy`.
        clients: the run's :class:`~fedbed.federation.transport.ClientTransport`.
    """
    partial = path.with_name(path.name + ".partial")
    torch.save(
        {
            "round": round_number,
            "strategy": strategy.state_dict(),
            "client_states": clients.state_dict(),
        },
        partial,
    )
    os.replace(partial, path)


def load_checkpoint(path: Path, strategy, clients=None) -> int:
    """Restore ``strategy`` (and, if given, ``clients``' persistent states) from the checkpoint
    at ``path``; return its round (1-based).

    Raises:
        EngineError: a damaged checkpoint, or one written for another run or another version of
            the method (its arrays do not fit).
    """
    try:
        checkpoint = torch.load(path, map_location=HOST, weights_only=False)
        strategy.load_state_dict(checkpoint["strategy"])
        if clients is not None:
            clients.load_state_dict(checkpoint["client_states"])
        return int(checkpoint["round"])
    except (RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise EngineError(f"{path} does not fit this run ({first_line}); it is damaged or was written by another "
                          "version of the method") from None


def saved_global_model(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The global model's state dict in the checkpoint at ``path`` and the round it was saved
    after (1-based): what a warm start (``init_from``) begins with. Only the model is read,
    never a client's state.

    Raises:
        EngineError: a damaged checkpoint, or one whose method keeps no single global model
            (hFedF's hypernetwork, Local-only's client models).
    """
    try:
        checkpoint = torch.load(path, map_location=HOST, weights_only=False)
        state, round_number = checkpoint["strategy"].get("model"), int(checkpoint["round"])
    except (RuntimeError, KeyError, EOFError, AttributeError, pickle.UnpicklingError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise EngineError(f"{path} cannot be read ({first_line}); it is damaged") from None
    if not isinstance(state, dict):
        raise EngineError(f"{path} holds no global model to start from: its method's server keeps none (a "
                          "hypernetwork, or one model per client)")
    return state, round_number
