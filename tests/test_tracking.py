"""Experiment trackers (``fedbed.tracking``): a tiny in-process run per tool, each tool's own store
read back with the tool's own reader (TensorBoard's ``EventAccumulator``, MLflow's ``MlflowClient``,
W&B's record protobuf), a tracker failing mid-run, ``fedbed export`` of a run and of a sweep
folder, and the settings' place outside a sweep job's hash.

Every store lives in the test's ``tmp_path`` (the working directory too: MLflow keeps artifacts
there). MLflow's store is a ``file:`` one: creating a new ``sqlite:`` store's schema takes about
7 s on 2 cores, and the client calls FedBed makes are the same for any store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedbed.cli import app
from fedbed.config import PLACEMENT_SETTINGS, RESUMABLE_CHANGES, ConfigError, validate
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.provenance import source_fingerprint
from fedbed.run_directory import COMMITTED_FILES, LOG_NAME, SUMMARY_NAME, SWEEP_RECORD, TENSORBOARD_FOLDER
from fedbed.tracking import (
    RunIdentity,
    RunTracking,
    TensorBoardTracker,
    Tracker,
    TrackingError,
    round_metrics,
    settings_as_parameters,
)

runner = CliRunner()
TINY = dict(rounds=1, local_steps=1, model="lenet")
"""One round of one local step of LeNet on the embedded MNIST sample (about 1 s; the TensorBoard
test resumes it to a second round)."""


@pytest.fixture(autouse=True)
def stores_in_tmp_path(tmp_path, monkeypatch):
    """Every tracker's files under ``tmp_path``: W&B offline and silent, MLflow's default store a
    ``file:`` store there, the working directory there."""
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())


@pytest.fixture(scope="module")
def untracked_run(tmp_path_factory) -> Path:
    """The tiny run without a tracker: what every tracked run's records must equal."""
    run_dir = tmp_path_factory.mktemp("untracked") / "run"
    run_experiment(ExperimentConfig(run_dir=run_dir, **TINY), progress=False, echo=lambda *_: None)
    return run_dir


def tracked_run(run_dir: Path, tracker: str, **settings) -> list[str]:
    """Run the tiny run with ``tracker`` into ``run_dir``; return what it printed."""
    printed: list[str] = []
    run_experiment(ExperimentConfig(run_dir=run_dir, tracker=tracker, **{**TINY, **settings}), progress=False,
                   echo=printed.append)
    return printed


def records_without_timings(run_dir: Path) -> list[dict]:
    from fedbed.run_result import read_log, without_timings

    return [without_timings(record) for record in read_log(run_dir)]


def scores(run_dir: Path) -> dict:
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    return {"selection": summary["selection"], "collapse": summary["collapse"], "faults": summary["faults"],
            "data_fingerprint": summary["data_fingerprint"]}


def assert_same_records(run_dir: Path, untracked: Path) -> None:
    """The tracked run's records equal the untracked run's (timings aside)."""
    assert records_without_timings(run_dir) == records_without_timings(untracked)
    assert scores(run_dir) == scores(untracked)


def logged_rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LOG_NAME).read_text().splitlines()]


