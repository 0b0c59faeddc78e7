"""One experiment from settings to summary, in this process: the Python API behind ``fedbed run``.

The pieces live in their own modules: the settings in :mod:`fedbed.config`, the run folder's
file names in :mod:`fedbed.run_directory`, building a run in :mod:`fedbed.build`; this module
prepares the run folder and executes a built run (in-process, or over any transport: the Flower
ServerApp calls :func:`execute_run` too). The names users import from here are re-exported.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import yaml

from fedbed.algorithms.options.differential_privacy import privacy_statement
from fedbed.build import BuiltRun, build_run
from fedbed.config import (
    PLACEMENT_SETTINGS,
    RESUMABLE_CHANGES,
    ConfigError,
    ExperimentConfig,
    ValidatedConfig,
    config_from_mapping,
    load_config_file,
    validate,
)
from fedbed.federation.checkpoints import load_checkpoint
from fedbed.federation.client_states import ClientStates
from fedbed.federation.devices import device_description
from fedbed.federation.engine import (
    EngineError,
    Federation,
    run_rounds,
)
from fedbed.federation.evaluation import COLLAPSE_EVALUATIONS, COLLAPSE_SHARE, SELECTION_RULES, collapse_of, select_round
from fedbed.federation.run_log import fault_summary
from fedbed.federation.transport import InProcessClients
from fedbed.jsonlog import to_json
from fedbed.provenance import read_starts, record_start, run_sources
from fedbed.run_directory import (
    CHECKPOINT_NAME,
    CLIENT_STATES_FOLDER,
    CONFIG_NAME,
    FLOWER_LOGS,
    LOG_NAME,
    SUMMARY_NAME,
)
from fedbed.run_result import RunResult, load_run, read_log
from fedbed.tracking import live_tracking, run_identity

__all__ = [
    "BuiltRun",
    "CONFIG_NAME",
    "ConfigError",
    "ExperimentConfig",
    "PLACEMENT_SETTINGS",
    "RESUMABLE_CHANGES",
    "RestoredRun",
    "SUMMARY_NAME",
    "ValidatedConfig",
    "build_run",
    "check_run_dir",
    "config_from_mapping",
    "execute_run",
    "hyperparameter_defaults",
    "load_config_file",
    "prepare_run_dir",
    "recorded_settings",
    "remove_run",
    "restore_run",
    "run_experiment",
    "validate",
]


LISTED_CLIENTS = 12
"""Up to this many clients, a run's first line lists each client's domains; past it, their range."""


def recorded_settings(config: ExperimentConfig, model_name: str, hparams: Any) -> dict[str, Any]:
    """The settings ``config.yaml`` records: ``config`` with the model built and every
    hyperparameter (defaults, the paper's values for the dataset, the user's) filled in."""
    return {**config.model_dump(mode="json"), "model": model_name, "hp": hparams.model_dump(mode="json")}


def hyperparameter_defaults(hparams: Any) -> dict[str, Any]:
    """The defaults of ``hparams``' class as :func:`recorded_settings` records values
    (``{"hp": {name: default}}``, JSON types), for :func:`settings_differences`."""
    return {"hp": type(hparams).model_construct().model_dump(mode="json")}


def settings_differences(run_dir: Path, resolved: dict[str, Any], allowed: frozenset[str],
                         defaults: dict[str, Any] | None = None) -> list[str]:
    """How the run recorded in ``run_dir`` differs from ``resolved`` outside the ``allowed``
    top-level settings, one ``"key: <there> there, <here> here"`` per differing value (empty when
    they agree).

    Nested mappings (``hp``, ``flower``) are compared key by key and named by their dotted path
    (``hp.client_lr: 0.01 there, 0.001 here``). A key the recorded run lacks is a setting added to
    FedBed after it was started; FedBed adds a setting with a default that keeps the old
    behaviour, so the key agrees when its value here is ``None`` or its entry in ``defaults``
    (same nesting as ``resolved``: :func:`hyperparameter_defaults`), and is shown as ``absent``
    otherwise.
    """
    stored = yaml.safe_load((run_dir / CONFIG_NAME).read_text()) if (run_dir / CONFIG_NAME).exists() else {}
    return _differences(stored, resolved, defaults or {}, prefix="", skip=allowed)


_ABSENT = object()
"""A key one side of :func:`_differences` lacks."""


def _differences(there: dict[str, Any], here: dict[str, Any], defaults: dict[str, Any], prefix: str,
                 skip: frozenset[str]) -> list[str]:
    """:func:`settings_differences` below the key path ``prefix``."""
    def shown(value: Any) -> str:
        return "absent" if value is _ABSENT else repr(value)

    lines = []
    for key in sorted(set(there) | set(here)):
        old, new = there.get(key, _ABSENT), here.get(key, _ABSENT)
        if key in skip or there.get(key) == here.get(key) or (old is _ABSENT and key in defaults and new == defaults[key]):
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            below = defaults.get(key) if isinstance(defaults.get(key), dict) else {}
            lines += _differences(old, new, below, prefix=f"{prefix}{key}.", skip=frozenset())
        else:
            lines.append(f"{prefix}{key}: {shown(old)} there, {shown(new)} here")
    return lines


def check_run_dir(run_dir: Path, resolved: dict[str, Any], resume: bool, defaults: dict[str, Any] | None = None) -> None:
    """Whether a run with settings ``resolved`` may use ``run_dir``, checked before anything
    is written or started.

    Without ``resume``: an empty or absent folder, or one holding an unfinished earlier run with
    the same settings (except :data:`PLACEMENT_SETTINGS`), which the run replaces; a finished run
    (its summary written) is never replaced. With ``resume``: a
    folder holding a run whose settings equal ``resolved`` except for
    :data:`RESUMABLE_CHANGES`, with its checkpoint, or without one when it was stopped before its
    first round ended (:func:`prepare_run_dir` then starts it over; a run with finished rounds
    but no checkpoint is refused, never wiped). ``defaults``: :func:`hyperparameter_defaults`,
    the values that agree with a setting the recorded run predates (:func:`settings_differences`).

    Raises:
        ConfigError: a non-empty folder that is not a run, a finished run or an earlier run
            with other settings (never replaced silently: :func:`remove_run` it first,
            ``--overwrite``), or a resumption that cannot continue.
    """
    if resume:
        if not (run_dir / CHECKPOINT_NAME).exists() and not (run_dir / CONFIG_NAME).exists():
            raise ConfigError(f"cannot resume: {run_dir} holds no run to continue ({CHECKPOINT_NAME} does not exist); "
                              "run without --resume")
        changed = settings_differences(run_dir, resolved, RESUMABLE_CHANGES, defaults)
        if changed:
            raise ConfigError(
                f"cannot resume {run_dir}: its settings differ ({'; '.join(changed)}); only "
                f"{', '.join(sorted(RESUMABLE_CHANGES))} may change (or run without --resume)"
            )
        log = run_dir / LOG_NAME
        if not (run_dir / CHECKPOINT_NAME).exists() and ((run_dir / SUMMARY_NAME).exists()
                                                         or (log.exists() and log.read_text().strip())):
            raise ConfigError(f"cannot resume {run_dir}: it finished rounds but its {CHECKPOINT_NAME} is gone, so they "
                              "cannot be continued (its results are kept); pass --overwrite to run it again from round 1, "
                              "or choose another --run-dir")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not holds_a_run(run_dir):
            raise ConfigError(f"{run_dir} is not empty and holds no FedBed run; choose another --run-dir")
        changed = (settings_differences(run_dir, resolved, PLACEMENT_SETTINGS, defaults)
                   if (run_dir / CONFIG_NAME).exists() else [])
        if changed:
            raise ConfigError(f"{run_dir} holds a run with other settings ({'; '.join(changed)}); choose another "
                              "--run-dir, or pass --overwrite to replace it")
        if (run_dir / SUMMARY_NAME).exists():
            raise ConfigError(f"{run_dir} holds a finished run with these settings; pass --overwrite to run it again, "
                              "--resume to continue it to more rounds, or choose another --run-dir")


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a FedBed run: its settings, or the logs a failed Flower run left."""
    return (run_dir / CONFIG_NAME).exists() or (run_dir / FLOWER_LOGS).is_dir()


