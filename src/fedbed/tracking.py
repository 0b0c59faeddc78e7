"""Experiment trackers: a run's records sent to TensorBoard, MLflow or Weights & Biases, live
(``tracker:`` in a run's settings) or afterwards from its run folder (``fedbed export``).

Each tool is one :class:`Tracker` (:class:`TensorBoardTracker`, :class:`MlflowTracker`,
:class:`WandbTracker`) behind one small interface; :class:`RunTracking` feeds any of them a run's
records in one order, the same live and in an export:

1. :meth:`Tracker.start`: the run's identity (:class:`RunIdentity`: a name, the experiment it
   belongs to and its tags: the sweep job's hash in a sweep folder, the data's fingerprint and
   the source fingerprint of the code that ran it, :mod:`fedbed.provenance`) and its resolved
   settings (``config.yaml``) as parameters, nested settings flattened to ``a/b/c`` keys;
2. :meth:`Tracker.log_metrics` once per round (``rounds.jsonl``'s record: losses, telemetry,
   alignment, bytes, evaluation), its nested dicts flattened to ``a/b/c`` keys and only its
   numbers kept (lists, such as the cosine matrix, stay in the log);
3. :meth:`Tracker.log_summary`: ``summary.json``'s numbers as ``summary/...`` metrics at the last
   round (``summary/selection/train_domain_val/ood_mean``, ``summary/wall_seconds``...; not the
   settings it repeats, :data:`SUMMARY_SETTINGS`), and the summary itself;
4. :meth:`Tracker.log_image` for every PNG in the run folder's ``plots/`` (``fedbed plot``'s);
5. :meth:`Tracker.finish`.

Live, the engine hands each round's record to :meth:`RunTracking.log_round` right after writing
it (:func:`fedbed.federation.engine.run_rounds`' ``on_round``, set by
:func:`fedbed.experiment.execute_run`). The Flower ServerApp runs that same function
(:func:`fedbed.flower.apps.server_main`), so ``flower-sim`` and ``flower-deployment`` runs are
tracked by the server as in-process runs are, and no client ever talks to a tracker. A resumed run
first replays the rounds its log already holds, so each tracked run is whole. A tracker that
raises while a run goes on is switched off after one warning line and the run goes on: its
records in the run folder are the same as without a tracker, and ``fedbed export`` can send them
again. An export (:func:`export_run`) raises :class:`TrackingError` instead.

Where each tool writes: TensorBoard into the run folder's ``tensorboard/`` (replaced by each
start, resumption and export, so it always holds the run's records once); MLflow to the
``tracker_uri`` (else ``MLFLOW_TRACKING_URI``, else MLflow's default, ``sqlite:///mlflow.db`` in
the working directory), into the experiment named by the sweep (its ``name``) or ``fedbed``;
Weights & Biases into the project named likewise, honouring its own ``WANDB_MODE`` (``offline``
needs no account and no network), ``WANDB_DIR``, ``WANDB_ENTITY`` and ``WANDB_SILENT``.

The tools are optional extras (``pip install 'fedbed[tensorboard]'``, ``[mlflow]``, ``[wandb]``),
imported only when a tracker is made; :func:`tracker_refusal` says, at validation, which is
missing.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from fedbed.jsonlog import json_safe
from fedbed.provenance import run_sources
from fedbed.run_directory import CONFIG_NAME, PLOTS_FOLDER, SUMMARY_NAME, SWEEP_RECORD, TENSORBOARD_FOLDER
from fedbed.run_result import read_log

TRACKERS = ("tensorboard", "mlflow", "wandb")
"""The trackers a run can log to (``tracker:``), each an extra of the same name."""

DEFAULT_EXPERIMENT = "fedbed"
"""The MLflow experiment and W&B project of a run outside a sweep folder."""

SUMMARY_SETTINGS = ("hp", "seed", "rounds")
"""Keys of ``summary.json`` that repeat settings (logged as parameters), not logged as its metrics."""

Scalar = str | int | float | bool


class TrackingError(RuntimeError):
    """Raised when an export cannot reach its tracker or the tracker refuses a call (the tool's
    own message, on one line)."""


def tracker_refusal(tracker: str | None, tracker_uri: str | None) -> str | None:
    """Why a run's ``tracker`` and ``tracker_uri`` cannot be used here, in one line, or ``None``.

    A tracker whose package is not installed is refused with the command that installs it; a
    ``tracker_uri`` is MLflow's tracking URI and is refused with another tracker or none.
    """
    if tracker_uri is not None and tracker != "mlflow":
        return ("tracker_uri is MLflow's tracking URI: it applies to tracker: mlflow only (TensorBoard writes into the "
                "run folder, W&B where WANDB_DIR says)")
    if tracker is not None and importlib.util.find_spec(tracker) is None:
        return f"tracker: {tracker} needs the {tracker} package: pip install 'fedbed[{tracker}]'"
    return None


def flattened(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``mapping``'s nested dicts as one level, their keys joined by ``/`` after ``prefix``:
    ``{"a": {"b": 1}, "c": [2]}`` -> ``{"a/b": 1, "c": [2]}`` (an empty dict leaves no key)."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flattened(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def numbers_of(mapping: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of ``mapping`` (:func:`flattened`) as floats: strings, booleans,
    ``None`` and lists are left out."""
    return {key: float(value) for key, value in flattened(mapping, prefix).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def round_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The metrics of one round's record (a ``rounds.jsonl`` line): its numbers by flattened key,
    without the round number itself (the step), e.g. ``metrics/train_loss``,
    ``evaluation/ood/0``, ``telemetry/weights/3``, ``communication/sent_bytes/1``, ``seconds``."""
    metrics = numbers_of({key: value for key, value in json_safe(record).items() if key != "round"})
    metrics.pop("evaluation/round", None)
    return metrics


def settings_as_parameters(settings: dict[str, Any]) -> dict[str, Scalar]:
    """A run's resolved settings as tracker parameters: flattened (``hp/client_lr``), each value a
    string, number or boolean (``None`` and lists as their JSON text, ``null``, ``["a", "b"]``)."""
    return {key: value if isinstance(value, (str, int, float, bool)) else json.dumps(value)
            for key, value in flattened(json_safe(settings)).items()}


@dataclass(frozen=True)
class RunIdentity:
    """Who a tracked run is.

    Attributes:
        name: the run's display name (``fedavg on RotatedMNIST, target 0, seed 0``; a sweep
            job's hash after it).
        experiment: the MLflow experiment and W&B project: the sweep's name for a job of a sweep
            folder, else :data:`DEFAULT_EXPERIMENT`.
        tags: ``fedbed.sweep_job`` (the job's hash, its folder's name, in a sweep folder only),
            ``fedbed.data_fingerprint`` (:attr:`fedbed.data.DomainDataset.fingerprint`) and
            ``fedbed.source_fingerprint`` (:func:`fedbed.provenance.source_fingerprint` of the code
            that ran it; ``a+b`` for a run begun by ``a`` and resumed by ``b``).
    """

    name: str
    experiment: str
    tags: dict[str, str]


def run_identity(run_dir: Path, settings: dict[str, Any], data_fingerprint: str | None, source: str) -> RunIdentity:
    """The :class:`RunIdentity` of the run in ``run_dir`` with ``settings`` (``config.yaml``):
    a folder beside a ``sweep.yaml`` is a sweep job, named by its hash."""
    sweep_file = run_dir.parent / SWEEP_RECORD
    sweep_name = (yaml.safe_load(sweep_file.read_text()) or {}).get("name") if sweep_file.is_file() else None
    name = (f"{settings.get('algorithm')} on {settings.get('dataset')}, target {settings.get('target')}, "
            f"seed {settings.get('seed')}")
    tags = {"fedbed.data_fingerprint": str(data_fingerprint), "fedbed.source_fingerprint": source}
    if sweep_file.is_file():
        tags = {"fedbed.sweep_job": run_dir.name, **tags}
        name = f"{name} [{run_dir.name}]"
    return RunIdentity(name, str(sweep_name or DEFAULT_EXPERIMENT), tags)


class Tracker(ABC):
    """One experiment-tracking tool, fed one run (see the module docstring for the order of the
    calls). Every method may raise whatever the tool raises; :class:`RunTracking` handles it."""

    name: ClassVar[str]

    def __init__(self, run_dir: Path, tracker_uri: str | None = None) -> None:
        """Args:
            run_dir: the run folder (TensorBoard writes into it).
            tracker_uri: MLflow's tracking URI (``None``: its own default).
        """
        self.run_dir = run_dir
        self.tracker_uri = tracker_uri

    @abstractmethod
    def start(self, identity: RunIdentity, parameters: dict[str, Scalar]) -> None:
        """Open the run, with its identity and its settings (:func:`settings_as_parameters`)."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one round's metrics (:func:`round_metrics`) at ``step``, the round (1-based)."""

    @abstractmethod
    def log_summary(self, metrics: dict[str, float], summary: dict[str, Any], step: int) -> None:
        """Log the summary's numbers (``summary/...``) at ``step`` (the last round) and the summary."""

    @abstractmethod
    def log_image(self, path: Path, name: str, step: int) -> None:
        """Log the PNG at ``path`` as ``name`` (``plots/alignment_over_rounds``) at ``step``."""

    @abstractmethod
    def finish(self, succeeded: bool) -> None:
        """Close the run, marked finished or failed."""


class TensorBoardTracker(Tracker):
    """TensorBoard event files in ``run_dir/tensorboard`` (torch's ``SummaryWriter``): the settings
    and identity as hparams and as text, the metrics as scalars, the summary as scalars and its
    JSON as text, the plots as images. The folder is replaced on every start, so it holds the
    run's records once (a resumed run replays its earlier rounds)."""

    name = "tensorboard"

    def start(self, identity: RunIdentity, parameters: dict[str, Scalar]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = self.run_dir / TENSORBOARD_FOLDER
        shutil.rmtree(folder, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(folder))
        for event in hparams({**parameters, **identity.tags}, {}):
            self.writer.file_writer.add_summary(event)
        self.writer.add_text("identity", "\n".join(f"- {key}: {value}" for key, value in
                                                   {"name": identity.name, **identity.tags}.items()))
        self.writer.add_text("settings", "```\n" + yaml.safe_dump(parameters, sort_keys=False) + "```")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_summary(self, metrics: dict[str, float], summary: dict[str, Any], step: int) -> None:
        self.log_metrics(metrics, step)
        self.writer.add_text("summary", "```json\n" + json.dumps(json_safe(summary), indent=2) + "\n```", step)

    def log_image(self, path: Path, name: str, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self.writer.add_image(name, pixels, step, dataformats="HWC")

    def finish(self, succeeded: bool) -> None:
        self.writer.close()


def mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in a metric or parameter name (anything but
    letters, digits, ``_ - . / `` and space) replaced by ``_`` (a domain named ``a&b``)."""
    return re.sub(r"[^\w./\- ]", "_", key)


class MlflowTracker(Tracker):
    """An MLflow run (``MlflowClient``, no global state): the settings as params, the identity as
    tags, the metrics by step, the summary as metrics and as the artifact ``summary.json``, the
    plots as artifacts under ``plots/``; finished as ``FINISHED`` or ``FAILED``."""

    name = "mlflow"
    BATCH_PARAMETERS = 100
    BATCH_METRICS = 1000
    """MLflow's limits per ``log_batch`` call."""

    def start(self, identity: RunIdentity, parameters: dict[str, Scalar]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        self.client = MlflowClient(tracking_uri=self.tracker_uri)
        experiment = self.client.get_experiment_by_name(identity.experiment)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(identity.experiment)
            except MlflowException:  # another process (a sweep's worker) created it meanwhile
                experiment_id = self.client.get_experiment_by_name(identity.experiment).experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=identity.name, tags=identity.tags).info.run_id
        items = [Param(mlflow_key(key), str(value)) for key, value in parameters.items()]
        for first in range(0, len(items), self.BATCH_PARAMETERS):
            self.client.log_batch(self.run_id, params=items[first:first + self.BATCH_PARAMETERS])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(key), value, now, step) for key, value in metrics.items()]
        for first in range(0, len(items), self.BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=items[first:first + self.BATCH_METRICS])

    def log_summary(self, metrics: dict[str, float], summary: dict[str, Any], step: int) -> None:
        self.log_metrics(metrics, step)
        self.client.log_dict(self.run_id, json_safe(summary), SUMMARY_NAME)

    def log_image(self, path: Path, name: str, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=str(Path(name).parent))

    def finish(self, succeeded: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if succeeded else "FAILED")


class WandbTracker(Tracker):
    """A Weights & Biases run (``wandb.init``, one per run even in one process): the settings as
    its config, the identity as its tags (``data_fingerprint:<hash>``...) and in its config, the
    metrics by step, the summary's numbers in its summary, the plots as images. W&B's own
    variables apply (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_ENTITY``, ``WANDB_SILENT``);
    its console capture is off, so FedBed's output stays as it is."""

    name = "wandb"

    def start(self, identity: RunIdentity, parameters: dict[str, Scalar]) -> None:
        import wandb

        self.run = wandb.init(project=identity.experiment, name=identity.name, config={**parameters, **identity.tags},
                              tags=[f"{key.removeprefix('fedbed.')}:{value}" for key, value in identity.tags.items()],
                              reinit="create_new", settings=wandb.Settings(console="off"))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_summary(self, metrics: dict[str, float], summary: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)
        self.run.summary.update(metrics)

    def log_image(self, path: Path, name: str, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(path))}, step=step)

    def finish(self, succeeded: bool) -> None:
        self.run.finish(exit_code=0 if succeeded else 1)


