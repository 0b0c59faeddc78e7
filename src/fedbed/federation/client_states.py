"""The persistent states of the clients that run in this process: kept only where a method has
one, and on disk in the run folder when there are many clients.

A method's trainer may keep a per-client state between rounds (FedEMA's own model, FedADG's
discriminator, FedSR's prior, the self-supervised methods' queues; see
:meth:`fedbed.federation.strategy.ClientTrainer.fit`); FedAvg's keeps none (unless its
``client_optimizer_state`` is ``kept``: then its optimiser's buffers). :class:`ClientStates`
holds them for :class:`fedbed.federation.transport.InProcessClients`:

- A client whose state is empty after its fit has nothing kept: a method without client state
  costs nothing per client, however many clients the run has.
- Up to :data:`SPILL_ABOVE_CLIENTS` clients, the states stay in memory and the checkpoint holds
  them (a list with one dict per client, the layout of every earlier checkpoint).
- With more clients (and a folder given: the run's :data:`~fedbed.run_directory.CLIENT_STATES_FOLDER`),
  each state lives in its own file, ``<client>-<version>.pt``, read before the client's fit and
  written after it; memory then holds only the states of the clients training this round, and the
  checkpoint holds only the names of the files (the index), so writing it does not grow with the
  clients either. A new state goes to a new file; the file the last checkpoint names is deleted
  only once a later checkpoint is written (at the next :meth:`ClientStates.state_dict`: the engine
  goes on only after a checkpoint is on disk), so the checkpoint on disk always names files that
  exist and hold the states of its round. Resuming (:meth:`ClientStates.load_state_dict`) deletes
  the files the checkpoint does not name (written by a round that did not finish), so a resumed
  run equals an uninterrupted one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fedbed.federation.checkpoints import EngineError
from fedbed.federation.devices import HOST

SPILL_ABOVE_CLIENTS = 64
"""Above this many clients, :class:`ClientStates` keeps the states in files (FedBed's choice:
the one-client-per-domain and λ-mix runs of the papers, 3 to 20 clients, keep them in memory as
before; 100 clients of FedEMA's ResNet-18 would hold 4.5 GB)."""


class ClientStates(Sequence[dict[str, Any]]):
    """Every client's persistent state, by client id (a read-only sequence of dicts; see the module).

    Args:
        num_clients: the run's clients (ids ``0 .. num_clients - 1``).
        folder: where the states go when there are more than ``spill_above`` clients (created on
            the first write); ``None``: always in memory.
        spill_above: the number of clients above which the states go to ``folder``
            (default :data:`SPILL_ABOVE_CLIENTS`).
    """

    def __init__(self, num_clients: int, folder: Path | None = None, spill_above: int | None = None) -> None:
        self._num_clients = num_clients
        self._home = folder
        limit = SPILL_ABOVE_CLIENTS if spill_above is None else spill_above
        self.folder = folder if folder is not None and num_clients > limit else None
        self._memory: dict[int, dict[str, Any]] = {}
        self._files: dict[int, str] = {}
        self._committed: dict[int, str] = {}  # the files the last state_dict() named
        self._obsolete: list[str] = []  # named by the checkpoint before the last, by none since
        self._next_version = 0

    @property
    def spilled(self) -> bool:
        """Whether the states live in files (more clients than the threshold, a folder given)."""
        return self.folder is not None

    def __len__(self) -> int:
        return self._num_clients

    def __getitem__(self, client: int) -> dict[str, Any]:  # type: ignore[override]
        """Client ``client``'s state: in memory, the dict itself; in files, a dict read from its
        file (a fresh one each time; give it back with :meth:`keep`); ``{}`` when it has none.

        Raises:
            IndexError: no such client.
        """
        if not 0 <= client < self._num_clients:
            raise IndexError(f"client {client} is not one of the run's {self._num_clients} clients")
        if not self.spilled:
            return self._memory.get(client, {})
        name = self._files.get(client)
        return {} if name is None else torch.load(self.folder / name, map_location=HOST, weights_only=False)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[client] for client in range(self._num_clients))

    def keep(self, client: int, state: dict[str, Any]) -> None:
        """Keep ``state`` as client ``client``'s state after its fit: nothing when it is empty
        (a method without client state); in files, written to a new file through a temporary one
        and an atomic rename, the client's previous file deleted unless a checkpoint names it."""
        if not self.spilled:
            if state:
                self._memory[client] = state
            else:
                self._memory.pop(client, None)
            return
        previous = self._files.pop(client, None)
        if state:
            name = f"{client}-{self._next_version}.pt"
            self._next_version += 1
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / (name + ".partial")
            torch.save(state, partial)
            os.replace(partial, self.folder / name)
            self._files[client] = name
        if previous is not None and previous != self._committed.get(client):
            (self.folder / previous).unlink(missing_ok=True)  # written since the last checkpoint: no one names it

    def state_dict(self) -> list[dict[str, Any]] | dict[str, Any]:
        """What the checkpoint holds: in memory, one dict per client (``{}`` for a client
        without state); in files, ``{"files": {client id (str): file name}, "next_version": int}``.
        In files, the files that the checkpoint before the previous one named, and no later one,
        are deleted now: the previous checkpoint, which replaced them, has been written."""
        if not self.spilled:
            return [self._memory.get(client, {}) for client in range(self._num_clients)]
        for name in self._obsolete:
            (self.folder / name).unlink(missing_ok=True)
        self._obsolete = [name for client, name in self._committed.items() if self._files.get(client) != name]
        self._committed = dict(self._files)
        return {"files": {str(client): name for client, name in sorted(self._files.items())},
                "next_version": self._next_version}

    def load_state_dict(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (either layout, whichever this store keeps).
        In files, the folder's files that ``state`` does not name (a round that did not finish
        wrote them) are deleted.

        Raises:
            KeyError: a spilled layout without its index.
            EngineError: a file the index names is missing (the checkpoint does not fit the run
                folder), or an index given to a store without a folder.
        """
        if isinstance(state, list):
            states = dict(enumerate(state))
        elif not self.spilled:  # an index, read by a store that keeps its states in memory
            if self._home is None:
                raise EngineError("the checkpoint names files of client states, and no folder to read them from was "
                                  "given")
            states = {int(client): torch.load(self._home / name, map_location=HOST, weights_only=False)
                      for client, name in state["files"].items()}
        else:
            files = {int(client): name for client, name in state["files"].items()}
            missing = [name for name in files.values() if not (self.folder / name).is_file()]
            if missing:
                raise EngineError(f"the client states {', '.join(missing[:3])} that the checkpoint names are missing from "
                                  f"{self.folder}")
            self._files, self._committed, self._obsolete = files, dict(files), []
            self._next_version = int(state["next_version"])
            named = set(files.values())
            for path in self.folder.iterdir() if self.folder.is_dir() else ():
                if path.name not in named:
                    path.unlink()
            return
        self._memory, self._files, self._committed, self._obsolete, self._next_version = {}, {}, {}, [], 0
        if self.spilled and self.folder.is_dir():
            for path in self.folder.iterdir():
                path.unlink()
        for client, client_state in states.items():
            self.keep(client, client_state)