def remove_run(run_dir: Path) -> None:
    """Delete the FedBed run in ``run_dir`` (``--overwrite``); nothing if the folder is absent.

    Raises:
        ConfigError: a non-empty folder that holds no FedBed run (it is never deleted).
    """
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if not holds_a_run(run_dir):
        raise ConfigError(f"{run_dir} is not empty and holds no FedBed run; choose another --run-dir")
    shutil.rmtree(run_dir)


def prepare_run_dir(run_dir: Path, resolved: dict[str, Any], resume: bool, echo,
                    defaults: dict[str, Any] | None = None) -> bool:
    """Check the run directory (:func:`check_run_dir`) and create it: an unfinished earlier run
    with the same settings is replaced (and the replacement said), a resumed one kept; return
    whether the run resumes (``False`` for ``resume`` of a run stopped before its first
    checkpoint: it starts over, and says so).

    Raises:
        ConfigError: see :func:`check_run_dir`.
    """
    check_run_dir(run_dir, resolved, resume, defaults)
    if resume and not (run_dir / CHECKPOINT_NAME).exists():
        echo(f"nothing to resume in {run_dir}: it stopped before its first round ended; starting it over")
        resume = False
    elif not resume and run_dir.exists() and any(run_dir.iterdir()):
        echo(f"replacing the unfinished earlier run with the same settings in {run_dir} (use --resume to continue it)")
    if not resume:
        remove_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return resume