TRACKER_CLASSES: dict[str, type[Tracker]] = {cls.name: cls for cls in (TensorBoardTracker, MlflowTracker, WandbTracker)}


def run_plots(run_dir: Path) -> list[Path]:
    """The PNGs of the run folder's ``plots/`` (``fedbed plot alignment``, ``fedbed plot features``), by path."""
    return sorted((run_dir / PLOTS_FOLDER).rglob("*.png"))


class RunTracking:
    """One run's records fed to one :class:`Tracker` in order (see the module docstring).

    With ``warn`` (a live run), a tracker call that raises prints one ``warning:`` line through
    ``warn`` and switches the tracker off for the rest of the run (a best-effort ``finish`` marks
    it failed); the run goes on, its records unchanged. Without ``warn`` (an export), the error is
    raised as :class:`TrackingError`, after the same best-effort ``finish``.
    """

    def __init__(self, tracker: Tracker | None, warn: Callable[[str], Any] | None = None) -> None:
        self.tracker = tracker
        self.warn = warn
        self.step = 0
        self.started = False

    def _call(self, action: str, *arguments: Any) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        try:
            getattr(tracker, action)(*arguments)
        except Exception as error:
            self._failed(tracker, action, error)

    def _failed(self, tracker: Tracker, action: str, error: Exception) -> None:
        """Switch ``tracker`` off after ``error`` in ``action``: one warning line (live) or a TrackingError."""
        self.tracker = None
        if action != "finish":
            try:
                tracker.finish(False)
            except Exception:  # noqa: BLE001  (the tracker is broken already; its first error is the one told)
                pass
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if self.warn is None:
            raise TrackingError(f"the {tracker.name} tracker failed ({reason})") from error
        self.warn(f"warning: the {tracker.name} tracker failed ({reason}); it is off for the rest of this run, "
                  "which goes on (its records stay complete in the run folder: `fedbed export` sends them again)")

    def begin(self, identity: Callable[[], RunIdentity], settings: dict[str, Any],
              earlier_rounds: Callable[[], Iterable[dict[str, Any]]] = tuple) -> None:
        """Start the tracked run with the identity ``identity()`` reads and its settings, then log
        the records ``earlier_rounds()`` reads (a resumed run's, or an exported run's). The two
        readers are called only when a tracker is on, and their failure is the tracker's (one
        warning, the run goes on)."""
        self.started = True
        tracker = self.tracker
        if tracker is None:
            return
        try:
            identity, earlier_rounds = identity(), list(earlier_rounds())
        except Exception as error:
            self._failed(tracker, "start", error)
            return
        self._call("start", identity, settings_as_parameters(settings))
        for record in earlier_rounds:
            self.log_round(record)

    def log_round(self, record: dict[str, Any]) -> None:
        """Log one round's record (:func:`round_metrics`) at its round."""
        self.step = int(record["round"])
        self._call("log_metrics", round_metrics(record), self.step)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        """Log the summary and the run folder's plots (:func:`run_plots`), then close the run as finished."""
        step = max(self.step, int(summary.get("rounds") or 0))
        scores = {key: value for key, value in summary.items() if key not in SUMMARY_SETTINGS}
        self._call("log_summary", numbers_of(json_safe(scores), "summary/"), summary, step)
        for path in run_plots(run_dir):
            self._call("log_image", path, path.relative_to(run_dir).with_suffix("").as_posix(), step)
        self._call("finish", True)

    def fail(self) -> None:
        """Close the run as failed (the run stopped or raised); nothing before :meth:`begin`."""
        if self.started:
            self._call("finish", False)


