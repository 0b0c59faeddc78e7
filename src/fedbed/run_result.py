"""A finished (or running) run as data: its settings, its summary and its per-round, per-domain
scores as a ``pandas.DataFrame``, read from its run folder without writing anything. What
:func:`fedbed.experiment.run_experiment` returns; :func:`fedbed.results.load_sweep` reads many."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedbed.run_directory import CONFIG_NAME, LOG_NAME, SUMMARY_NAME


class ResultsError(ValueError):
    """Raised for a folder that holds no run, or a bad ``--where`` filter."""


TIMING_KEYS = ("seconds", "evaluation_seconds")
"""The keys of a round's record that measure wall-clock time (seconds); the telemetry of a
server that generates the clients' models adds ``server_seconds`` (:func:`without_timings`)."""


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    """A round's record without its wall-clock times (:data:`TIMING_KEYS` and the telemetry's
    ``server_seconds``): what two runs of one job with the same code, torch threads and CPU
    instruction set write alike."""
    kept = {key: value for key, value in record.items() if key not in TIMING_KEYS}
    if isinstance(kept.get("telemetry"), dict) and "server_seconds" in kept["telemetry"]:
        kept["telemetry"] = {key: value for key, value in kept["telemetry"].items() if key != "server_seconds"}
    return kept


MEASUREMENT_KEYS = ("alignment",)
"""The keys of a round's record that measure the clients' updates and feed nothing back into
training: the engine's alignment telemetry (cosines, update norms). Its arithmetic changed on
2026-11-27 (from stacked updates to the Gram matrix, :func:`fedbed.federation.alignment.update_gram_matrix`),
so a record made before then and a re-run now agree in it to about 1e-13, not bit for bit
(:data:`MEASUREMENT_TOLERANCE`)."""

MEASUREMENT_TOLERANCE = 1e-9
"""Relative (and, near zero, absolute) tolerance within which :func:`first_differing_round`
may accept :data:`MEASUREMENT_KEYS`: far above the 1e-13 that reordered float64 sums move them,
far below any change of the trained model, whose losses and accuracies are compared exactly."""


def _values_close(mine: Any, theirs: Any, tolerance: float) -> bool:
    """Two JSON values equal in structure, with their floats equal within ``tolerance``
    (relative, or absolute near zero)."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return mine.keys() == theirs.keys() and all(_values_close(mine[key], theirs[key], tolerance) for key in mine)
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(_values_close(a, b, tolerance) for a, b in zip(mine, theirs))
    if isinstance(mine, float) and isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        return mine == theirs or math.isclose(mine, theirs, rel_tol=tolerance, abs_tol=tolerance)
    return mine == theirs


def first_differing_round(run_dir: Path, other: Path, measurement_tolerance: float = 0.0) -> int | None:
    """The round number of the first record that differs between two runs' ``rounds.jsonl``,
    wall-clock times aside (:func:`without_timings`), or ``None`` when the logs are equal record
    for record; where one log is shorter, the first round it lacks (1 for an empty log).

    Args:
        measurement_tolerance: how far :data:`MEASUREMENT_KEYS` may differ (relative; absolute
            near zero), e.g. :data:`MEASUREMENT_TOLERANCE` for a record made before their
            arithmetic changed. Everything else is compared exactly. 0 (the default): exactly.
    """
    mine, theirs = read_log(run_dir), read_log(other)
    for index in range(max(len(mine), len(theirs))):
        if index >= len(mine) or index >= len(theirs):
            longer = mine if index < len(mine) else theirs
            return longer[index].get("round", index + 1)
        first, second = without_timings(mine[index]), without_timings(theirs[index])
        measured = [(first.pop(key, None), second.pop(key, None)) for key in MEASUREMENT_KEYS]
        if first != second or not all(_values_close(a, b, measurement_tolerance) for a, b in measured):
            return mine[index].get("round", index + 1)
    return None


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s ``rounds.jsonl`` (none if it has no log yet)."""
    log = run_dir / LOG_NAME
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


HISTORY_COLUMNS = ("round", "kind", "domain", "score", "metric")
"""Columns of a run's history: per evaluated round, one row per domain and kind (``id``: a
source domain's holdout; ``ood``: the target), ``score`` in the run's ``metric`` (accuracy in %,
or Pearson's r)."""


def evaluation_history(records: list[dict[str, Any]]) -> "pandas.DataFrame":
    """The per-round, per-domain scores of a run's log records as a tidy table (:data:`HISTORY_COLUMNS`)."""
    import pandas

    rows = [{"round": record["round"], "kind": kind, "domain": domain, "score": score,
             "metric": record["evaluation"].get("metric", "accuracy")}
            for record in records if record.get("evaluation")
            for kind in ("id", "ood") for domain, score in (record["evaluation"].get(kind) or {}).items()]
    return pandas.DataFrame(rows, columns=list(HISTORY_COLUMNS))


@dataclass(frozen=True)
class RunResult(Mapping):
    """One run as data: what :func:`fedbed.experiment.run_experiment` returns and :func:`load_run` reads.

    It is also the run's summary as a read-only mapping (``result["selection"]``, as
    ``summary.json``), so code written for the summary dict keeps working.

    Attributes:
        run_dir: the run folder.
        config: the resolved settings (``config.yaml``).
        summary: ``summary.json`` (empty while the run is unfinished).
        history: per evaluated round and domain, the score (:func:`evaluation_history`).
        records: the raw ``rounds.jsonl`` records (telemetry included).
    """

    run_dir: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    history: Any
    records: list[dict[str, Any]] = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self):
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)

    @property
    def finished(self) -> bool:
        """Whether the run wrote its summary."""
        return bool(self.summary)


def load_run(run_dir: Path) -> RunResult:
    """Read a run folder into a :class:`RunResult`; nothing is written.

    Raises:
        ResultsError: the folder holds no FedBed run (no ``config.yaml``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_NAME).is_file():
        raise ResultsError(f"{run_dir} holds no FedBed run (no {CONFIG_NAME})")
    summary_path = run_dir / SUMMARY_NAME
    records = read_log(run_dir)
    return RunResult(run_dir, yaml.safe_load((run_dir / CONFIG_NAME).read_text()) or {},
                     json.loads(summary_path.read_text()) if summary_path.is_file() else {},
                     evaluation_history(records), records)
