"""Results as data: a run (:func:`load_run`) or every run below a folder (:func:`load_sweep`) as
pandas tables, and the results store, every run of a sweep folder indexed in SQLite (built in
memory when read; written to ``results.sqlite`` by :func:`index_runs` for ``fedbed results``).
The finished runs of several folders read as one, labelled together and keyed by (label,
target, seed), a job copied between folders once: :func:`labelled_runs`, what ``fedbed report``
pairs.

Tables:

- ``runs``: one row per run directory — ``run`` (folder name), ``dataset``, ``algorithm``,
  ``label`` (algorithm plus its random-search trial and the values of the hyperparameters the
  sweep varies), ``target``,
  ``seed``, ``hp`` (JSON), ``done`` (0/1), and for each model-selection rule ``<rule>_round``,
  ``<rule>_id`` and ``<rule>_ood`` (``oracle_*`` read the target domain).
- ``rounds``: one row per logged round — ``run``, ``round``, ``train_loss``, ``id_mean``,
  ``ood_mean`` (null where not evaluated), ``conflicting_pairs`` and ``mean_cosine`` (the mean
  pairwise cosine of the client updates, :func:`fedbed.federation.alignment.mean_pairwise_cosine`; both null
  where the round logged no alignment telemetry).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from fedbed.federation.alignment import mean_pairwise_cosine
from fedbed.federation.evaluation import SELECTION_RULES
from fedbed.run_directory import (
    CONFIG_NAME,
    LOG_NAME,
    REMADE_FOLDER,
    STORE_NAME,
    SUMMARY_NAME,
    SWEEP_RECORD,
)
from fedbed.run_result import HISTORY_COLUMNS, ResultsError, load_run, read_log

RUN_COLUMNS = ("run", "dataset", "algorithm", "label", "target", "seed", "hp", "done") + tuple(
    f"{rule}_{field}" for rule in SELECTION_RULES for field in ("round", "id", "ood")
)


def sweep_record(sweep_dir: Path) -> dict[str, Any]:
    """The sweep file recorded in ``sweep_dir`` (``sweep.yaml``) as a mapping; empty without one."""
    record = sweep_dir / SWEEP_RECORD
    return (yaml.safe_load(record.read_text()) or {}) if record.exists() else {}


def varied_hyperparameters(sweep_dir: Path) -> dict[str, list[str]]:
    """Per algorithm, the hyperparameters the sweep file gives more than one value."""
    return {alg: sorted(k for k, v in grid.items() if len(v) > 1)
            for alg, grid in (sweep_record(sweep_dir).get("hp") or {}).items()}


def sweep_variants(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """The named variants of the sweep file recorded in ``sweep_dir`` (none without a record)."""
    return sweep_record(sweep_dir).get("variants") or {}


UNSET = "(unset)"
"""The value :func:`declared_hyperparameters` gives a hyperparameter a sweep file leaves to the
method's default."""


def declared_hyperparameters(record: dict[str, Any], algorithm: str, variant: str | None) -> dict[str, frozenset[str]]:
    """Per hyperparameter a sweep record sets for the runs of ``algorithm`` in ``variant``
    (``None``: the sweep's runs without a variant), the values it gives them as JSON text: its
    ``base``'s ``hp``, the variant's ``hp`` over it, the algorithm's grid last (as
    :func:`fedbed.sweep.expand` builds a job). A hyperparameter left to the default is absent."""
    hp = {**((record.get("base") or {}).get("hp") or {}),
          **(((record.get("variants") or {}).get(variant) or {}).get("hp") or {})}
    declared = {key: frozenset([json.dumps(value, sort_keys=True)]) for key, value in hp.items()}
    for key, values in ((record.get("hp") or {}).get(algorithm) or {}).items():
        declared[key] = frozenset(json.dumps(value, sort_keys=True) for value in values)
    return declared


VARIANT_LIMITS = {"only_algorithms": "algorithm", "only_targets": "target"}
"""Keys of a sweep variant that limit it to some of the sweep's algorithms or targets (not
settings), each with the per-job setting it limits."""


def warm_start_from_sweep(source: Path, named: dict[str, Any]) -> bool:
    """Whether the run folder ``source`` a job started from is the one a sweep file's
    ``init_from: {sweep: FOLDER, algorithm: NAME[, seed: S]}`` names: a folder of that sweep whose
    ``config.yaml`` has that algorithm (and seed). ``False`` when that config cannot be read."""
    if source.parent.resolve() != Path(named.get("sweep", "")).resolve():
        return False
    try:
        config = source.resolve() / CONFIG_NAME
        written = config.stat()
        algorithm, seed = _algorithm_and_seed(config, written.st_mtime_ns, written.st_size)
    except (OSError, yaml.YAMLError):
        return False
    return algorithm == named.get("algorithm") and ("seed" not in named or seed == named["seed"])