class RestoredRun(NamedTuple):
    """A finished run rebuilt (:func:`restore_run`): ``built`` (data, split, initial model),
    ``global_model`` (restored from its checkpoint) and ``round`` (the checkpoint's, 1-based)."""

    built: BuiltRun
    global_model: torch.nn.Module
    round: int


def restore_run(run_dir: Path, data_root: Path | None = None) -> RestoredRun:
    """The run a run folder describes, rebuilt from its ``config.yaml`` (the same data, seeded
    split, partitions and initial model), and its global model restored from ``checkpoint.pt``
    (its last completed round).

    Args:
        run_dir: a FedBed run directory that finished a round.
        data_root: where the run's data is, if not where it was trained.

    Raises:
        ConfigError: no ``config.yaml`` or ``checkpoint.pt`` there, data that cannot be
            loaded, or a checkpoint that does not fit the rebuilt run.
    """
    for name in (CONFIG_NAME, CHECKPOINT_NAME):
        if not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir / name} does not exist; give the directory of a FedBed run that finished a round")
    values = yaml.safe_load((run_dir / CONFIG_NAME).read_text())
    if data_root is not None:
        values["data_root"] = str(data_root)
    built = build_run(config_from_mapping(values))
    federation = built.federation(InProcessClients(built.trainer(), []))
    try:
        checkpoint_round = load_checkpoint(run_dir / CHECKPOINT_NAME, federation.strategy)
    except EngineError as error:
        raise ConfigError(str(error)) from None
    return RestoredRun(built, federation.strategy.global_model(), checkpoint_round)


