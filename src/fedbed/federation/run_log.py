"""A run's log (``run_dir/rounds.jsonl``, one JSON line per round) and how a round's line and
checkpoint are written in step.

The engine appends one line per round and then writes the checkpoint, both under
:func:`signals_deferred`, so a stop signal never leaves a log that is a round ahead of the
checkpoint (:func:`write_round`). A resumed run keeps the lines of the rounds its checkpoint holds
(:func:`keep_rounds_before`); the summary reads the faults from the log (:func:`fault_summary`);
:func:`round_line` says in one line how a round went.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedbed.federation.checkpoints import save_checkpoint
from fedbed.jsonlog import to_json

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that stop a run (Ctrl-C, ``kill``, a closed terminal; see ``fedbed.cli.stop_on_signals``),
those of them this platform has (Windows has no SIGHUP)."""


def complete_lines(log_path: Path) -> list[str]:
    """The log's lines that parse as JSON (a line cut short by a crash is left out)."""
    lines = []
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            continue
        lines.append(line)
    return lines


def keep_rounds_before(log_path: Path, start: int) -> None:
    """Rewrite the log with only its complete lines of the rounds before ``start`` (a resumed
    run's checkpoint holds rounds ``1 .. start - 1``; later lines are redone)."""
    kept = [line for line in complete_lines(log_path) if json.loads(line)["round"] < start]
    log_path.write_text("".join(line + "\n" for line in kept))


def logged_evaluations(log_path: Path) -> list[dict[str, Any]]:
    """The ``evaluation`` of every evaluated round of the log, in order."""
    evaluations = [json.loads(line)["evaluation"] for line in complete_lines(log_path)]
    return [e for e in evaluations if e is not None]


def fault_summary(log_path: Path) -> dict[str, Any]:
    """What the run's log says about faults, for the summary: ``dropped_replies`` (how many
    replies the engine dropped over the run), ``dropped_by_client`` (client id -> count) and
    ``rounds_keeping_previous_model`` (the rounds whose model did not change, with why)."""
    dropped: dict[str, int] = {}
    kept: dict[str, str] = {}
    for line in complete_lines(log_path):
        record = json.loads(line)
        for client in record.get("dropped", {}):
            dropped[client] = dropped.get(client, 0) + 1
        if record.get("kept_previous_model"):
            kept[str(record["round"])] = record["kept_previous_model"]
    return {"dropped_replies": sum(dropped.values()), "dropped_by_client": dropped, "rounds_keeping_previous_model": kept}


def round_line(record: dict[str, Any], rounds: int) -> str:
    """One line saying how a round went, read from its record (a line of the run's log): the
    training loss, the id and ood accuracy means (percent) when the round was evaluated, the
    clients dropped (from training or evaluation) and why, and a model kept from the round before.
    For logs that show no progress bar, such as a Flower ServerApp's (``flwr log``)."""

    def percent(value: float | None) -> str:
        return "none" if value is None else f"{value:.1f}"

    def reasons(dropped: dict[str, str]) -> str:
        return "; ".join(f"client {client}: {why}" for client, why in sorted(dropped.items(), key=lambda item: int(item[0])))

    parts = [f"round {record['round']}/{rounds}: train loss {record['metrics'].get('train_loss', float('nan')):.3f}"]
    if record.get("evaluation") is not None:
        parts.append(f"id {percent(record['evaluation'].get('id_mean'))}, ood {percent(record['evaluation'].get('ood_mean'))}")
    if record.get("dropped"):
        parts.append(f"dropped {reasons(record['dropped'])}")
    if record.get("evaluation_dropped"):
        parts.append(f"not evaluated on {reasons(record['evaluation_dropped'])}")
    if record.get("kept_previous_model"):
        parts.append(f"kept the previous model: {record['kept_previous_model']}")
    return ", ".join(parts)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back :data:`STOP_SIGNALS` for the duration of the block, then act on the first one
    that arrived, as its handler would have: used around writing a round's log line and
    checkpoint, so a stop never leaves a log that is a round ahead of the checkpoint.

    Only Python-level handlers are deferred (``signal.default_int_handler``, the CLI's
    :func:`fedbed.cli.stop_on_signals` handler, a caller's own); a signal left at ``SIG_DFL`` or
    ``SIG_IGN`` keeps its disposition. Outside the main thread (where Python cannot set handlers)
    the block runs as is.

    Raises:
        whatever the deferred handler raises after the block (``KeyboardInterrupt`` for the CLI).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[tuple[int, Any]] = []
    previous = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    deferred = {number: handler for number, handler in previous.items() if callable(handler)}
    for number in deferred:
        signal.signal(number, lambda signum, frame: arrived.append((signum, frame)))
    try:
        yield
    finally:
        for number, handler in deferred.items():
            signal.signal(number, handler)
    if arrived:
        signum, frame = arrived[0]
        deferred[signum](signum, frame)


def write_round(log_path: Path, checkpoint_path: Path, record: dict[str, Any], strategy: Any, clients: Any) -> None:
    """Append the round's ``record`` to the log, then write the checkpoint of the round
    (:func:`~fedbed.federation.checkpoints.save_checkpoint`), a stop signal meanwhile waiting
    for both (:func:`signals_deferred`)."""
    with signals_deferred():
        with log_path.open("a") as log:
            log.write(to_json(record) + "\n")
        save_checkpoint(checkpoint_path, record["round"], strategy, clients)