@functools.lru_cache(maxsize=1024)
def _algorithm_and_seed(config: Path, modified_ns: int, size: int) -> tuple[Any, Any]:
    """The algorithm and seed a run's ``config.yaml`` records, read once per process however
    many runs and variants of a report name it, and again when the file changes (its modification
    time in ns and its size are part of the key: a run remade with ``--overwrite``). A failed read
    raises, ``OSError`` or ``yaml.YAMLError``, and is not cached."""
    settings = yaml.safe_load(config.read_text()) or {}
    return settings.get("algorithm"), settings.get("seed")


def variant_of(config: dict[str, Any], variants: dict[str, dict[str, Any]]) -> str | None:
    """The name of the variant a run's resolved ``config`` was made by: the one with the most
    settings among those whose every setting (and every ``hp`` value; of a nested setting, every
    key the variant gives) the config holds and whose
    limits (:data:`VARIANT_LIMITS`) admit its algorithm and target; ``None`` when the sweep has no
    variants or none fits."""
    def holds(recorded: Any, value: Any, key: str | None = None) -> bool:
        if key == "init_from" and isinstance(value, dict):  # the sweep form: {sweep, algorithm[, seed]}
            return recorded is not None and warm_start_from_sweep(Path(recorded), value)
        # A nested setting (differential_privacy: {...}) is recorded with its defaults filled in.
        if isinstance(value, dict):
            return isinstance(recorded, dict) and all(holds(recorded.get(k), v) for k, v in value.items())
        return recorded == value

    def fits(settings: dict[str, Any]) -> bool:
        hp = settings.get("hp") or {}
        return (all(config.get(VARIANT_LIMITS[key]) in value if key in VARIANT_LIMITS else holds(config.get(key), value, key)
                    for key, value in settings.items() if key != "hp")
                and all(holds((config.get("hp") or {}).get(key), value) for key, value in hp.items()))

    def size(settings: dict[str, Any]) -> int:
        return len(settings) - ("hp" in settings) + len(settings.get("hp") or {})

    fitting = [(size(settings), name) for name, settings in variants.items() if fits(settings)]
    return max(fitting)[1] if fitting else None


def run_label(algorithm: str, hp: dict[str, Any], varied: list[str], variant: str | None = None,
              init_from: dict[str, Any] | None = None, trial: str | None = None) -> str:
    """``algorithm``, with ``[variant]`` for a sweep's named variant, ``{from METHOD@ROUND}`` for a
    warm start (the summary's ``init_from``) and ``(trial=T, key=value, ...)`` for a random
    search's trial (``trial``: :func:`search_trial`) and the hyperparameters its grid varies."""
    label = algorithm if variant is None else f"{algorithm}[{variant}]"
    if init_from is not None:
        label += f"{{from {init_from.get('algorithm')}@{init_from.get('round')}}}"
    parts = ([] if trial is None else [trial]) + [f"{k}={hp.get(k)}" for k in varied]
    return f"{label}(" + ", ".join(parts) + ")" if parts else label


def search_trial(record: dict[str, Any]) -> str | None:
    """The random-search trial a run is, as its label shows it: ``trial=T``, and ``trial=T,
    draws=common`` for a trial of common draws (its ``hparams_trial``, recorded in ``config.yaml``
    and ``summary.json``: :class:`fedbed.algorithms.base.search_space.HyperparameterTrial`), or
    ``None`` for a run outside a search."""
    trial = record.get("hparams_trial") or {}
    if "trial" not in trial:
        return None
    return f"trial={trial['trial']}" + (f", draws={trial['draws']}" if trial.get("draws") else "")


def as_folders(sweep_dirs: Path | str | Sequence[Path | str]) -> list[Path]:
    """One folder or several as a list of paths, in the given order."""
    return [Path(sweep_dirs)] if isinstance(sweep_dirs, (str, Path)) else [Path(folder) for folder in sweep_dirs]


@dataclass(frozen=True)
class FinishedRun:
    """A run that wrote its summary, found below one of a report's folders.

    Attributes:
        path: the run folder (its name is the job's hash in a sweep folder).
        sweep_dir: the folder it was found below.
        summary: ``summary.json``; :func:`labelled_runs` adds ``label`` and ``group``.
        config: ``config.yaml`` (empty without one).
    """

    path: Path
    sweep_dir: Path
    summary: dict[str, Any]
    config: dict[str, Any]


