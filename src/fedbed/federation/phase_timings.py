"""Where a run's time goes, process by process: opt-in timing records for benchmarks.

When the environment variable :data:`TIMINGS_VARIABLE` names a file, every FedBed process of a
run (this one, and on Flower the ServerApp, the ClientApps and the processes that host them, which
inherit the environment) appends one JSON line per timed phase to it; otherwise nothing is timed
or written. The records change nothing of a run: they are read by
``benchmarks/flower_vs_inprocess.py``, which splits a run's time into process start, data build,
model build, training and messaging.

A record is ``{"phase", "seconds", "began", "pid", "role", ...details}``: ``began`` in seconds
since the epoch, ``seconds`` of wall-clock time, ``role`` ``launcher`` / ``server`` / ``client`` (or
``None``).
The phases FedBed records (:data:`PHASES`):

- ``process_start``: once per process that serves a run (the launcher, and on Flower the
  ServerApp's and the ClientApps' processes), from its creation (the operating system's record of
  it) until FedBed's code first ran in it: ``seconds`` of wall-clock time (for a process that
  waited in a pool, its wait too) and ``cpu_seconds``, the processor time it spent by then
  (interpreter, imports, Flower's and Ray's own set-up); read on Linux only (``/proc``), not
  recorded elsewhere.
- ``data``: building a run's data (reading the dataset, split and partitions) or a client's share of it.
- ``model``: building a run's initial model, or a client's trainer.
- ``training``: one client's local training for one round (:func:`fedbed.federation.transport.fit_client`).
- ``handling``: a ClientApp handling one message, from its arrival in FedBed's code to its reply
  (details ``message_id``, ``message_type``).
- ``exchange``: on the server, one message from its push to its reply's arrival (details
  ``message_id``, ``message_type``, ``client``); minus its ``handling`` (and the start of a process
  started for it), what it spent in transit and in queues.
- ``federation_start``: starting the SuperLink and the SuperNodes of a local Flower federation.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TIMINGS_VARIABLE = "FEDBED_TIMINGS"
"""The environment variable naming the JSON-lines file the timing records are appended to."""

PHASES = ("process_start", "data", "model", "training", "handling", "exchange", "federation_start")
"""The phases FedBed records (see the module docstring)."""

_process_start_recorded = False


def timings_file() -> Path | None:
    """The file the records go to (:data:`TIMINGS_VARIABLE`), or ``None`` when timing is off."""
    value = os.environ.get(TIMINGS_VARIABLE)
    return Path(value) if value else None


def record(phase: str, seconds: float, began: float | None = None, role: str | None = None, **details: Any) -> None:
    """Append one record (when timing is on; nothing otherwise).

    Args:
        phase: one of :data:`PHASES`.
        seconds: its wall-clock duration.
        began: when it began, seconds since the epoch (default: now minus ``seconds``).
        role: ``server`` or ``client``.
        details: further JSON values (a client id, a message id).
    """
    path = timings_file()
    if path is None:
        return
    entry = {"phase": phase, "seconds": float(seconds), "began": time.time() - seconds if began is None else float(began),
             "pid": os.getpid(), "role": role, **details}
    # One write of one line to a file opened for appending: lines of concurrent processes do not interleave.
    with path.open("a") as timings:
        timings.write(json.dumps(entry, default=str) + "\n")


@contextlib.contextmanager
def timed(phase: str, role: str | None = None, **details: Any) -> Iterator[None]:
    """Record the wall-clock time of the ``with`` block as ``phase`` (when timing is on), also
    when it raises."""
    if timings_file() is None:
        yield
        return
    began, started = time.time(), time.perf_counter()
    try:
        yield
    finally:
        record(phase, time.perf_counter() - started, began, role, **details)


def process_created_at() -> float | None:
    """When this process was created, seconds since the epoch (Linux's ``/proc``; ``None``
    elsewhere or when it cannot be read)."""
    try:
        now = time.time()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        # Field 22 (starttime, clock ticks after boot), the 20th after the command name.
        return now - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def record_process_start(role: str) -> None:
    """Record ``process_start`` for this process, once (when timing is on): call it where FedBed's
    code first runs in a process that Flower started."""
    global _process_start_recorded
    if _process_start_recorded or timings_file() is None:
        return
    _process_start_recorded = True
    created = process_created_at()
    if created is not None:
        times = os.times()
        record("process_start", max(0.0, time.time() - created), created, role, cpu_seconds=times.user + times.system)


def read_timings(path: Path) -> list[dict[str, Any]]:
    """The records of a timings file, in the order written (an empty list if there is none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
