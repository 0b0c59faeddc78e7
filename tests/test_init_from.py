"""A warm start (``init_from``): a run begins from another run's global model; recorded in the
config, the provenance, the summary and the reports' labels; refused when it cannot fit; resumed
bit for bit."""

import json

import pytest
import torch
import yaml

from fedbed.algorithms.base.local_training import SupervisedTrainer
from fedbed.config import ConfigError, validate
from fedbed.experiment import ExperimentConfig, build_run, run_experiment
from fedbed.run_directory import CHECKPOINT_NAME, CONFIG_NAME, PROVENANCE_NAME
from tests.helpers import run_straight_and_resumed

QUIET = dict(progress=False, echo=lambda *_: None)
SMALL = dict(model="lenet", local_steps=2, batch_size=16)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished two-round FedAvg run (its checkpoint holds the round-2 global model)."""
    run_dir = tmp_path_factory.mktemp("source") / "fedavg"
    run_experiment(ExperimentConfig(algorithm="fedavg", rounds=2, run_dir=run_dir, **SMALL), **QUIET)
    return run_dir


def test_a_warm_start_begins_from_the_source_runs_global_model_and_says_so(source, tmp_path):
    saved = torch.load(source / CHECKPOINT_NAME, weights_only=False)["strategy"]["model"]
    config = ExperimentConfig(algorithm="fedprox", rounds=1, init_from=source, run_dir=tmp_path / "warm", **SMALL)
    strategy = build_run(config).federation(clients=None).strategy
    assert all(torch.equal(strategy.global_model().state_dict()[name], saved[name]) for name in saved)
    cold = build_run(config.model_copy(update={"init_from": None})).federation(clients=None).strategy
    assert not torch.equal(cold.global_model().state_dict()["classifier.weight"], saved["classifier.weight"])
    summary = run_experiment(config, **QUIET)
    record = summary["init_from"]
    assert record["algorithm"] == "fedavg" and record["round"] == 2 and record["run"] == str(source)
    assert len(record["model_digest"]) == 16
    assert yaml.safe_load((tmp_path / "warm" / CONFIG_NAME).read_text())["init_from"] == str(source)
    starts = [json.loads(line) for line in (tmp_path / "warm" / PROVENANCE_NAME).read_text().splitlines()]
    assert starts[-1]["init_from"] == record


def test_the_reports_label_a_warm_start_with_its_source(source, tmp_path):
    from fedbed.reporting import labelled_summaries

    sweep = tmp_path / "sweep"
    for name, init in (("cold", None), ("warm", source)):
        run_experiment(ExperimentConfig(algorithm="fedavg", rounds=1, init_from=init, run_dir=sweep / name, **SMALL), **QUIET)
    assert sorted(s["label"] for s in labelled_summaries(sweep)) == ["fedavg", "fedavg{from fedavg@2}"]


def test_a_warm_start_that_cannot_fit_is_refused_in_one_line(source, tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint.pt"):
        validate(ExperimentConfig(algorithm="fedavg", init_from=tmp_path, **SMALL))
    with pytest.raises(ConfigError, match="does not fit this run's lenet \\(array featurizer"):
        build_run(ExperimentConfig(algorithm="fedsr", rounds=1, init_from=source, **SMALL)).warm_start  # noqa: B018
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="init_from: .* cannot be read"):
        build_run(ExperimentConfig(algorithm="fedavg", rounds=1, init_from=damaged, **SMALL)).warm_start  # noqa: B018


def test_a_warm_started_run_resumes_bit_for_bit(source, tmp_path, monkeypatch):
    straight, resumed, logs = run_straight_and_resumed(tmp_path, monkeypatch, SupervisedTrainer, algorithm="fedavg",
                                                       rounds=4, init_from=source, **SMALL)
    assert logs["straight"] == logs["resumed"]
    assert straight["selection"] == resumed["selection"] and straight["init_from"] == resumed["init_from"]


def test_a_sweep_starts_each_job_from_the_other_sweeps_run_of_its_own_target(tmp_path):
    from fedbed.sweep import SweepSpec, expand, run_sweep

    base = dict(dataset="RotatedMNIST", rounds=1, **SMALL)
    inits = SweepSpec(name="inits", base=base, algorithms=["fedavg", "fedprox"], targets=["0", "15"], seeds=[0])
    run_sweep(inits, tmp_path / "inits", progress=False)
    by_target = {job.target: job.run_dir for job in expand(inits, tmp_path / "inits") if job.algorithm == "fedavg"}
    warm = SweepSpec(name="warm", base=base, algorithms=["fedprox"], targets=["0", "15"], seeds=[0],
                     variants={"from_fedavg": {"init_from": {"sweep": str(tmp_path / "inits"), "algorithm": "fedavg"}}})
    jobs = expand(warm, tmp_path / "warm")
    assert {job.target: job.init_from for job in jobs} == by_target
    outcome = run_sweep(warm, tmp_path / "warm", progress=False)
    assert outcome["failed"] == {} and outcome["ran"] == 2
    for job in jobs:
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["init_from"]["run"] == str(by_target[job.target].resolve())
    # A variant per initial model of one sweep: each run's report label names its own variant.
    both = warm.model_copy(update={"variants": {
        "from_fedavg": {"init_from": {"sweep": str(tmp_path / "inits"), "algorithm": "fedavg"}},
        "from_fedprox": {"init_from": {"sweep": str(tmp_path / "inits"), "algorithm": "fedprox"}},
        "from_fedprox_mu": {"init_from": {"sweep": str(tmp_path / "inits"), "algorithm": "fedprox"}, "hp": {"mu": 0.5}}},
        "targets": ["0"]})
    assert run_sweep(both, tmp_path / "both", progress=False)["failed"] == {}
    from fedbed.results import labelled_runs

    assert sorted(run.summary["label"] for run in labelled_runs(tmp_path / "both")) == [
        "fedprox[from_fedavg]{from fedavg@1}", "fedprox[from_fedprox]{from fedprox@1}",
        "fedprox[from_fedprox_mu]{from fedprox@1}"]
    # Another seed has no initial model in that sweep; a folder without a sweep record is no sweep.
    with pytest.raises(ConfigError, match="has 0 runs of fedavg for target 0, seed 1"):
        expand(warm.model_copy(update={"seeds": [1]}), tmp_path / "warm")
    assert len(expand(warm.model_copy(update={"seeds": [1], "variants": {"from_fedavg": {"init_from": {
        "sweep": str(tmp_path / "inits"), "algorithm": "fedavg", "seed": 0}}}}), tmp_path / "warm")) == 2
    with pytest.raises(ConfigError, match="holds no sweep.yaml; run the sweep"):
        expand(warm.model_copy(update={"variants": {"v": {"init_from": {"sweep": str(tmp_path), "algorithm": "fedavg"}}}}),
               tmp_path / "warm")
    with pytest.raises(ConfigError, match="init_from.round: Extra inputs"):
        expand(warm.model_copy(update={"variants": {"v": {"init_from": {"sweep": str(tmp_path), "algorithm": "fedavg",
                                                                         "round": 3}}}}), tmp_path / "warm")
    # init_from_arrays in base, and a variant without a warm start: refused when the sweep expands.
    with pytest.raises(ConfigError, match="init_from_arrays says which arrays a warm start reads"):
        expand(warm.model_copy(update={"base": {**base, "init_from_arrays": "matching"},
                                       "variants": {**warm.variants, "from_scratch": {}}}), tmp_path / "warm")


def test_a_method_with_modules_of_its_own_starts_from_the_shared_arrays_when_asked(source, tmp_path):
    from fedbed.build import matching_arrays

    saved = torch.load(source / CHECKPOINT_NAME, weights_only=False)["strategy"]["model"]
    config = ExperimentConfig(algorithm="fedsr", rounds=1, init_from=source, init_from_arrays="matching",
                              run_dir=tmp_path / "fedsr", **SMALL)
    built = build_run(config)
    start, record = built.warm_start
    fresh = built.initial_model.state_dict()
    # FedSR wraps the featurizer's network as featurizer.backbone: those arrays are the source's.
    backbone = [name for name in start if name.startswith("featurizer.backbone.")]
    assert backbone and all(torch.equal(start[name], saved[name.replace("backbone.", "", 1)]) for name in backbone)
    same = [name for name in start if name in saved and saved[name].shape == start[name].shape]
    assert all(torch.equal(start[name], saved[name]) for name in same)
    assert record["kept_initial"] == sorted(set(start) - set(backbone) - set(same)) != []
    assert all(torch.equal(start[name], fresh[name]) for name in record["kept_initial"])
    assert run_experiment(config, **QUIET)["init_from"]["kept_initial"] == record["kept_initial"]
    # The rule by hand: same name and shape loads, another shape or a missing name stays fresh.
    loaded, kept = matching_arrays({"featurizer.a": torch.ones(2), "classifier.w": torch.ones(3)},
                                   {"featurizer.backbone.a": torch.zeros(2), "classifier.w": torch.zeros(4),
                                    "generator.w": torch.zeros(1)})
    assert list(loaded) == ["featurizer.backbone.a"] and kept == ["classifier.w", "generator.w"]
    with pytest.raises(ConfigError, match="give init_from"):
        validate(ExperimentConfig(algorithm="fedavg", init_from_arrays="matching", **SMALL))


def test_a_sweep_form_warm_start_reads_a_remade_source_runs_config_again(tmp_path):
    """``results.warm_start_from_sweep`` reads a source run's algorithm and seed once per process,
    and again after the run was remade (``--overwrite`` with another algorithm): a long-lived
    process (a notebook) never matches a variant by what the folder held before."""
    import os

    from fedbed.results import warm_start_from_sweep

    run = tmp_path / "inits" / "job"
    run.mkdir(parents=True)
    (run / CONFIG_NAME).write_text(yaml.safe_dump({"algorithm": "fedavg", "seed": 0}))
    named = {"sweep": str(tmp_path / "inits"), "algorithm": "fedavg"}
    assert warm_start_from_sweep(run, named)
    (run / CONFIG_NAME).write_text(yaml.safe_dump({"algorithm": "central", "seed": 0}))
    written = (run / CONFIG_NAME).stat()
    os.utime(run / CONFIG_NAME, ns=(written.st_atime_ns, written.st_mtime_ns + 1_000_000))  # a coarse clock
    assert not warm_start_from_sweep(run, named)
    assert warm_start_from_sweep(run, {**named, "algorithm": "central"})