def _same_record(a: Path, b: Path) -> bool:
    """Whether two run folders hold the same job with the same record: one folder name (the
    job's hash), equal summaries and byte-equal logs."""
    def log(path: Path) -> bytes:
        return (path / LOG_NAME).read_bytes() if (path / LOG_NAME).exists() else b""

    return (a.name == b.name and json.loads((a / SUMMARY_NAME).read_text()) == json.loads((b / SUMMARY_NAME).read_text())
            and log(a) == log(b))


def finished_runs(sweep_dirs: Path | Sequence[Path]) -> list[FinishedRun]:
    """Every finished run (a folder with ``summary.json``) below one or more folders, in the
    folders' order and by path within each. A job found in several folders with the same record
    (copies: the same folder name, that is job hash, equal ``summary.json`` and byte-equal
    ``rounds.jsonl``) is kept once, from the first folder; nothing is written."""
    runs: list[FinishedRun] = []
    seen: dict[str, list[Path]] = {}
    for folder in as_folders(sweep_dirs):
        for path in files_below(folder, SUMMARY_NAME):
            run_dir = path.parent
            if any(_same_record(other, run_dir) for other in seen.get(run_dir.name, [])):
                continue
            seen.setdefault(run_dir.name, []).append(run_dir)
            config = (yaml.safe_load((run_dir / CONFIG_NAME).read_text()) or {}) if (run_dir / CONFIG_NAME).exists() else {}
            runs.append(FinishedRun(run_dir, folder, json.loads(path.read_text()), config))
    return runs


def files_below(folder: Path, name: str) -> list[Path]:
    """Every run file called ``name`` below ``folder``, sorted by path, except the re-runs in a
    sweep's :data:`~fedbed.run_directory.REMADE_FOLDER` (``fedbed sweep --remake-checkpoints``),
    which are not the sweep's runs."""
    return [path for path in sorted(folder.rglob(name)) if REMADE_FOLDER not in path.relative_to(folder).parts[:-1]]


def unfinished_runs(sweep_dirs: Path | Sequence[Path], targets: Sequence[str] = (),
                    seeds: Sequence[int] = ()) -> list[Path]:
    """The run folders below the folders that have settings (``config.yaml``) but no summary yet:
    running, interrupted or failed jobs, which reports and plots leave out; only those of
    ``targets`` and ``seeds`` when given (a report of some targets or seeds does not leave out
    the others' runs)."""

    def shown(config_path: Path) -> bool:
        if not targets and not seeds:
            return True
        settings = yaml.safe_load(config_path.read_text()) or {}
        return ((not targets or str(settings.get("target")) in targets)
                and (not seeds or settings.get("seed") in seeds))

    return [path.parent for folder in as_folders(sweep_dirs) for path in files_below(folder, CONFIG_NAME)
            if not (path.parent / SUMMARY_NAME).exists() and shown(path)]


def labelled_runs(sweep_dirs: Path | Sequence[Path]) -> list[FinishedRun]:
    """:func:`finished_runs`, each summary with a ``label`` (:func:`run_label`) and a ``group``
    (the label without hyperparameters): the algorithm, its sweep variant, its random-search trial
    and the values of the hyperparameters that vary. Over one folder these are the ones its sweep file's grid varies,
    as ``fedbed results`` labels them. Over several, a method's (and variant's) runs from folders
    whose sweep records set a hyperparameter differently (:func:`declared_hyperparameters`; e.g.
    ``augmentation: amplitude_mix`` in one, the default in the other) also name its value, so the
    labels tell the folders' runs apart and equal labels pair across folders.

    Raises:
        ResultsError: two different runs with one label, target and seed (other settings under
            one label, or the same job with other results), naming both folders: the pairing
            would be ambiguous.
    """
    runs = finished_runs(sweep_dirs)
    folders = list(dict.fromkeys(run.sweep_dir for run in runs))
    records = {folder: sweep_record(folder) for folder in folders}
    varied = {folder: varied_hyperparameters(folder) for folder in folders}
    variants = {folder: sweep_variants(folder) for folder in folders}
    variant = {run.path: variant_of(run.config, variants[run.sweep_dir]) for run in runs}
    declared: dict[tuple[str, str | None], dict[Path, dict[str, frozenset[str]]]] = {}
    for run in runs:
        group = (run.summary["algorithm"], variant[run.path])
        declared.setdefault(group, {})[run.sweep_dir] = declared_hyperparameters(records[run.sweep_dir], *group)
    across: dict[tuple[str, str | None], set[str]] = {}
    for group, by_folder in declared.items():
        keys = set().union(*by_folder.values())
        across[group] = {key for key in keys
                         if len({values.get(key, frozenset([UNSET])) for values in by_folder.values()}) > 1}
    owners: dict[tuple[str, str, Any], FinishedRun] = {}
    for run in runs:
        algorithm, name = run.summary["algorithm"], variant[run.path]
        keys = sorted(set(varied[run.sweep_dir].get(algorithm, [])) | across[(algorithm, name)])
        warm = run.summary.get("init_from")
        run.summary["label"] = run_label(algorithm, run.summary.get("hp", {}), keys, name, warm, search_trial(run.summary))
        run.summary["group"] = run_label(algorithm, {}, [], name, warm)
        key = (run.summary["label"], run.summary["target"], run.summary["seed"])
        if key in owners:
            other = owners[key].path
            why = ("the same job with other results" if other.name == run.path.name
                   else f"other settings: job hashes {other.name} and {run.path.name}")
            raise ResultsError(f"{other} and {run.path} are both {key[0]}, target {key[1]}, seed {key[2]} but differ "
                               f"({why}); report their folders separately or remove one")
        owners[key] = run
    return runs


