"""Sweeps: a grid of runs (algorithms x targets x seeds x named hyperparameter values, or the
trials of a random hyperparameter search) over one dataset and protocol, each in a run directory
named by a hash of its resolved settings.

A sweep file (YAML)::

    name: rmnist-ppdg
    base:                      # settings every run shares (any ExperimentConfig field)
      dataset: RotatedMNIST
      model: lenet
      rounds: 4
    algorithms: [fedavg, fedprox, ppdg]
    targets: all               # or a list of domain names
    seeds: [0, 1, 2]
    hp:                        # per algorithm: hyperparameter -> list of values (a grid)
      fedprox: {mu: [0.1]}
    variants:                  # optional: named settings, each a change of ``base`` (one factor at a time)
      adam: {}
      sgd: {hp: {client_optimizer: sgd}}
      sgd_photo: {hp: {client_optimizer: sgd}, only_algorithms: [fedavg], only_targets: [photo]}

A variant may be limited to some of the sweep's algorithms (``only_algorithms``) and targets
(``only_targets``), e.g. an ablation of one method on one target beside a full comparison.

Instead of a grid, DomainBed's random search (Gulrajani & Lopez-Paz, ICLR 2021) gives every
method the same budget of trials::

    hparams: {search: random, trials: 8, seed: 0}

Trial 0 runs each method's defaults; trials 1..N-1 draw each hyperparameter from the distribution
the method declares beside its defaults (:mod:`fedbed.algorithms.base.search_space`), the same
draws for every target, seed and variant, and independent of the other methods listed
(:func:`hyperparameter_points`); ``draws: common`` draws each trial's shared hyperparameters
(learning rate, weight decay) from the same random numbers for every method. A hyperparameter
that ``base`` or a variant sets is held at that value and not drawn. The drawn values are in each
job's ``hp`` and the trial in its ``hparams_trial`` setting, so both are part of its identity; a
sweep without ``hparams`` (or with ``search: grid``) keeps its jobs. ``fedbed report
--select-hparams`` then keeps each method's trial with the best training-domain validation.

Warm starts from another sweep's models: ``init_from: {sweep: FOLDER, algorithm: NAME}`` in
``base`` or a variant starts each job from that sweep's run of ``NAME`` with the job's own target
and seed (:func:`init_run_of`); the job's ``init_from`` is that run's folder, so it is part of the
job's identity.

Like DomainBed's sweep, a finished job has a ``done`` marker and is skipped when the sweep is
run again; an unfinished one resumes from its checkpoint.

Several sweep processes may share one sweep folder (machines on a shared disk, or a sweep
started again while an earlier one still runs): a process claims a job before running it by
creating ``claims/<hash>`` exclusively (:func:`claim_job`), and skips the jobs another live
process has claimed. A claim left by a
process that died on this machine is taken over; one left on another machine is named in the
sweep's output, to be deleted by hand once no sweep runs there.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import socket
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tqdm import tqdm

from fedbed.algorithms import AlgorithmError, get_algorithm
from fedbed.algorithms.base.search_space import DRAWS, SEARCHES, HyperparameterTrial, draw_trial
from fedbed.data import dataset_spec, resolve_data_root, with_found_domains
from fedbed.config import (PLACEMENT_SETTINGS, ConfigError, ExperimentConfig, config_from_mapping,
                           hugging_face_columns, name_from_number, override_settings, validate)
from fedbed.experiment import run_experiment
from fedbed.provenance import run_sources, source_fingerprint
from fedbed.results import VARIANT_LIMITS
from fedbed.run_directory import (CHECKPOINT_NAME, CLAIMS_FOLDER, CLIENT_STATES_FOLDER, DONE_MARKER, LOG_NAME,
                                  REMADE_FOLDER, SUMMARY_NAME, SWEEP_RECORD)
from fedbed.run_result import read_log

PER_JOB_KEYS = ("algorithm", "target", "seed", "run_dir", "hparams_trial")
"""Settings a sweep sets per job: neither ``base`` nor a variant may hold them."""


class HyperparameterSearch(BaseModel):
    """A sweep file's ``hparams``: how the methods' hyperparameter values are chosen.

    Attributes:
        search: ``grid`` (the values ``hp`` lists, as without ``hparams``) or ``random``
            (DomainBed's random search over each method's declared distributions).
        trials: N, the trials of every method under ``random`` (trial 0: the defaults; DomainBed's
            paper runs 20).
        seed: S, the seed of the draws under ``random`` (default 0); part of each job's identity.
        draws: ``per_method`` (DomainBed's: each method its own random numbers) or ``common``
            (every method the same random number per hyperparameter name and trial, so shared
            hyperparameters such as the learning rate take the same values across methods;
            :func:`fedbed.algorithms.base.search_space.draw_trial`); ``common`` is part of the
            identity of the jobs it draws.
    """

    model_config = ConfigDict(extra="forbid")

    search: Literal[SEARCHES] = "grid"
    trials: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)
    draws: Literal[DRAWS] = "per_method"

    @model_validator(mode="after")
    def _trials_for_random_search(self) -> "HyperparameterSearch":
        if self.search == "random" and self.trials is None:
            raise ValueError("search: random needs trials: N, the same number for every method (DomainBed's paper: 20)")
        if self.search == "grid" and (self.trials is not None or self.seed is not None):
            raise ValueError("trials and seed apply to search: random; a grid's values are listed under hp")
        if self.search == "grid" and self.draws != "per_method":
            raise ValueError("draws applies to search: random; a grid's values are listed under hp")
        if self.search == "random" and self.seed is None:
            self.seed = 0
        return self


class SweepSpec(BaseModel):
    """A validated sweep file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "sweep"
    base: dict[str, Any] = Field(default_factory=dict)
    algorithms: list[str] = Field(min_length=1)
    targets: str | list[str] = "all"
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    hp: dict[str, dict[str, list[Any]]] = Field(default_factory=dict)
    hparams: HyperparameterSearch | None = None
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("targets", mode="before")
    @classmethod
    def _numbers_as_domain_names(cls, targets: Any) -> Any:
        # YAML reads `targets: [0, 15]` as numbers; RotatedMNIST's domains are named by their digits.
        return [name_from_number(t) for t in targets] if isinstance(targets, list) else targets

    @field_validator("hp")
    @classmethod
    def _grids_name_listed_algorithms(cls, hp: dict[str, dict[str, list[Any]]], info) -> dict:
        listed = set(info.data.get("algorithms") or [])
        for algorithm, grid in hp.items():
            if algorithm not in listed:
                raise ValueError(f"hp names algorithm {algorithm!r}, which is not in 'algorithms' ({', '.join(sorted(listed))})")
            for key, values in grid.items():
                if not values:
                    raise ValueError(f"hp.{algorithm}.{key} lists no value")
        return hp

    @field_validator("hparams")
    @classmethod
    def _grid_or_random_search(cls, hparams: HyperparameterSearch | None, info) -> HyperparameterSearch | None:
        if hparams is not None and hparams.search == "random" and info.data.get("hp"):
            raise ValueError("a random search draws the hyperparameters that hp lists grid values for; remove hp (set "
                             "a value to hold fixed in base's or a variant's hp), or run the grid as its own sweep")
        return hparams

    @field_validator("base")
    @classmethod
    def _no_per_job_keys(cls, base: dict[str, Any]) -> dict[str, Any]:
        for key in PER_JOB_KEYS:
            if key in base:
                raise ValueError(f"'{key}' is set per job by the sweep; remove it from 'base'")
        return base

    @field_validator("variants")
    @classmethod
    def _variants_change_settings(cls, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, settings in variants.items():
            if not isinstance(settings, dict):
                raise ValueError(f"variant {name!r} must be a mapping of settings, got {settings!r}")
            for key in PER_JOB_KEYS:
                if key in settings:
                    raise ValueError(f"'{key}' is set per job by the sweep; remove it from variant {name!r}")
            for key in VARIANT_LIMITS:
                if key in settings and not (isinstance(settings[key], list) and settings[key]):
                    raise ValueError(f"{key} of variant {name!r} must be a non-empty list, got {settings[key]!r}")
            if isinstance(settings.get("only_targets"), list):
                settings["only_targets"] = [name_from_number(t) for t in settings["only_targets"]]
        return variants


def load_sweep_file(path: Path) -> SweepSpec:
    """Read and validate a sweep file.

    Raises:
        ConfigError: missing file, invalid YAML, or an invalid or unknown key (one line).
    """
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
        return SweepSpec(**values)
    except yaml.YAMLError as error:
        raise ConfigError(f"sweep file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "sweep"
        raise ConfigError(f"sweep file {path}: {key}: {first['msg']}") from None
    except TypeError as error:
        raise ConfigError(f"sweep file {path} must hold a mapping: {error}") from None


def config_hash(config: ExperimentConfig) -> str:
    """A stable 12-hex-digit hash of every setting of a run except
    :data:`~fedbed.experiment.PLACEMENT_SETTINGS` (where it reads, writes and scores its
    holdouts), so a sweep keeps its folders on a machine with its data elsewhere.

    The settings are serialised as sorted JSON, so the hash depends only on their values. A
    setting left unset (``None``) is left out, so a new setting whose unset value keeps the old
    behaviour does not change the hash of any existing job (committed results stay found).
    """
    settings = config.model_dump(mode="json", exclude=set(PLACEMENT_SETTINGS), exclude_none=True)
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def sweep_record(spec: SweepSpec) -> str:
    """The text of a sweep folder's ``sweep.yaml``: the sweep file as run, without ``base``'s
    ``data_root`` (where one machine keeps the data), so that running a sweep on another machine
    leaves a committed record unchanged."""
    values = spec.model_dump(mode="json")
    values["base"] = {key: value for key, value in values["base"].items() if key != "data_root"}
    if values["hparams"] is None:  # the records of sweeps without a search stay as they were
        del values["hparams"]
    elif values["hparams"]["draws"] == "per_method":  # and those of searches without common draws
        del values["hparams"]["draws"]
    return yaml.safe_dump(values, sort_keys=False)


def hyperparameter_points(spec: SweepSpec, algorithm: str,
                          fixed: frozenset[str] = frozenset()) -> list[tuple[dict[str, Any], HyperparameterTrial | None]]:
    """The hyperparameter values of ``algorithm``'s jobs for each target, seed and variant, each
    with its search trial: the grid of ``spec.hp`` (every combination of its listed values; one
    point without values when it lists none), with no trial; or under ``hparams.search: random``
    the ``trials`` trials of :func:`fedbed.algorithms.base.search_space.draw_trial` (trial 0 the
    defaults), seeded from (S, the method's name, the trial), so no other method of the sweep
    changes them (with ``hparams.draws: common``, from (S, the trial): the same random numbers for
    every method). ``fixed`` names the hyperparameters the sweep sets, which are not drawn.

    Raises:
        ConfigError: a random search of a method that declares no search distributions (naming it).
    """
    search = spec.hparams
    if search is None or search.search == "grid":
        grid = spec.hp.get(algorithm, {})
        names = sorted(grid)
        return [(dict(zip(names, values)), None) for values in itertools.product(*(grid[key] for key in names))]
    try:
        method = get_algorithm(algorithm)
        space = method.search_space()
    except AlgorithmError as error:
        raise ConfigError(str(error)) from None
    common = search.draws == "common"
    return [(draw_trial(space, search.seed, method.name, trial, fixed, search.draws),
             HyperparameterTrial(seed=search.seed, trial=trial, draws="common" if common and trial else None))
            for trial in range(search.trials)]


def expand(spec: SweepSpec, sweep_dir: Path, data_root: Path | str | None = None) -> list[ExperimentConfig]:
    """Every job of the sweep, each with its run directory ``sweep_dir/<hash>``.

    Order: seed, then target, then algorithm, then variant, then hyperparameter values (grid
    values or search trials, :func:`hyperparameter_points`), so a partial sweep holds whole
    seeds. A variant's settings replace ``base``'s, its ``hp`` is merged into ``base``'s, and the
    algorithm's grid values come last; a search trial's draws leave the values ``base`` or the
    variant sets. ``data_root``, if given,
    replaces ``base``'s (a placement setting: the jobs' hashes do not depend on it).

    Raises:
        ConfigError: an invalid setting, dataset, target, algorithm or hyperparameter, or a
            random search of a method that declares no search distributions.
    """
    if data_root is not None:
        spec = spec.model_copy(update={"base": {**spec.base, "data_root": str(data_root)}})
    try:
        dataset = dataset_spec(spec.base.get("dataset", "RotatedMNIST"), columns=hugging_face_columns(spec.base))
        if spec.targets == "all":
            dataset = with_found_domains(dataset, resolve_data_root(spec.base.get("data_root")))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    targets = list(dataset.domain_names) if spec.targets == "all" else list(spec.targets)
    jobs = []
    variants = list(spec.variants.items()) or [(None, {})]
    made_by: dict[str, str] = {}
    expanded: dict[Path, list[ExperimentConfig]] = {}
    for seed, target, algorithm, (name, variant) in itertools.product(spec.seeds, targets, spec.algorithms, variants):
        if algorithm not in variant.get("only_algorithms", [algorithm]) or target not in variant.get("only_targets", [target]):
            continue
        variant = {key: value for key, value in variant.items() if key not in VARIANT_LIMITS}
        fixed = {**spec.base.get("hp", {}), **variant.get("hp", {})}
        for values, trial in hyperparameter_points(spec, algorithm, frozenset(fixed)):
            hp = {**fixed, **values}
            settings = override_settings(spec.base, variant)
            if trial is not None:
                settings["hparams_trial"] = trial.model_dump(mode="json")
            if isinstance(settings.get("init_from"), dict):
                settings["init_from"] = str(init_run_of(settings["init_from"], target, seed, spec.base.get("data_root"), expanded))
            config = config_from_mapping({**settings, "algorithm": algorithm, "target": target, "seed": seed, "hp": hp})
            # The warm start's checkpoint is checked when the job runs (it may be made by a sweep
            # still running); an init_from_arrays without init_from is refused here.
            resolved = validate(config if config.init_from is None else
                                config.model_copy(update={"init_from": None, "init_from_arrays": None}))
            # Two variants (or grid values) that resolve to the same run would share a folder or
            # be told apart only by how they were spelled: refused.
            computed = json.dumps({**config.model_dump(mode="json", exclude=set(PLACEMENT_SETTINGS) | {"hp"}),
                                   "hp": resolved.hparams.model_dump(mode="json")}, sort_keys=True)
            this = f"variant {name!r}" if name is not None else "the sweep"
            if computed in made_by:
                raise ConfigError(f"{this} and {made_by[computed]} give the same run ({algorithm}, target {target}, "
                                  f"seed {seed}) once defaults are filled in; drop one of them")
            made_by[computed] = f"{this} ({values or 'no grid value'}{'' if trial is None else f', trial {trial.trial}'})"
            jobs.append(config.model_copy(update={"run_dir": sweep_dir / config_hash(config)}))
    return jobs


class InitFromSweep(BaseModel):
    """A sweep job's warm start named by another sweep (``init_from: {sweep: DIR, algorithm: NAME}``
    in ``base`` or a variant): each job starts from that sweep's run of ``algorithm`` with the job's
    own target (never another target's model: it would have trained on this job's target domain)
    and the job's seed, or ``seed`` when given (one initial model for every seed)."""

    model_config = ConfigDict(extra="forbid")

    sweep: Path
    algorithm: str
    seed: int | None = Field(None, ge=0)


def init_run_of(mapping: dict[str, Any], target: str, seed: int, data_root: Path | str | None,
                expanded: dict[Path, list[ExperimentConfig]]) -> Path:
    """The run folder a warm-started sweep job starts from (:class:`InitFromSweep`): the job of the
    sweep recorded in ``mapping["sweep"]`` (its ``sweep.yaml``, so the folder is known before that
    sweep has finished) with ``mapping["algorithm"]``, ``target`` and the seed; ``expanded`` caches
    each such sweep's jobs.

    Raises:
        ConfigError: an invalid mapping, no sweep record in the folder (run that sweep first), or not
            exactly one matching job there.
    """
    try:
        source = InitFromSweep(**mapping)
    except ValidationError as error:
        first = error.errors()[0]
        raise ConfigError(f"init_from.{'.'.join(str(p) for p in first['loc'])}: {first['msg']} (give "
                          "{sweep: FOLDER, algorithm: NAME} and optionally seed)") from None
    if source.sweep not in expanded:
        record = source.sweep / SWEEP_RECORD
        if not record.is_file():
            raise ConfigError(f"init_from: {source.sweep} holds no {SWEEP_RECORD}; run the sweep that makes the initial "
                              "models into that folder first")
        expanded[source.sweep] = expand(load_sweep_file(record), source.sweep, data_root)
    wanted = seed if source.seed is None else source.seed
    matches = [job.run_dir for job in expanded[source.sweep]
               if (job.algorithm, job.target, job.seed) == (source.algorithm, target, wanted)]
    if len(matches) != 1:
        raise ConfigError(f"init_from: {source.sweep} has {len(matches)} runs of {source.algorithm} for target {target}, "
                          f"seed {wanted}; it must have exactly one")
    return matches[0]


def finished_on_other_data(jobs: list[ExperimentConfig]) -> list[str]:
    """The finished jobs (``done`` marker) whose summary records other data than the job would
    read now, one line each: a job made from the embedded MNIST sample is not a result on the
    full MNIST. The data is compared by its fingerprint
    (:attr:`fedbed.data.DomainDataset.fingerprint`), or, for a summary made before fingerprints
    were recorded, by its source description without folders (:func:`fedbed.data.base.portable_source`).

    Raises:
        ConfigError: the data a finished job's settings name cannot be found now.
    """
    from fedbed.data import DataError, load_dataset, resolve_data_root
    from fedbed.build import image_size_of
    from fedbed.data.base import portable_source

    lines = []
    for job in jobs:
        if not (job.run_dir / DONE_MARKER).exists():
            continue
        try:
            columns = hugging_face_columns(job)
            dataset = load_dataset(job.dataset, resolve_data_root(job.data_root),
                                   image_size_of(job, dataset_spec(job.dataset, columns=columns)), job.channels,
                                   columns=columns)
        except DataError as error:
            raise ConfigError(str(error)) from None
        summary = json.loads((job.run_dir / SUMMARY_NAME).read_text())
        recorded = summary.get("data_fingerprint")
        if (recorded != dataset.fingerprint) if recorded else (
                portable_source(summary.get("data_source", "")) != portable_source(dataset.source)):
            lines.append(f"{job.run_dir}: made from {summary.get('data_source', 'unrecorded data')}, "
                         f"this sweep reads {dataset.source}")
    return lines


def claim_path(run_dir: Path) -> Path:
    """The claim file of the sweep job in ``run_dir``: ``<sweep folder>/claims/<hash>``."""
    return run_dir.parent / CLAIMS_FOLDER / run_dir.name


def _process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def claim_job(run_dir: Path) -> str | None:
    """Claim the sweep job in ``run_dir`` for this process, so that no other sweep process runs it
    at the same time; return ``None`` when claimed, else who holds it.

    The claim is :func:`claim_path`, created exclusively (``O_CREAT | O_EXCL``, atomic on local
    disks and NFSv3+) and holding ``{"host", "pid", "since"}`` as JSON. A claim whose process is
    gone from this host is stale and taken over; a claim from another host cannot be checked and is
    respected. Release it with :func:`release_job`.

    Returns:
        ``None``, or a description of the holder with the claim file to delete if that
        process no longer runs, e.g. ``"host-b pid 412 since 2026-11-24T06:10:00Z (...)"``.
    """
    path = claim_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for _ in range(2):
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                stale = holder["host"] == host and not _process_is_alive(int(holder["pid"]))
            except (OSError, ValueError, KeyError, TypeError):  # being written, or vanished: held
                return f"another sweep process (claim file {path})"
            if stale:
                path.unlink(missing_ok=True)
                continue
            return (f"{holder['host']} pid {holder['pid']} since {holder.get('since', '?')} (if no sweep runs it "
                    f"there, delete {path})")
        with os.fdopen(descriptor, "w") as claim:
            json.dump({"host": host, "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                      claim)
        return None
    return f"another sweep process (claim file {path})"


def release_job(run_dir: Path) -> None:
    """Delete this process's claim on the job in ``run_dir`` (:func:`claim_job`); nothing if none."""
    path = claim_path(run_dir)
    try:
        if json.loads(path.read_text()).get("pid") != os.getpid():
            return
    except (OSError, ValueError, AttributeError):
        return
    path.unlink(missing_ok=True)


class JobOutcome(NamedTuple):
    """What became of one pending sweep job: ``error`` (``None`` when it finished), or
    ``held_by``, another process's claim (:func:`claim_job`), when it was not run here; ``finished_elsewhere``
    when another process finished it after this sweep listed it."""

    run_dir: str
    error: str | None = None
    held_by: str | None = None
    finished_elsewhere: bool = False


def remake_checkpoint(config: ExperimentConfig, threads: int) -> JobOutcome:
    """Make the checkpoint of a finished job whose folder has none (records committed without
    it, e.g. the initial models a warm-started sweep reads, on a new machine): re-run the job in
    ``<sweep folder>/remade/<hash>`` (:data:`~fedbed.run_directory.REMADE_FOLDER`; an interrupted
    re-run is resumed, a finished one started over), and only if its ``rounds.jsonl`` equals the
    committed one record for record, wall-clock times aside and the update measurements within
    :data:`~fedbed.run_result.MEASUREMENT_TOLERANCE` (:func:`fedbed.run_result.first_differing_round`;
    their arithmetic changed after some records were made; losses, accuracies and every other
    value must be equal), move its checkpoint (and client-state
    files) into the job's folder and delete the re-run. The committed records are never rewritten.

    The re-run uses the torch threads of the record's first start, whatever ``threads`` says
    (the thread count changes the last bits); a record made with another torch version or CPU
    instruction set (``provenance.jsonl``) is refused before any training, as a re-run here
    cannot reproduce its bits. A re-run that differs (other code, other arithmetic) is kept
    for inspection and reported as the job's error, so no run starts from a model the records do
    not describe; the next remake starts it over.

    Returns:
        the job's :class:`JobOutcome`: an ``error`` when refused or different; nothing to do
        (no error) when another process made the checkpoint meanwhile.
    """
    import shutil

    import torch

    from fedbed.provenance import read_starts
    from fedbed.run_result import MEASUREMENT_TOLERANCE, first_differing_round

    run_dir = config.run_dir
    scratch = run_dir.parent / REMADE_FOLDER / run_dir.name
    held_by = claim_job(run_dir)
    if held_by:
        return JobOutcome(str(run_dir), held_by=held_by)
    try:
        if (run_dir / CHECKPOINT_NAME).exists():  # made by another process meanwhile
            return JobOutcome(str(run_dir))
        refusal = remake_refusal(run_dir)
        if refusal:
            return JobOutcome(str(run_dir), error=refusal)
        torch.set_num_threads((read_starts(run_dir) or [{}])[0].get("torch_threads") or threads)
        if (scratch / SUMMARY_NAME).exists():  # an earlier re-run finished (and differed): start over
            shutil.rmtree(scratch)
        run_experiment(config.model_copy(update={"run_dir": scratch, "tracker": None}),
                       resume=(scratch / CHECKPOINT_NAME).exists(), progress=False, echo=lambda *_: None)
        differing = first_differing_round(run_dir, scratch, measurement_tolerance=MEASUREMENT_TOLERANCE)
        if differing is not None:
            return JobOutcome(str(run_dir), error=f"the re-run differs from the committed rounds.jsonl from round "
                                                  f"{differing} on (other code or arithmetic: compare the two "
                                                  f"provenance.jsonl); kept in {scratch}, no checkpoint made")
        if (scratch / CLIENT_STATES_FOLDER).exists():
            (scratch / CLIENT_STATES_FOLDER).replace(run_dir / CLIENT_STATES_FOLDER)
        (scratch / CHECKPOINT_NAME).replace(run_dir / CHECKPOINT_NAME)
        shutil.rmtree(scratch)
        return JobOutcome(str(run_dir))
    except Exception as error:  # as a failing job: reported, the sweep goes on
        return JobOutcome(str(run_dir), error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}")
    finally:
        release_job(run_dir)


def _run_job(config: ExperimentConfig, threads: int) -> JobOutcome:
    """Claim and run one job (in a worker process or in this one)."""
    import torch

    run_dir = config.run_dir
    held_by = claim_job(run_dir)
    if held_by:
        return JobOutcome(str(run_dir), held_by=held_by)
    try:
        if (run_dir / DONE_MARKER).exists():
            return JobOutcome(str(run_dir), finished_elsewhere=True)
        torch.set_num_threads(threads)
        resume = (run_dir / CHECKPOINT_NAME).exists()
        run_experiment(config, resume=resume, progress=False, echo=lambda *_: None)
        (run_dir / DONE_MARKER).write_text("")
        return JobOutcome(str(run_dir))
    except Exception as error:  # a failing job is reported; the sweep goes on
        return JobOutcome(str(run_dir), error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}")
    finally:
        release_job(run_dir)


ONLY_KEYS = ("algorithm", "target", "seed")
"""The job settings ``fedbed sweep --only KEY=VALUE`` can select by (:func:`jobs_matching`)."""


def jobs_matching(jobs: list[ExperimentConfig], only: dict[str, list[str]]) -> list[ExperimentConfig]:
    """The jobs whose algorithm, target and seed are among ``only``'s values for each key given
    (values of one key: any of them; several keys: all of them), in the sweep's order: a part of a
    sweep to run now, the rest left for another run of the same sweep into the same folder (their
    identities do not depend on the part). An empty ``only`` keeps every job.

    Raises:
        ConfigError: a key not in :data:`ONLY_KEYS`, or a value no job of the sweep has (the
            message lists the sweep's values).
    """
    for key, values in only.items():
        if key not in ONLY_KEYS:
            raise ConfigError(f"--only selects by {', '.join(ONLY_KEYS)}, not {key!r}; e.g. --only seed=1")
        present = sorted({str(getattr(job, key)) for job in jobs}, key=lambda value: (len(value), value))
        for value in values:
            if value not in present:
                raise ConfigError(f"--only {key}={value}: no job of this sweep has that {key}; "
                                  f"its {key}s are {', '.join(present)}")
    return [job for job in jobs if all(str(getattr(job, key)) in values for key, values in only.items())]


def remake_refusal(run_dir: Path) -> str | None:
    """Why a finished job's checkpoint cannot be remade on this machine (:func:`remake_checkpoint`),
    or ``None``: its record's first start (``provenance.jsonl``) names another torch version or CPU
    instruction set than this machine's, whose arithmetic differs in the last bits. For an AVX2
    record on an AVX512 machine it names the environment variables that cap the kernels at AVX2
    (:data:`fedbed.provenance.AVX2_KERNEL_CAPS`), with which the remake's comparison decides."""
    from fedbed.provenance import AVX2_KERNEL_CAPS, current_provenance, kernel_caps_prefix, read_starts

    recorded, here = (read_starts(run_dir) or [{}])[0], current_provenance()
    for key in ("torch", "torch_cpu_capability"):
        if recorded.get(key) is not None and recorded[key] != here[key]:
            capped = (key == "torch_cpu_capability" and recorded[key] == "AVX2" and here[key] == "AVX512")
            hint = (f" (or here with the kernels capped: {kernel_caps_prefix(AVX2_KERNEL_CAPS)} before the command, "
                    "README)") if capped else ""
            return (f"the record was made with {key} {recorded[key]}, this machine has {here[key]}: a re-run here "
                    f"cannot reproduce it; remake it on a machine like the one that made it{hint}")
    return None


def check_parallelism(workers: int, threads: int | None) -> None:
    """Refuse a sweep's ``workers`` or ``threads`` below 1.

    Raises:
        ConfigError: naming the option and the value given.
    """
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}; leave it out for cores // workers")


def logged_seconds(run_dir: Path) -> tuple[int, float]:
    """The rounds in ``run_dir``'s ``rounds.jsonl`` and the seconds they took (each round's
    ``seconds``, evaluation included), summed over every start of the run, where a summary's
    ``wall_seconds`` counts its last start only.

    Raises:
        ConfigError: a log that is not JSON lines (naming it).
    """
    try:
        records = read_log(run_dir)
    except ValueError as error:
        raise ConfigError(f"{run_dir / LOG_NAME} is not JSON lines ({error}); restore it from git or delete the "
                          "job's folder to run it again") from None
    return len(records), sum(float(record.get("seconds") or 0.0) for record in records)


def sweep_part(spec: SweepSpec, sweep_dir: Path, data_root: Path | str | None,
               only: dict[str, list[str]] | None) -> tuple[list[ExperimentConfig], list[ExperimentConfig]]:
    """Every job of the sweep (:func:`expand`) and those of the part ``only`` names
    (:func:`jobs_matching`; all without it).

    Raises:
        ConfigError: as :func:`expand` and :func:`jobs_matching`, and finished jobs of the part
            made from other data than the sweep reads now (:func:`finished_on_other_data`).
    """
    every_job = expand(spec, sweep_dir, data_root)
    jobs = jobs_matching(every_job, only or {})
    other_data = finished_on_other_data(jobs)
    if other_data:
        raise ConfigError(f"{len(other_data)} finished job(s) in {sweep_dir} were made from other data than this sweep "
                          f"reads (e.g. {other_data[0]}); give the data root they used, another --out, or delete them")
    return every_job, jobs


def plan_sweep(spec: SweepSpec, sweep_dir: Path, data_root: Path | str | None = None,
               only: dict[str, list[str]] | None = None, remake_checkpoints: bool = False) -> list[dict[str, Any]]:
    """What :func:`run_sweep` would do, per algorithm, without running or writing anything: the
    jobs of the part (:func:`jobs_matching`), how many are finished, partly run (a log, no
    ``done``) or to remake (``remake_checkpoints``: finished without a checkpoint), and an
    estimate of the time their runs take one after another: the rounds left times the median
    seconds a round took in the algorithm's finished jobs anywhere in the sweep (summed over
    each job's starts, :func:`logged_seconds`; ``None`` without a finished job). A job to remake
    counts its own logged seconds. The jobs ran at the torch threads their records name, and
    jobs made on another machine took that machine's time.

    Returns:
        one ``{"algorithm", "jobs", "finished", "pending", "partly_run", "remake", "remake_refused",
        "seconds_per_round", "pending_hours"}`` per algorithm, in the sweep's order;
        ``remake_refused`` is the first refusal (:func:`remake_refusal`) and how many share it.

    Raises:
        ConfigError: as :func:`sweep_part` (the refusals :func:`run_sweep` would make), and a
            finished job's unreadable log.
    """
    import statistics

    every_job, jobs = sweep_part(spec, sweep_dir, data_root, only)
    rows = []
    for algorithm in dict.fromkeys(job.algorithm for job in jobs):
        per_round = [seconds / rounds for rounds, seconds in
                     (logged_seconds(job.run_dir) for job in every_job
                      if job.algorithm == algorithm and (job.run_dir / DONE_MARKER).exists()) if rounds]
        speed = statistics.median(per_round) if per_round else None
        own = [job for job in jobs if job.algorithm == algorithm]
        pending = [job for job in own if not (job.run_dir / DONE_MARKER).exists()]
        partly_run = {job.run_dir: (job.run_dir / LOG_NAME).read_text().count("\n")  # a running job may be mid-line
                      for job in pending if (job.run_dir / LOG_NAME).exists()}
        remake = [job for job in own if remake_checkpoints and (job.run_dir / DONE_MARKER).exists()
                  and not (job.run_dir / CHECKPOINT_NAME).exists()]
        refusals = [refusal for refusal in map(remake_refusal, (job.run_dir for job in remake)) if refusal]
        hours = None
        if speed is not None or not pending:
            rounds_left = sum(max(job.rounds - partly_run.get(job.run_dir, 0), 0) for job in pending)
            hours = (rounds_left * (speed or 0.0) + sum(logged_seconds(job.run_dir)[1] for job in remake)) / 3600
        rows.append({"algorithm": algorithm, "jobs": len(own), "finished": len(own) - len(pending),
                     "pending": len(pending), "partly_run": len(partly_run), "remake": len(remake),
                     "remake_refused": (refusals[0], len(refusals)) if refusals else None,
                     "seconds_per_round": speed, "pending_hours": hours})
    return rows


def run_sweep(spec: SweepSpec, sweep_dir: Path, workers: int = 1, threads: int | None = None,
              progress: bool = True, data_root: Path | str | None = None,
              only: dict[str, list[str]] | None = None, remake_checkpoints: bool = False) -> dict[str, Any]:
    """Run every unfinished job of the sweep, and record the sweep file in the folder
    (:func:`sweep_record`, without the data root).

    Args:
        spec: the validated sweep.
        sweep_dir: where the run directories go (created).
        workers: parallel processes; unless ``threads`` is given, each gets ``max(1, cores // workers)``
            torch threads so that workers x threads never exceeds the cores (oversubscribing 2 cores
            slows every job several times).
        threads: torch threads per job instead of ``cores // workers``: ``1`` when other processes
            (another sweep on the same folder, a second sweep) share the machine's cores. Not
            checked against the cores (the CLI warns).
        progress: one overall progress bar (jobs done / total, ETA).
        data_root: where the jobs read their data, instead of ``base``'s ``data_root`` (default:
            that, else ``$FEDBED_DATA``); recorded in no file of the sweep folder but the new jobs'
            ``config.yaml``.
        only: run only the jobs :func:`jobs_matching` keeps (e.g. ``{"seed": ["1"]}``); the others
            are counted as ``left_out`` and neither run nor checked.
        remake_checkpoints: first make, by :func:`remake_checkpoint`, the checkpoint of every
            finished job of the part that has none (counted as ``remade``, and as ``skipped``
            like every finished job; a refused or differing re-run is a failure).

    Raises:
        ConfigError: finished jobs made from other data than the sweep reads now
            (:func:`finished_on_other_data`), ``workers < 1`` or ``threads < 1``, or an ``only``
            :func:`jobs_matching` refuses.

    Returns:
        ``{"total", "left_out", "skipped", "ran", "remade", "held": {run_dir: holder}, "failed": {run_dir: error},
        "other_code": [run_dir], "data": [line]}``: ``total`` counts the jobs of the part run (all
        without ``only``), ``left_out`` the sweep's other jobs; ``held`` are the jobs another sweep process had claimed (:func:`claim_job`),
        not run here; ``skipped`` counts the jobs finished before this sweep or, meanwhile, by another
        process; ``data`` is :func:`fedbed.reporting.data_sources` of the finished jobs;
        ``other_code`` lists the finished jobs (skipped, or run now from a checkpoint) that other
        code than this one started or resumed (:func:`made_by_other_code`): their numbers may
        differ from what this code gives.
    """
    check_parallelism(workers, threads)
    every_job, jobs = sweep_part(spec, sweep_dir, data_root, only)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record = sweep_record(spec)
    if not (sweep_dir / SWEEP_RECORD).exists() or (sweep_dir / SWEEP_RECORD).read_text() != record:
        (sweep_dir / SWEEP_RECORD).write_text(record)
    pending = [job for job in jobs if not (job.run_dir / DONE_MARKER).exists()]
    remake = [job for job in jobs if remake_checkpoints and (job.run_dir / DONE_MARKER).exists()
              and not (job.run_dir / CHECKPOINT_NAME).exists()]
    tasks = [(remake_checkpoint, job) for job in remake] + [(_run_job, job) for job in pending]
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    failed: dict[str, str] = {}
    held: dict[str, str] = {}
    finished_elsewhere = 0
    bar = tqdm(total=len(jobs) + len(remake), initial=len(jobs) - len(pending), desc=spec.name, unit="job",
               disable=not progress)

    def record(outcome: JobOutcome) -> None:
        nonlocal finished_elsewhere
        if outcome.error:
            failed[outcome.run_dir] = outcome.error
        if outcome.held_by:
            held[outcome.run_dir] = outcome.held_by
        finished_elsewhere += outcome.finished_elsewhere
        bar.update(1)

    if workers == 1:
        for task, job in tasks:
            record(task(job, threads))
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(task, job, threads) for task, job in tasks]
            try:
                for future in as_completed(futures):
                    record(future.result())
            except BaseException:  # Ctrl-C, SIGTERM, SIGHUP: stop the workers now, not after their jobs
                pool.shutdown(wait=False, cancel_futures=True)
                for worker in multiprocessing.active_children():
                    worker.terminate()
                raise
    bar.close()
    finished = [job.run_dir for job in jobs if (job.run_dir / SUMMARY_NAME).exists()]
    from fedbed.reporting import data_sources

    summaries = [json.loads((run_dir / SUMMARY_NAME).read_text()) for run_dir in finished]
    skipped = len(jobs) - len(pending) + finished_elsewhere
    remade = [str(job.run_dir) for job in remake]
    held_pending = [run_dir for run_dir in held if run_dir not in remade]
    return {"total": len(jobs), "left_out": len(every_job) - len(jobs), "skipped": skipped,
            "ran": len(pending) - finished_elsewhere - len(held_pending),
            "remade": sum(run_dir not in failed and run_dir not in held for run_dir in remade),
            "held": held, "failed": failed,
            "other_code": [str(run_dir) for run_dir in finished if made_by_other_code(run_dir)],
            "data": data_sources(summaries)[0]}


def made_by_other_code(run_dir: Path) -> bool:
    """Whether a finished run was started or resumed by other code than this one: its summary's
    provenance holds another source fingerprint, or none (made before it was recorded)."""
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    return set(run_sources(summary)) != {source_fingerprint()}
