"""The command line: bad input gives one line, exit code 2, no traceback, nothing written."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from fedbed.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--dataset", "Foo"], "unknown dataset 'Foo'"),
        (["--algorithm", "fedfoo"], "unknown algorithm 'fedfoo'"),
        (["--target", "90"], "RotatedMNIST has no domain '90'"),
        (["--dataset", "PACS", "--target", "0"], "PACS has no domain '0'"),
        (["--rounds", "0"], "rounds"),
        (["--hp", "lambda=0.1"], "fedavg has no hyperparameter 'lambda'"),
        (["--hp", "oops"], "--hp expects key=value"),
        (["--data-root", "/nonexistent/folder"], "does not exist"),
        (["--id-evaluation", "site"], "id_evaluation: Input should be 'server' or 'clients'"),
        (["--dataset", "PACS"], "PACS has no default target domain; give one (--target or target:) of art_painting,"),
        (["--local-epochs", "1", "--local-steps", "1"], "give local_epochs or local_steps, not both"),
        (["--overwrite", "--resume"], "--overwrite deletes the run that --resume would continue"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(arguments, message, tmp_path):
    run_dir = tmp_path / "run"
    arguments = ["run", *arguments] + ([] if "--run-dir" in arguments else ["--run-dir", str(run_dir)])
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not run_dir.exists()


@pytest.mark.parametrize("arguments, message", [
    (["run", "--rounds", "abc"], "error: Invalid value for '--rounds': 'abc' is not a valid integer; see `"),
    (["run", "--no-such-flag"], "error: No such option '--no-such-flag'; see `"),
    (["run", "--dataset", "Foo", "--run-dir", "unused"], "error: unknown dataset 'Foo'"),
])
def test_the_fedbed_script_prints_one_line_and_exits_2(arguments, message, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "fedbed", *arguments], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr and not (tmp_path / "unused").exists()


def test_config_file_errors(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rounds: 2\nlearning_rate: 3\n")
    result = runner.invoke(app, ["run", "--config", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "unknown setting 'learning_rate'" in result.output


def test_flower_app_writes_the_run_for_flwr_run(tmp_path):
    import tomllib

    from fedbed.experiment import ExperimentConfig

    config = tmp_path / "run.yaml"
    config.write_text("algorithm: hfedf\nrounds: 3\nid_evaluation: clients\n")
    result = runner.invoke(app, ["flower-app", str(tmp_path / "job"), "--config", str(config), "--round-timeout", "60"])
    assert result.exit_code == 0, result.output
    project = tomllib.loads((tmp_path / "job" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert project["components"] == {"serverapp": "fedbed.flower.apps:server_app", "clientapp": "fedbed.flower.apps:client_app"}
    from flwr.common.config import flatten_dict, parse_config_args

    from fedbed.flower.apps import config_json_from_run_config

    settings = project["config"]["fedbed"]  # one key per setting, so --run-config can override one
    assert (settings["algorithm"], settings["rounds"], settings["id_evaluation"]) == ("hfedf", 3, "clients")
    assert "data_root" not in settings and project["config"]["fedbed-round-timeout"] == 60.0
    run_config = flatten_dict(project["config"])  # what Flower hands the apps
    written = ExperimentConfig.model_validate_json(config_json_from_run_config(run_config))
    assert (written.algorithm, written.rounds, written.id_evaluation, written.data_root) == ("hfedf", 3, "clients", None)
    overridden = {**run_config, **parse_config_args(["fedbed.rounds=40 fedbed.hp.server_lr=0.05"])}
    changed = ExperimentConfig.model_validate_json(config_json_from_run_config(overridden))
    assert (changed.rounds, changed.hp) == (40, {"server_lr": 0.05}) and changed.algorithm == "hfedf"
    config.write_text("algorithm: fedfoo\n")
    bad = runner.invoke(app, ["flower-app", str(tmp_path / "other"), "--config", str(config)])
    assert bad.exit_code == 2 and "unknown algorithm 'fedfoo'" in bad.output and not (tmp_path / "other").exists()


def test_datasets_lists_where_data_was_found(shared_data):
    result = runner.invoke(app, ["datasets", "--data-root", str(shared_data)])
    assert result.exit_code == 0
    assert "packed" in result.output and "pacs_32.npz" in result.output and "mnist.npz" in result.output


def test_data_prepare_packs_the_pacs_mini_folder_tree(shared_data, tmp_path):
    if not (shared_data / "pacs-mini").is_dir():
        pytest.skip(f"the PACS slice is not present at {shared_data / 'pacs-mini'}")
    root = tmp_path / "data"
    root.mkdir()
    (root / "PACS").symlink_to(shared_data / "pacs-mini")  # the DomainBed layout: ROOT/PACS/<domain>/<class>/<image>
    result = runner.invoke(app, ["data", "prepare", "pacs", "--size", "8", "--data-root", str(root)])
    assert result.exit_code == 0, result.output
    reported = [line.removeprefix("wrote ") for line in result.output.splitlines() if line.startswith("wrote ")]
    assert reported == [str(root / "pacs" / "pacs_8.npz")]
    with np.load(Path(reported[0])) as packed:
        assert sorted(packed.files) == ["class_names", "domain_names", "domains", "images", "labels"]
        assert packed["images"].shape == (224, 8, 8, 3) and packed["images"].dtype == np.uint8
        assert np.bincount(packed["domains"]).tolist() == [56, 56, 56, 56] and len(packed["labels"]) == 224
        assert packed["domain_names"].tolist() == ["art_painting", "cartoon", "photo", "sketch"]


def test_data_prepare_unknown_dataset_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["data", "prepare", "Foo", "--data-root", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "unknown dataset 'Foo'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_run_prints_the_table_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    base = ["run", "--rounds", "2", "--local-steps", "1", "--run-dir", str(run_dir), "--no-progress", "--model", "lenet"]
    result = runner.invoke(app, base)
    assert result.exit_code == 0, result.output
    assert "embedded MNIST sample" in result.output and "ood mean" in result.output
    assert (run_dir / "summary.json").exists()
    result = runner.invoke(app, [*base[:2], "3", *base[3:], "--resume"])
    assert result.exit_code == 0, result.output
    assert len((run_dir / "rounds.jsonl").read_text().splitlines()) == 3
    # A run folder moved elsewhere (another disk, another machine) still resumes there.
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    result = runner.invoke(app, ["run", "--rounds", "4", "--local-steps", "1", "--run-dir", str(moved), "--no-progress", "--model", "lenet", "--resume"])
    assert result.exit_code == 0, result.output
    assert len((moved / "rounds.jsonl").read_text().splitlines()) == 4
    assert yaml.safe_load((moved / "config.yaml").read_text())["run_dir"] == str(moved)


def test_plot_alignment_writes_pngs(tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["run", "--algorithm", "ppdg", "--model", "lenet", "--rounds", "2", "--local-steps", "1",
                                 "--run-dir", str(run_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["plot", "alignment", str(run_dir)])
    assert result.exit_code == 0, result.output
    pngs = sorted(p.relative_to(run_dir / "plots").as_posix() for p in (run_dir / "plots").rglob("*.png"))
    assert pngs == ["alignment_cosine_overview.png", "alignment_over_rounds.png", "cosine/round_0001.png", "cosine/round_0002.png"]
    assert all((run_dir / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    result = runner.invoke(app, ["plot", "alignment", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "does not exist" in result.output
    # A diverged round logs its non-finite cosines and norms as null; the plots still draw.
    log = run_dir / "rounds.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[1]["alignment"]["cosine"][0][1] = None
    records[1]["alignment"]["update_norms"][0] = None
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = runner.invoke(app, ["plot", "alignment", str(run_dir)])
    assert result.exit_code == 0, result.output


def test_a_run_recorded_before_a_setting_existed_agrees_with_its_default_and_differs_from_another_value(tmp_path):
    from fedbed.algorithms import get_algorithm
    from fedbed.experiment import hyperparameter_defaults, settings_differences

    hparams = get_algorithm("feddg_ga").hyperparameters()
    defaults = hyperparameter_defaults(hparams)
    here = {"algorithm": "feddg_ga", "rounds": 4, "hp": hparams.model_dump(mode="json")}
    older = {"algorithm": "feddg_ga", "rounds": 2, "hp": {k: v for k, v in here["hp"].items()
                                                          if k not in ("gap_samples", "client_optimizer_state")}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older))
    # Both keys the older run lacks are at their defaults here: nothing differs but what is allowed to.
    assert settings_differences(tmp_path, here, frozenset({"rounds"}), defaults) == []
    # Another value than the default for a key the run lacks, and a changed value: each named by its path.
    other = {**here, "hp": {**here["hp"], "gap_samples": "holdout", "client_lr": 0.5}}
    assert settings_differences(tmp_path, other, frozenset({"rounds"}), defaults) == [
        f"hp.client_lr: {here['hp']['client_lr']!r} there, 0.5 here", "hp.gap_samples: absent there, 'holdout' here"]
    # Without the defaults, a key the run lacks agrees only with None.
    assert settings_differences(tmp_path, here, frozenset({"rounds"})) == [
        "hp.client_optimizer_state: absent there, 'fresh' here", "hp.gap_samples: absent there, 'training' here"]


def test_resume_and_run_directory_guards(tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["run", "--resume", "--run-dir", str(run_dir)])
    assert result.exit_code == 2 and "cannot resume" in result.output and not run_dir.exists()
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    result = runner.invoke(app, ["run", "--run-dir", str(other)])
    assert result.exit_code == 2 and "holds no FedBed run" in result.output
    assert (other / "notes.txt").read_text() == "keep me"
    base = ["run", "--rounds", "1", "--local-steps", "1", "--run-dir", str(run_dir), "--no-progress", "--model", "lenet"]
    assert runner.invoke(app, base).exit_code == 0
    result = runner.invoke(app, [*base, "--resume", "--algorithm", "ppdg"])
    assert result.exit_code == 2 and "settings differ (algorithm: 'fedavg' there, 'ppdg' here" in result.output
    # A finished run whose checkpoint was deleted (to save disk): --resume refuses, keeping its results.
    summary = (run_dir / "summary.json").read_text()
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")  # damaged, or from another version of the code
    result = runner.invoke(app, [*base, "--resume", "--rounds", "2"])
    assert result.exit_code == 1 and "does not fit this run" in result.output and "Traceback" not in result.output
    (run_dir / "checkpoint.pt").unlink()
    result = runner.invoke(app, [*base, "--resume"])
    assert result.exit_code == 2 and "checkpoint.pt is gone" in result.output and "--overwrite" in result.output
    assert (run_dir / "summary.json").read_text() == summary and (run_dir / "rounds.jsonl").read_text().strip()
    # Stopped before its first round ended (settings written, no checkpoint): --resume starts it over.
    finished = json.loads(summary)["selection"]
    for name in ("summary.json", "rounds.jsonl"):
        (run_dir / name).unlink()
    result = runner.invoke(app, [*base, "--resume"])
    assert result.exit_code == 0 and "nothing to resume" in result.output and "starting it over" in result.output
    assert json.loads((run_dir / "summary.json").read_text())["selection"] == finished


def test_a_run_with_other_settings_is_never_replaced_without_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    base = ["run", "--rounds", "1", "--local-steps", "1", "--run-dir", str(run_dir), "--no-progress"]
    assert runner.invoke(app, base).exit_code == 0
    finished = (run_dir / "summary.json").read_text()
    result = runner.invoke(app, [*base, "--seed", "3"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "holds a run with other settings (seed: 0 there, 3 here); choose another --run-dir, or pass --overwrite" in result.output
    assert (run_dir / "summary.json").read_text() == finished
    same = runner.invoke(app, base)  # the same settings again: a finished run is not redone silently either
    assert same.exit_code == 2 and "holds a finished run with these settings; pass --overwrite" in same.output
    assert (run_dir / "summary.json").read_text() == finished
    (run_dir / "summary.json").unlink()  # an unfinished run with the same settings is redone in place, and said so
    redone = runner.invoke(app, base)
    assert redone.exit_code == 0 and "replacing the unfinished earlier run with the same settings" in redone.output
    assert runner.invoke(app, [*base, "--seed", "3", "--overwrite"]).exit_code == 0
    assert json.loads((run_dir / "summary.json").read_text())["seed"] == 3


def test_names_are_stored_in_their_canonical_spelling(tmp_path, monkeypatch):
    from fedbed.config import config_from_mapping

    typed = config_from_mapping({"dataset": "pacs", "algorithm": "MCGDM", "target": "Photo"})
    assert (typed.dataset, typed.algorithm, typed.target) == ("PACS", "mcgdm", "photo")
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("dataset: rotatedmnist\nalgorithm: FedAvg\ntarget: 15\nrounds: 1\nlocal_steps: 1\n")
    result = runner.invoke(app, ["run", "--config", "run.yaml", "--no-progress"])
    assert result.exit_code == 0, result.output
    run_dir = Path("runs") / "RotatedMNIST" / "fedavg" / "15" / "seed0"
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (stored["dataset"], stored["algorithm"], stored["target"]) == ("RotatedMNIST", "fedavg", "15")
    assert (summary["dataset"], summary["algorithm"], summary["target"]) == ("RotatedMNIST", "fedavg", "15")


def test_version():
    from fedbed import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"fedbed {__version__}"


def test_algorithms_show_the_values_a_run_on_a_dataset_uses_and_their_source():
    general = runner.invoke(app, ["algorithms", "ppdg"])
    assert general.exit_code == 0 and "alignment_lambda=0.1" in general.output
    assert "on RotatedMNIST (its paper's values): alignment_lambda=0.001" in general.output
    from fedbed.algorithms import get_algorithm

    for key, distribution in get_algorithm("ppdg").search_space().items():  # one method: each range's source
        assert f"  {key}: {distribution.source}\n" in general.output
    listing = runner.invoke(app, ["algorithms"]).output
    assert "hparams_registry.py" not in listing  # the full list stays one line of distributions per method
    on_mnist = runner.invoke(app, ["algorithms", "PPDG", "--dataset", "rotatedmnist"])
    assert "alignment_lambda=0.001 [paper's value on RotatedMNIST]" in on_mnist.output
    assert "client_lr=0.001," in on_mnist.output and "client_lr=0.001 [" not in on_mnist.output
    unknown = runner.invoke(app, ["algorithms", "fedfoo"])
    assert unknown.exit_code == 2 and "unknown algorithm 'fedfoo'" in unknown.output
    mcgdm = runner.invoke(app, ["algorithms", "mcgdm", "--dataset", "pacs"])
    assert ("run settings on PACS (its paper's, where a run leaves them unset): rounds=40, local_epochs=1, "
            "batch_size=16, mixstyle=True") in mcgdm.output


def test_algorithms_name_the_measured_failures_of_a_methods_defaults_and_their_docs():
    from fedbed.algorithms import ALGORITHMS

    repository = Path(__file__).resolve().parents[1]
    for algorithm in ALGORITHMS.values():
        for dataset, failure in algorithm.measured_failures.items():
            assert dataset in algorithm.dataset_run_settings or dataset in algorithm.dataset_defaults, (algorithm.name, dataset)
            cited = re.findall(r"docs/results/[\w.-]+\.md", failure)
            assert cited and all((repository / path).is_file() for path in cited), (algorithm.name, failure)
    on_pacs = runner.invoke(app, ["algorithms", "mcgdm", "--dataset", "pacs"])
    assert "measured failure on PACS: " in on_pacs.output and "docs/results/pacs32-mcgdm.md" in on_pacs.output
    on_vlcs = runner.invoke(app, ["algorithms", "mcgdm", "--dataset", "vlcs"])
    assert on_vlcs.exit_code == 0 and "measured failure" not in on_vlcs.output
    composed = runner.invoke(app, ["algorithms", "mcgdm+ppdg"])
    assert "measured failure on PACS: mcgdm: at 32 px from scratch" in composed.output
    every = runner.invoke(app, ["algorithms"])
    assert every.output.count("measured failure on PACS: ") == sum("PACS" in a.measured_failures for a in ALGORITHMS.values())