def run_experiment(config: ExperimentConfig | ValidatedConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
                   echo=print) -> RunResult:
    """Train and evaluate one leave-one-domain-out run in this process; write its run directory;
    return it as data (:class:`fedbed.run_result.RunResult`: the settings, the summary, which it
    also is as a mapping, and the per-round, per-domain scores as a ``pandas.DataFrame``).

    An earlier run in the run directory with other settings is refused unless ``overwrite``
    (:func:`check_run_dir`); with ``overwrite`` it is deleted first.

    ``config`` is validated once (:func:`fedbed.config.validate`, by :func:`build_run`), or not
    at all when it is already a :class:`~fedbed.config.ValidatedConfig`
    (:func:`fedbed.backends.run_on_backend` hands one).

    The run directory holds ``config.yaml`` (resolved), ``rounds.jsonl`` (one line per round),
    ``checkpoint.pt`` (latest round), ``provenance.jsonl`` (the code that started and each time
    resumed it, :mod:`fedbed.provenance`) and ``summary.json`` (model selection by ``last``,
    ``train_domain_val`` and ``oracle``, the last labelled as such; ``provenance`` repeats the
    starts; ``data_source`` and ``data_fingerprint`` say which data it read,
    :attr:`fedbed.data.DomainDataset.fingerprint`; ``faults``: the replies dropped and the rounds
    that kept the previous model, :func:`fedbed.federation.run_log.fault_summary`; ``privacy``
    under differential privacy: (ε, δ) after the run's rounds,
    :func:`fedbed.algorithms.options.differential_privacy.privacy_statement`).

    Raises:
        ConfigError: invalid settings (also when the config was built in Python), data that
            cannot be found or read, a model that does not fit, a run directory that cannot be used.
        fedbed.federation.engine.EngineError: a method that needs every selected client lost one.
    """
    built = build_run(config)
    built.require_every_domain()
    run_dir = built.config.resolved_run_dir()
    if overwrite and not resume:
        remove_run(run_dir)
    clients = InProcessClients(built.trainer(), [built.client_data(k) for k in range(len(built.partitions))],
                               ClientStates(len(built.partitions), run_dir / CLIENT_STATES_FOLDER))
    if built.config.id_evaluation == "clients":
        clients.evaluator = built.evaluator()
        clients.holdouts = [data.holdout for data in clients.data]  # the same shares as client_holdout's
    execute_run(built, built.federation(clients), resume=resume, progress=progress, echo=echo)
    return load_run(run_dir)