def event_accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator(run_dir)
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_logs_a_live_run_a_resumption_and_an_export_alike(tmp_path, untracked_run):
    run_dir = tmp_path / "run"
    printed = tracked_run(run_dir, "tensorboard")
    assert not [line for line in printed if "warning" in line]
    assert_same_records(run_dir, untracked_run)
    logged = logged_rounds(run_dir)
    scalars = tensorboard_scalars(run_dir)
    # Every number of every round at its round, and only numbers: no list (the cosine matrix) made a scalar.
    for record in logged:
        for key, value in round_metrics(record).items():
            assert scalars[key][record["round"] - 1] == (record["round"], pytest.approx(value, rel=1e-6))
    assert [step for step, _ in scalars["evaluation/ood/0"]] == [1]
    assert not any(tag.startswith(("alignment/cosine", "selected", "evaluation/round")) for tag in scalars)
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    assert scalars["summary/selection/train_domain_val/ood_mean"] == [
        (1, pytest.approx(summary["selection"]["train_domain_val"]["ood_mean"], rel=1e-6))]
    assert "summary/hp/client_lr" not in scalars  # a setting, logged as a parameter
    # The settings and the identity as hparams.
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = event_accumulator(run_dir).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["hp/client_lr"].number_value == pytest.approx(summary["hp"]["client_lr"])
    assert hparams["tracker"].string_value == "tensorboard"
    assert hparams["fedbed.data_fingerprint"].string_value == summary["data_fingerprint"]
    assert hparams["fedbed.source_fingerprint"].string_value == source_fingerprint()
    assert "fedbed.sweep_job" not in hparams  # not in a sweep folder

    # Resumed to a second round: the folder is rewritten, the earlier round replayed, each round once.
    run_experiment(ExperimentConfig(run_dir=run_dir, tracker="tensorboard", **{**TINY, "rounds": 2}), resume=True,
                   progress=False, echo=lambda *_: None)
    resumed = tensorboard_scalars(run_dir)
    assert [step for step, _ in resumed["evaluation/ood/0"]] == [1, 2]
    assert resumed["evaluation/ood/0"][:1] == scalars["evaluation/ood/0"]
    assert [value for _, value in resumed["metrics/train_loss"]] == pytest.approx(
        [record["metrics"]["train_loss"] for record in logged_rounds(run_dir)], rel=1e-6)
    assert len(list((run_dir / TENSORBOARD_FOLDER).iterdir())) == 1

    # An export of the committed records gives the live run's scalars, plots added as images.
    from PIL import Image

    (run_dir / "plots" / "cosine").mkdir(parents=True)
    Image.new("RGB", (12, 8), (200, 30, 30)).save(run_dir / "plots" / "cosine" / "round_0001.png")
    exported = runner.invoke(app, ["export", str(run_dir), "--to", "tensorboard"])
    assert exported.exit_code == 0, exported.output
    assert tensorboard_scalars(run_dir) == resumed
    images = event_accumulator(run_dir).Images("plots/cosine/round_0001")
    assert [(image.step, image.width, image.height) for image in images] == [(2, 12, 8)]


def test_mlflow_logs_a_live_run_into_its_tracking_uri(tmp_path, untracked_run):
    from mlflow import MlflowClient

    store = (tmp_path / "chosen-store").as_uri()
    run_dir = tmp_path / "run"
    printed = tracked_run(run_dir, "mlflow", tracker_uri=store)
    assert not [line for line in printed if "warning" in line]
    assert_same_records(run_dir, untracked_run)
    assert not (tmp_path / "mlruns").exists()  # tracker_uri, not $MLFLOW_TRACKING_URI
    client = MlflowClient(tracking_uri=store)
    (tracked,) = client.search_runs([client.get_experiment_by_name("fedbed").experiment_id])
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    assert tracked.info.status == "FINISHED"
    assert tracked.info.run_name == "fedavg on RotatedMNIST, target 0, seed 0"
    assert {key: value for key, value in tracked.data.tags.items() if key.startswith("fedbed.")} == {
        "fedbed.data_fingerprint": summary["data_fingerprint"], "fedbed.source_fingerprint": source_fingerprint()}
    settings = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert tracked.data.params == {key: str(value) for key, value in settings_as_parameters(settings).items()}
    assert tracked.data.params["hp/client_lr"] == str(settings["hp"]["client_lr"])
    history = client.get_metric_history(tracked.info.run_id, "evaluation/id_mean")
    assert [(metric.step, metric.value) for metric in history] == [
        (record["round"], pytest.approx(record["evaluation"]["id_mean"])) for record in logged_rounds(run_dir)]
    assert tracked.data.metrics["summary/selection/last/ood_mean"] == pytest.approx(summary["selection"]["last"]["ood_mean"])
    artifact = client.download_artifacts(tracked.info.run_id, SUMMARY_NAME, str(tmp_path / "downloaded"))
    assert json.loads(Path(artifact).read_text()) == summary