ROUND_COLUMNS = ("round", "train_loss", "id_mean", "ood_mean", "conflicting_pairs", "mean_cosine")
"""The columns of :func:`round_rows`, in the ``rounds`` table's order after ``run``."""


def round_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per logged round of a run (the ``rounds`` columns but ``run``): ``round``,
    ``train_loss``, ``id_mean``, ``ood_mean`` (``None`` where not evaluated), ``conflicting_pairs``
    and ``mean_cosine`` (``None`` where the round logged no alignment telemetry)."""
    rows = []
    for record in read_log(run_dir):
        evaluation = record.get("evaluation") or {}
        alignment = record.get("alignment") or {}
        rows.append({"round": record["round"], "train_loss": (record.get("metrics") or {}).get("train_loss"),
                     "id_mean": evaluation.get("id_mean"), "ood_mean": evaluation.get("ood_mean"),
                     "conflicting_pairs": alignment.get("conflicting_pairs"), "mean_cosine": logged_mean_cosine(alignment)})
    return rows


def logged_mean_cosine(alignment: dict[str, Any]) -> float | None:
    """The mean pairwise cosine (:func:`fedbed.federation.alignment.mean_pairwise_cosine`) of a round's logged
    ``alignment`` record; ``None`` without a cosine matrix, for a single client, or where an entry
    is null (a non-finite cosine of a diverged update, see :mod:`fedbed.jsonlog`)."""
    cosine = alignment.get("cosine")
    if not cosine or any(value is None for row in cosine for value in row):
        return None
    return mean_pairwise_cosine(torch.tensor(cosine, dtype=torch.float64))


def _fill_store(db: sqlite3.Connection, sweep_dir: Path) -> None:
    """Create and fill the ``runs`` and ``rounds`` tables from every run directory below ``sweep_dir``.

    Raises:
        ResultsError: if no run directory (a folder with ``config.yaml``) is found.
    """
    configs = files_below(sweep_dir, CONFIG_NAME)
    if not configs:
        raise ResultsError(f"{sweep_dir} holds no FedBed run (no {CONFIG_NAME} below it)")
    varied, variants = varied_hyperparameters(sweep_dir), sweep_variants(sweep_dir)
    db.execute(f"CREATE TABLE runs ({', '.join(RUN_COLUMNS)})")
    db.execute(f"CREATE TABLE rounds (run, {', '.join(ROUND_COLUMNS)})")
    for config_path in configs:
        run_dir = config_path.parent
        name = run_dir.relative_to(sweep_dir).as_posix()
        config = yaml.safe_load(config_path.read_text())
        summary = json.loads((run_dir / SUMMARY_NAME).read_text()) if (run_dir / SUMMARY_NAME).exists() else None
        row: dict[str, Any] = {
            "run": name,
            "dataset": config["dataset"],
            "algorithm": config["algorithm"],
            "label": run_label(config["algorithm"], config.get("hp", {}), varied.get(config["algorithm"], []),
                               variant_of(config, variants), trial=search_trial(config)),
            "target": config["target"],
            "seed": config["seed"],
            "hp": json.dumps(config.get("hp", {}), sort_keys=True),
            "done": int(summary is not None),
        }
        for rule in SELECTION_RULES:
            chosen = summary["selection"][rule] if summary else {}
            row.update({f"{rule}_round": chosen.get("round"), f"{rule}_id": chosen.get("id_mean"), f"{rule}_ood": chosen.get("ood_mean")})
        db.execute(f"INSERT INTO runs VALUES ({', '.join('?' for _ in RUN_COLUMNS)})", [row[c] for c in RUN_COLUMNS])
        for rounds in round_rows(run_dir):
            db.execute("INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?)", (name, *(rounds[c] for c in ROUND_COLUMNS)))


def index_runs(sweep_dir: Path) -> Path:
    """(Re)build ``sweep_dir/results.sqlite`` from every run directory below ``sweep_dir``: the
    store ``fedbed results`` writes for SQL users. Reading results (:func:`query_runs`,
    :func:`query_rounds`, :func:`load_run`, :func:`load_sweep`) writes nothing.

    Returns:
        The path of the store.

    Raises:
        ResultsError: if no run directory (a folder with ``config.yaml``) is found.
    """
    store = sweep_dir / STORE_NAME
    partial = store.with_name(store.name + ".partial")
    partial.unlink(missing_ok=True)
    with sqlite3.connect(partial) as db:
        _fill_store(db, sweep_dir)
    partial.replace(store)
    return store


def _memory_store(sweep_dir: Path) -> sqlite3.Connection:
    """The store of :func:`index_runs` built in memory (nothing written)."""
    db = sqlite3.connect(":memory:")
    _fill_store(db, sweep_dir)
    db.row_factory = sqlite3.Row
    return db


def query_runs(sweep_dir: Path, where: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows of the ``runs`` table (built in memory), filtered by ``column = value`` pairs.

    Raises:
        ResultsError: an unknown column in ``where``, or no run below ``sweep_dir``.
    """
    where = where or {}
    unknown = sorted(set(where) - set(RUN_COLUMNS))
    if unknown:
        raise ResultsError(f"unknown column(s) {', '.join(unknown)} in --where; columns: {', '.join(RUN_COLUMNS)}")
    clause = " AND ".join(f"CAST({column} AS TEXT) = ?" for column in where)
    sql = "SELECT * FROM runs" + (f" WHERE {clause}" if clause else "") + " ORDER BY algorithm, label, target, seed"
    with contextlib.closing(_memory_store(sweep_dir)) as db:
        return [dict(row) for row in db.execute(sql, list(where.values()))]