def execute_run(built: BuiltRun, federation: Federation, *, resume: bool = False, progress: bool = True, echo=print,
                backend: str = "in-process", on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the rounds of a built run over ``federation`` (whatever transport reaches its
    clients), write the run directory and return the summary (see :func:`run_experiment`);
    ``on_round`` is called with each round's record once it is written.

    Raises:
        ConfigError: a run directory that cannot be used or resumed.
        fedbed.federation.engine.EngineError: a method that needs every selected client lost one.
    """
    config, dataset, partitions = built.config, built.dataset, built.partitions
    echo(f"data: {dataset.source}")
    for line in (*dataset.overview(), *dataset.coverage_warnings()):
        echo(line if line.startswith("warning:") else f"data: {line}")
    statement = built.evaluation_statement()
    for key in ("note", "adaptation_note"):
        if key in statement:
            echo(f"evaluation: {statement[key]}")
    run_dir = config.resolved_run_dir()
    resolved = recorded_settings(config, built.model_name, built.hparams)
    resume = prepare_run_dir(run_dir, resolved, resume, echo, hyperparameter_defaults(built.hparams))
    began_on = [start["data_fingerprint"] for start in read_starts(run_dir) if "data_fingerprint" in start] if resume else []
    if began_on and began_on[-1] != dataset.fingerprint:
        raise ConfigError(f"cannot resume {run_dir}: it ran on other data (fingerprint {began_on[-1]}) than this "
                          f"resumption reads ({dataset.source}, fingerprint {dataset.fingerprint}); give the data root it used")
    (run_dir / CONFIG_NAME).write_text(yaml.safe_dump(resolved, sort_keys=False))
    fewest, most = min(len(p.domains) for p in partitions), max(len(p.domains) for p in partitions)
    holding = ([[dataset.domain_names[d] for d in p.domains] for p in partitions] if len(partitions) <= LISTED_CLIENTS
               else f"{fewest if fewest == most else f'{fewest}-{most}'} domain(s) each")
    echo(
        f"{built.algorithm.name} on {dataset.name}, target {config.target}: {len(partitions)} client(s) "
        f"holding {holding}, run dir {run_dir}, backend {backend}, "
        f"device {built.context.device}{'' if config.precision in (None, 'fp32') else ', precision ' + config.precision}"
        + ("" if built.warm_start is None else
           f", starting from {built.warm_start[1]['algorithm']}'s model after round {built.warm_start[1]['round']} "
           f"({config.init_from})")
    )
    starts: list[dict[str, Any]] = []
    tracking = live_tracking(config.tracker, run_dir, config.tracker_uri, echo)

    def note_start(completed_rounds: int) -> None:
        # A resumption with no round left to run trains nothing: no new start is recorded.
        done = completed_rounds >= config.rounds
        starts.extend(read_starts(run_dir) if done else record_start(
            run_dir, completed_rounds, dataset.fingerprint, built.context.device,
            None if built.warm_start is None else built.warm_start[1]))
        # The tracked run begins with the rounds a resumed run's log already holds.
        tracking.begin(lambda: run_identity(run_dir, resolved, dataset.fingerprint, "+".join(run_sources({"provenance": starts}))),
                       resolved, (lambda: read_log(run_dir)) if completed_rounds else tuple)

    def round_written(record: dict[str, Any]) -> None:
        tracking.log_round(record)
        if on_round is not None:
            on_round(record)

    began = time.perf_counter()
    try:
        evaluations = run_rounds(
            federation,
            rounds=config.rounds,
            seed=config.seed,
            participation_fraction=config.participation_fraction,
            eval_every=config.eval_every,
            run_dir=run_dir,
            resume=resume,
            progress=progress,
            on_start=note_start,
            on_round=round_written,
        )
    except BaseException:  # a failed or stopped run: its tracked run is closed as failed
        tracking.fail()
        raise
    summary = {
        "dataset": dataset.name,
        "dataset_path": config.dataset_path(),
        "data_source": dataset.source,
        "data_fingerprint": dataset.fingerprint,
        "algorithm": built.algorithm.name,
        "hp": built.hparams.model_dump(mode="json"),
        **({} if config.hparams_trial is None else {"hparams_trial": config.hparams_trial.model_dump(mode="json")}),
        "target": config.target,
        "seed": config.seed,
        "rounds": config.rounds,
        "backend": backend,
        "device": device_description(built.context.device),
        "client_devices": {str(client): device for client, device in sorted(federation.clients.client_devices.items())},
        "precision": config.precision or "fp32",
        **({} if built.warm_start is None else {"init_from": built.warm_start[1]}),
        "clients": [[dataset.domain_names[d] for d in p.domains] for p in partitions],
        "wall_seconds": time.perf_counter() - began,
        "selection": {rule: select_round(evaluations, rule) for rule in SELECTION_RULES},
        "collapse": collapse_of(evaluations),
        "evaluation": statement,
        "provenance": starts,
        "faults": fault_summary(run_dir / LOG_NAME),
        "note": "accuracies in percent; 'oracle' selects the round by target accuracy and is not a valid DG estimate",
    }
    if config.differential_privacy is not None:
        summary["privacy"] = privacy_statement(config.differential_privacy, built.sample_rate, config.rounds)
        echo(f"privacy: {summary['privacy']['note']}")
    faults = summary["faults"]
    if faults["dropped_replies"] or faults["rounds_keeping_previous_model"]:
        echo(f"faults: {faults['dropped_replies']} repl{'y' if faults['dropped_replies'] == 1 else 'ies'} dropped "
             f"(reasons in rounds.jsonl, 'dropped'); rounds that kept the previous model: "
             f"{', '.join(faults['rounds_keeping_previous_model']) or 'none'}")
    for chosen in summary["selection"].values():
        if "unavailable" in chosen:  # e.g. a site's id-holdout share missing from every evaluation
            echo(f"selection: {chosen['unavailable']}; its scores are NaN")
    collapse = summary["collapse"]
    if collapse is not None:
        names = dataset.class_names or ()
        name = names[collapse["class"]] if collapse["class"] < len(names) else f"class {collapse['class']}"
        echo(f"warning: the model collapsed to one class: from round {collapse['round']} it predicts {name} for "
             f"{collapse['share']:.0%} of the source holdouts ({collapse['evaluations']} evaluations at "
             f"{COLLAPSE_SHARE:.0%} or more, {COLLAPSE_EVALUATIONS} in a row); summary.json 'collapse'")
    (run_dir / SUMMARY_NAME).write_text(to_json(summary, indent=2))
    tracking.finish(summary, run_dir)
    return summary