def wandb_records(path: Path) -> list:
    """The records of a W&B ``.wandb`` file, parsed with W&B's own protobuf ``Record``: the file is a
    7-byte header (``:W&B``, magic, version) and LevelDB's log format (32 KiB blocks of chunks, each
    a 4-byte checksum, a 2-byte little-endian length, a 1-byte type: full, first, middle, last).
    W&B 0.31 ships no reader of it, and an offline run writes its config and summary nowhere else."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's trailer, too short for a chunk header
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_wandb_logs_a_live_run_offline(tmp_path, untracked_run):
    run_dir = tmp_path / "run"
    printed = tracked_run(run_dir, "wandb")
    assert not [line for line in printed if "warning" in line]
    assert_same_records(run_dir, untracked_run)
    (written,) = (tmp_path / "wandb-files").glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(written)
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    assert run.project == "fedbed" and run.display_name == "fedavg on RotatedMNIST, target 0, seed 0"
    assert sorted(run.tags) == sorted([f"data_fingerprint:{summary['data_fingerprint']}",
                                       f"source_fingerprint:{source_fingerprint()}"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["hp/client_lr"] == summary["hp"]["client_lr"] and config["tracker"] == "wandb"
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]
    assert [(row["_step"], row["evaluation/ood_mean"]) for row in rows] == [
        (record["round"], pytest.approx(record["evaluation"]["ood_mean"])) for record in logged_rounds(run_dir)]
    updated = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for record in records if record.WhichOneof("record_type") == "summary" for item in record.summary.update}
    assert updated["summary/selection/oracle/ood_mean"] == pytest.approx(summary["selection"]["oracle"]["ood_mean"])
    exits = [record.exit.exit_code for record in records if record.WhichOneof("record_type") == "exit"]
    assert exits == [0]


def test_a_tracker_failing_mid_run_is_told_once_and_the_run_goes_on(tmp_path, monkeypatch, untracked_run):
    calls = []

    def full_disk(self, metrics, step):
        calls.append(step)
        raise OSError("No space left on device\nsecond line")

    monkeypatch.setattr(TensorBoardTracker, "log_metrics", full_disk)
    run_dir = tmp_path / "run"
    printed = tracked_run(run_dir, "tensorboard")
    warnings = [line for line in printed if "warning" in line]
    assert warnings == ["warning: the tensorboard tracker failed (OSError: No space left on device); it is off for the "
                        "rest of this run, which goes on (its records stay complete in the run folder: `fedbed export` "
                        "sends them again)"]
    assert calls == [1]  # switched off after the first failure
    assert_same_records(run_dir, untracked_run)
    assert sorted(path.name for path in run_dir.iterdir() if path.name in COMMITTED_FILES) == sorted(
        path.name for path in untracked_run.iterdir() if path.name in COMMITTED_FILES)


class Recorder(Tracker):
    """A tracker that records its calls and raises in one chosen method."""

    name = "recorder"

    def __init__(self, failing: str | None = None) -> None:
        super().__init__(Path("."))
        self.failing, self.calls = failing, []

    def _record(self, method: str, *arguments) -> None:
        self.calls.append((method, *arguments))
        if method == self.failing:
            raise RuntimeError(f"{method} broke")

    def start(self, identity, parameters):
        self._record("start", identity.name)

    def log_metrics(self, metrics, step):
        self._record("log_metrics", step)

    def log_summary(self, metrics, summary, step):
        self._record("log_summary", step)

    def log_image(self, path, name, step):
        self._record("log_image", name, step)

    def finish(self, succeeded):
        self._record("finish", succeeded)


RECORDS = [{"round": 1, "metrics": {"train_loss": 2.0}, "evaluation": None},
           {"round": 2, "metrics": {"train_loss": 1.5}, "evaluation": {"round": 2, "id_mean": 50.0, "top_class": {"id": [3, 0.4]}}}]
IDENTITY = RunIdentity("a run", "fedbed", {"fedbed.data_fingerprint": "d", "fedbed.source_fingerprint": "s"})


@pytest.mark.parametrize("failing", ["start", "log_metrics", "log_summary", "log_image", "finish"])
def test_a_failing_call_warns_once_and_switches_the_tracker_off(tmp_path, failing):
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "a.png").write_bytes(b"")
    tracker, warnings = Recorder(failing), []
    tracking = RunTracking(tracker, warnings.append)
    tracking.begin(lambda: IDENTITY, {"hp": {"lr": 0.1}}, lambda: RECORDS[:1])
    tracking.log_round(RECORDS[1])
    tracking.finish({"rounds": 2}, tmp_path)
    made = [call[0] for call in tracker.calls]
    every = ["start", "log_metrics", "log_metrics", "log_summary", "log_image", "finish"]
    assert made[:made.index(failing) + 1] == every[:every.index(failing) + 1]
    # After the failure, only the best-effort close as failed (none when closing failed).
    assert tracker.calls[made.index(failing) + 1:] == ([] if failing == "finish" else [("finish", False)])
    assert len(warnings) == 1 and f"RuntimeError: {failing} broke" in warnings[0]
    never_begun = Recorder()
    RunTracking(never_begun, warnings.append).fail()  # a run stopped before its rounds began: no call
    assert never_begun.calls == []
    with pytest.raises(TrackingError, match=f"the recorder tracker failed \\(RuntimeError: {failing} broke\\)"):
        exporting = RunTracking(Recorder(failing))  # an export raises instead
        exporting.begin(lambda: IDENTITY, {}, lambda: RECORDS)
        exporting.finish({"rounds": 2}, tmp_path)


def test_the_identity_and_earlier_rounds_are_read_only_for_a_tracker_and_their_failure_is_the_trackers():
    def unreadable():
        raise ValueError("sweep.yaml is not YAML")

    RunTracking(None, [].append).begin(unreadable, {}, unreadable)  # no tracker: nothing is read, nothing raised
    tracker, warnings = Recorder(), []
    tracking = RunTracking(tracker, warnings.append)
    tracking.begin(unreadable, {}, lambda: RECORDS)
    tracking.log_round(RECORDS[1])
    assert tracker.calls == [("finish", False)] and tracking.tracker is None
    assert len(warnings) == 1 and "ValueError: sweep.yaml is not YAML" in warnings[0]
    read = Recorder()
    RunTracking(read, warnings.append).begin(lambda: IDENTITY, {}, lambda: RECORDS)
    assert [call[0] for call in read.calls] == ["start", "log_metrics", "log_metrics"]


def test_round_metrics_are_the_records_numbers_by_flattened_key():
    record = {"round": 3, "metrics": {"train_loss": 0.5}, "dropped": {"1": "timed out"}, "kept_previous_model": None,
              "alignment": {"cosine": [[1.0, 0.2], [0.2, 1.0]], "conflicting_pairs": 0},
              "telemetry": {"weights": {"0": 0.25, "1": 0.75}, "masked": True},
              "evaluation": {"round": 3, "id": {"a&b": 70.0}, "ood_mean": None}, "seconds": 1.5}
    assert round_metrics(record) == {"metrics/train_loss": 0.5, "alignment/conflicting_pairs": 0.0,
                                     "telemetry/weights/0": 0.25, "telemetry/weights/1": 0.75,
                                     "evaluation/id/a&b": 70.0, "seconds": 1.5}
    assert settings_as_parameters({"hp": {"mu": 0.01}, "domain_names": ["a", "b"], "device": None, "mixstyle": True}) == {
        "hp/mu": 0.01, "domain_names": '["a", "b"]', "device": "null", "mixstyle": True}


def copy_committed(source: Path, destination: Path) -> Path:
    destination.mkdir(parents=True)
    for name in COMMITTED_FILES:
        if (source / name).exists():
            shutil.copy(source / name, destination / name)
    return destination


def test_export_replays_every_finished_run_of_a_sweep_folder(tmp_path, untracked_run):
    from mlflow import MlflowClient
    from PIL import Image

    sweep = tmp_path / "sweep"
    job = copy_committed(untracked_run, sweep / "0123456789ab")
    (job / "plots").mkdir()
    Image.new("RGB", (10, 10)).save(job / "plots" / "alignment_over_rounds.png")
    (sweep / SWEEP_RECORD).write_text(yaml.safe_dump({"name": "tiny-sweep", "algorithms": ["fedavg"]}))
    (sweep / "unfinished").mkdir()
    shutil.copy(untracked_run / "config.yaml", sweep / "unfinished" / "config.yaml")
    store = (tmp_path / "export-store").as_uri()
    exported = runner.invoke(app, ["export", str(sweep), "--to", "mlflow", "--tracker-uri", store])
    assert exported.exit_code == 0, exported.output
    assert "1 run(s) exported to mlflow" in exported.output
    client = MlflowClient(tracking_uri=store)
    (tracked,) = client.search_runs([client.get_experiment_by_name("tiny-sweep").experiment_id])
    summary = json.loads((job / SUMMARY_NAME).read_text())
    assert tracked.info.status == "FINISHED" and tracked.info.run_name.endswith("[0123456789ab]")
    assert tracked.data.tags["fedbed.sweep_job"] == "0123456789ab"
    assert tracked.data.tags["fedbed.data_fingerprint"] == summary["data_fingerprint"]
    # The code that made the run, from its summary: not necessarily this code.
    assert tracked.data.tags["fedbed.source_fingerprint"] == "+".join(
        dict.fromkeys(start["source"] for start in summary["provenance"]))
    history = client.get_metric_history(tracked.info.run_id, "metrics/train_loss")
    assert [(metric.step, metric.value) for metric in history] == [
        (record["round"], pytest.approx(record["metrics"]["train_loss"])) for record in logged_rounds(job)]
    assert [item.path for item in client.list_artifacts(tracked.info.run_id, "plots")] == [
        "plots/alignment_over_rounds.png"]
    # A folder without a finished run, and an unknown tracker: one line, exit 2.
    for arguments in (["export", str(sweep / "unfinished"), "--to", "mlflow"], ["export", str(job), "--to", "neptune"],
                      ["export", str(job), "--to", "tensorboard", "--tracker-uri", store]):
        refused = runner.invoke(app, arguments)
        assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output


def test_the_tracker_settings_change_no_sweep_job_hash_and_may_change_on_resume():
    from fedbed.sweep import SweepSpec, config_hash, expand

    plain = ExperimentConfig(**TINY)
    assert config_hash(plain) == config_hash(ExperimentConfig(tracker="mlflow", tracker_uri="sqlite:///x.db", **TINY))
    assert config_hash(ExperimentConfig()) == "76948cfca052"  # the hash of a job made before trackers existed
    assert {"tracker", "tracker_uri"} <= PLACEMENT_SETTINGS <= RESUMABLE_CHANGES
    folders = [[job.run_dir.name for job in expand(SweepSpec(algorithms=["fedavg"], targets=["0", "15"], base=base), Path("s"))]
               for base in (dict(TINY), {**TINY, "tracker": "tensorboard"})]
    assert folders[0] == folders[1] and len(set(folders[0])) == 2


def test_a_missing_package_or_a_misplaced_uri_is_refused_in_one_line(monkeypatch, tmp_path):
    import importlib.util

    import fedbed.tracking as tracking

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "mlflow" else real_find_spec(name, *rest))
    with pytest.raises(ConfigError, match=r"^tracker: mlflow needs the mlflow package: pip install 'fedbed\[mlflow\]'$"):
        validate(ExperimentConfig(tracker="mlflow", **TINY))
    for arguments in (["run", "--tracker", "mlflow", "--run-dir", str(tmp_path / "a")],
                      ["run", "--tracker", "neptune", "--run-dir", str(tmp_path / "b")],
                      ["run", "--tracker", "wandb", "--tracker-uri", "http://localhost:5000", "--run-dir", str(tmp_path / "c")]):
        refused = runner.invoke(app, arguments)
        assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
        assert not (tmp_path / arguments[-1]).exists()
    assert "pip install 'fedbed[mlflow]'" in runner.invoke(app, ["export", str(tmp_path), "--to", "mlflow"]).output


def test_the_flower_server_runs_the_tracked_engine(monkeypatch):
    """A Flower run is tracked where its ServerApp runs the engine: ``server_main`` hands its built
    run, tracker settings included, to :func:`fedbed.experiment.execute_run` (the hook's home;
    checked by hand on ``flower-sim``: its TensorBoard scalars equal its log, see the module
    docstring of ``fedbed.tracking``). A real simulation costs about a minute."""
    import fedbed.experiment as experiment
    from fedbed.flower import apps

    assert apps.execute_run is experiment.execute_run
    handed = {}
    monkeypatch.setattr(apps, "FlowerClients", lambda grid, num_clients, **options: object())  # no SuperLink to reach
    monkeypatch.setattr(apps, "execute_run", lambda built, federation, **options: handed.update(config=built.config))
    validated = validate(ExperimentConfig(tracker="tensorboard", **TINY))
    apps.server_main(None, validated.config.model_dump_json(), "flower-sim", echo=lambda *_: None, digest=validated.digest)
    assert handed["config"].tracker == "tensorboard"