def query_rounds(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every row of the ``rounds`` table (built in memory) joined with its run's label, target and seed."""
    with contextlib.closing(_memory_store(sweep_dir)) as db:
        rows = db.execute(
            "SELECT runs.label, runs.target, runs.seed, rounds.* FROM rounds JOIN runs ON rounds.run = runs.run "
            "ORDER BY runs.label, runs.target, runs.seed, rounds.round"
        )
        return [dict(row) for row in rows]


@dataclass(frozen=True)
class SweepResult:
    """Every run below a folder as data (:func:`load_sweep`).

    Attributes:
        runs: one row per run (the ``runs`` columns of :data:`RUN_COLUMNS`, plus
            ``data_source`` and ``data_fingerprint``), a ``pandas.DataFrame``.
        history: every run's :func:`evaluation_history` with its ``run``, ``label``, ``target``
            and ``seed``, a ``pandas.DataFrame``.
    """

    runs: Any
    history: Any


def load_sweep(sweep_dir: Path) -> SweepResult:
    """Read every run below ``sweep_dir`` (labelled as ``fedbed results`` labels them); nothing is written.

    Raises:
        ResultsError: no run below ``sweep_dir``.
    """
    import pandas

    sweep_dir = Path(sweep_dir)
    runs = pandas.DataFrame(query_runs(sweep_dir), columns=list(RUN_COLUMNS))
    tables, sources = [], []
    for run in runs.itertuples():
        result = load_run(sweep_dir / run.run)
        sources.append((result.summary.get("data_source"), result.summary.get("data_fingerprint")))
        tables.append(result.history.assign(run=run.run, label=run.label, target=run.target, seed=run.seed))
    runs["data_source"] = [source for source, _ in sources]
    runs["data_fingerprint"] = [fingerprint for _, fingerprint in sources]
    history = pandas.concat(tables, ignore_index=True) if tables else pandas.DataFrame(
        columns=["run", "label", "target", "seed", *HISTORY_COLUMNS])
    return SweepResult(runs, history)