def make_tracker(tracker: str, run_dir: Path, tracker_uri: str | None = None) -> Tracker:
    """The :class:`Tracker` named ``tracker`` (one of :data:`TRACKERS`) for the run in ``run_dir``.

    Raises:
        TrackingError: an unknown tracker, or one whose package is missing (:func:`tracker_refusal`).
    """
    if tracker not in TRACKER_CLASSES:
        raise TrackingError(f"unknown tracker {tracker!r}; choose one of {', '.join(TRACKERS)}")
    refusal = tracker_refusal(tracker, tracker_uri)
    if refusal is not None:
        raise TrackingError(refusal)
    return TRACKER_CLASSES[tracker](run_dir, tracker_uri)


def live_tracking(tracker: str | None, run_dir: Path, tracker_uri: str | None, warn: Callable[[str], Any]) -> RunTracking:
    """The :class:`RunTracking` of a live run (a tracker that fails is switched off after one
    warning through ``warn``); one that does nothing when ``tracker`` is ``None``, or, after one
    warning, when it cannot be made (validation refuses a missing package where the run is
    submitted; a Flower ServerApp on another machine may still lack it)."""
    try:
        return RunTracking(None if tracker is None else make_tracker(tracker, run_dir, tracker_uri), warn)
    except TrackingError as error:
        warn(f"warning: {error}; this run goes on without it")
        return RunTracking(None, warn)


def export_run(run_dir: Path, tracker: str, tracker_uri: str | None = None) -> RunIdentity:
    """Send a finished run's committed records to ``tracker``, as a live run sends them
    (:class:`RunTracking`): its settings (``config.yaml``), every round of ``rounds.jsonl``, its
    ``summary.json`` and its plots, with its identity from them (the data and source
    fingerprints the summary records, the sweep job's hash from the folder). Return the identity.

    Raises:
        TrackingError: no finished run in ``run_dir`` (its ``config.yaml`` or ``summary.json``
            missing), a tracker that is unknown or not installed, or one that refused a call.
    """
    for name in (CONFIG_NAME, SUMMARY_NAME):
        if not (run_dir / name).is_file():
            raise TrackingError(f"{run_dir} holds no finished run ({name} is missing)")
    settings = yaml.safe_load((run_dir / CONFIG_NAME).read_text()) or {}
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    identity = run_identity(run_dir, settings, summary.get("data_fingerprint"), "+".join(run_sources(summary)))
    tracking = RunTracking(make_tracker(tracker, run_dir, tracker_uri))
    tracking.begin(lambda: identity, settings, lambda: read_log(run_dir))
    tracking.finish(summary, run_dir)
    return identity
