"""A method's clients under another's server rule (``CLIENT+SERVER``): refusals, hyperparameters,
FedAvg on either side changes nothing (bit for bit on one machine), sweeps and reports."""

import json

import pytest
import torch
import yaml

from fedbed.algorithms import AlgorithmError, get_algorithm, resolve_hyperparameters, server_rules
from fedbed.algorithms.fedomg import FedOMGAggregation
from fedbed.algorithms.mcgdm import MCGDMStrategy
from fedbed.config import ConfigError, validate
from fedbed.experiment import ExperimentConfig, build_run, run_experiment
from fedbed.run_directory import LOG_NAME

QUIET = dict(progress=False, echo=lambda *_: None)


def test_the_server_rules_are_the_methods_whose_server_alone_differs_from_fedavg():
    assert server_rules() == ["agrrand", "agrsum", "fedavg", "fedavg_global_alignment", "feddg_ga", "fedgma", "fedomg",
                              "pcgrad", "ppdg"]


@pytest.mark.parametrize("name, reason", [
    ("hfedf+fedomg", "generates each client's weights"),
    ("local+ppdg", "no global model"),
    ("central+ppdg", "pools every source domain"),
    ("ppdg+fedomg", "write fedavg\\+fedomg, or ppdg alone"),
    ("mcgdm+fedsr", "fedsr is not a server rule"),
    ("fedsimclr+feddg_ga", "label-free representation"),
    ("mcgdm+fedomg+ppdg", "two names"),
    ("mcgdm+nosuch", "unknown algorithm 'nosuch'"),
])
def test_a_pair_that_cannot_work_together_is_refused_with_the_reason(name, reason):
    with pytest.raises(AlgorithmError, match=reason):
        get_algorithm(name)
    with pytest.raises(ConfigError, match=reason):
        validate(ExperimentConfig(algorithm=name, model="lenet"))


def test_a_composed_method_has_both_sides_hyperparameters_and_a_clash_is_renamed():
    composed = get_algorithm("MCGDM+FedOMG")
    assert composed.name == "mcgdm+fedomg"
    hparams = resolve_hyperparameters(composed, {"matching_lambda": 0.5, "search_radius": 0.25}, "PACS")
    client, server = composed.sides(hparams)
    assert client.matching_lambda == 0.5 and client.client_optimizer == "sgd"  # MCGDM's optimiser
    assert server.search_radius == 0.25 and server.client_optimizer == "sgd"
    with pytest.raises(AlgorithmError, match="mcgdm\\+fedomg has no hyperparameter 'nosuch'"):
        resolve_hyperparameters(composed, {"nosuch": 1})
    both = get_algorithm("fedadg+feddg_ga")  # both have a 'reading'
    hparams = resolve_hyperparameters(both, {"reading": "authors_code", "server_reading": "paper"})
    assert [side.reading for side in both.sides(hparams)] == ["authors_code", "paper"]
    assert get_algorithm("fedavg+ppdg").dataset_defaults["RotatedMNIST"] == {"alignment_lambda": 0.001}
    assert get_algorithm("fedavg+ppdg").dataset_run_settings["RotatedMNIST"] == {"holdout_fraction": 0.1}
    assert get_algorithm("mcgdm+ppdg").dataset_run_settings["PACS"]["rounds"] == 40  # the client method's


def test_the_rule_replaces_the_average_while_the_client_methods_server_still_sends_its_arrays(tmp_path):
    built = build_run(ExperimentConfig(algorithm="mcgdm+fedomg", model="lenet", rounds=1, local_steps=1, run_dir=tmp_path))
    strategy = built.federation(clients=None).strategy
    assert isinstance(strategy, MCGDMStrategy) and isinstance(strategy.aggregation, FedOMGAggregation)


def test_robust_aggregation_is_refused_beside_a_rule_that_needs_each_update_but_not_beside_fedavg():
    with pytest.raises(ConfigError, match="mcgdm\\+fedomg's server needs each client's own update"):
        validate(ExperimentConfig(algorithm="mcgdm+fedomg", model="lenet", robust_aggregation="median"))
    validate(ExperimentConfig(algorithm="fedsr+fedavg", model="lenet", robust_aggregation="median"))


def log_of(run_dir):
    return [json.loads(line) for line in (run_dir / LOG_NAME).read_text().splitlines()]


def final_state(run_dir):
    from fedbed.run_directory import CHECKPOINT_NAME

    return torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)["strategy"]["model"]


@pytest.mark.parametrize("composed, plain", [("fedavg+ppdg", "ppdg"), ("mcgdm+fedavg", "mcgdm"),
                                             ("fedavg+feddg_ga", "feddg_ga")])
def test_fedavg_on_either_side_equals_the_plain_method_bit_for_bit(tmp_path, composed, plain):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in (composed, plain):
            run_experiment(ExperimentConfig(algorithm=name, model="lenet", rounds=2, local_steps=2, batch_size=16,
                                            run_dir=tmp_path / name), **QUIET)
    finally:
        torch.set_num_threads(threads)
    composed_log, plain_log = log_of(tmp_path / composed), log_of(tmp_path / plain)
    assert [r["metrics"] for r in composed_log] == [r["metrics"] for r in plain_log]
    assert [r["telemetry"] for r in composed_log] == [r["telemetry"] for r in plain_log]
    first, second = final_state(tmp_path / composed), final_state(tmp_path / plain)
    assert all(torch.equal(first[name], second[name]) for name in first)
    summary = json.loads((tmp_path / composed / "summary.json").read_text())
    assert summary["algorithm"] == composed  # every report labels it CLIENT+SERVER


def test_a_sweep_grid_holds_composed_methods_and_their_report_labels_them(tmp_path):
    from fedbed.reporting import labelled_summaries
    from fedbed.sweep import SweepSpec, expand, run_sweep

    spec = SweepSpec(name="composed", base={"model": "lenet", "rounds": 1, "local_steps": 1, "batch_size": 16},
                     algorithms=["fedavg", "fedsr+fedomg"], targets=["0"], seeds=[0],
                     hp={"fedsr+fedomg": {"search_radius": [0.0, 0.5]}})
    jobs = expand(spec, tmp_path)
    assert [(job.algorithm, job.hp) for job in jobs] == [("fedavg", {}), ("fedsr+fedomg", {"search_radius": 0.0}),
                                                        ("fedsr+fedomg", {"search_radius": 0.5})]
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    run_sweep(spec, tmp_path, progress=False)
    labels = sorted(summary["label"] for summary in labelled_summaries(tmp_path))
    assert labels == ["fedavg", "fedsr+fedomg(search_radius=0.0)", "fedsr+fedomg(search_radius=0.5)"]
