"""Every registered algorithm on tiny data, plus hand-computed cases of the shared math."""

import json
import re

import pytest
import torch
from torch import nn

from fedbed.algorithms import (
    ALGORITHMS,
    AlgorithmError,
    get_algorithm,
    resolve_hyperparameters,
)
from fedbed.algorithms.base.local_training import proximal_term
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.build import build_run
from fedbed.data.catalog import known_datasets
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.arrays import weighted_average
from fedbed.federation.messages import ClientInfo, Reply
from fedbed.federation.transport import InProcessClients


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_runs_two_rounds(name, tmp_path):
    """Two rounds in which every selected client trains (its update is not zero), replies and is
    aggregated; each round is evaluated on every domain, each mean is the mean of its domains'
    scores, and the summary's ``last`` entry is round 2's evaluation as logged."""
    # LeNet, not RotatedMNIST's default CNN: the test is about the methods, and LeNet evaluates ~100x faster.
    # The self-supervised methods' projectors and predictors are narrowed from the papers' 4096/2048
    # (25 M parameters around LeNet's 60 k) to 64/32: the test is about the methods' code paths.
    fields = get_algorithm(name).hyperparameters.model_fields
    hp = {key: width for key, width in (("projection_hidden_dim", 64), ("projection_dim", 32), ("predictor_hidden_dim", 64))
          if key in fields}
    config = ExperimentConfig(algorithm=name, model="lenet", rounds=2, local_steps=2, batch_size=16, run_dir=tmp_path / name,
                              hp=hp)
    summary = run_experiment(config, progress=False, echo=lambda *_: None)
    selection = summary["selection"]
    assert set(selection) == {"last", "train_domain_val", "oracle"}
    for entry in selection.values():
        assert 0.0 <= entry["ood_mean"] <= 100.0 and 0.0 <= entry["id_mean"] <= 100.0
        assert set(entry["id"]) == {"15", "30", "45", "60", "75"} and set(entry["ood"]) == {"0"}
    records = [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
    assert [record["round"] for record in records] == [1, 2]
    for record in records:
        assert record["selected"] and record["dropped"] == {} and record["kept_previous_model"] is None
        assert sorted(map(int, record["communication"]["received_bytes"])) == record["selected"]  # every client replied
        assert record["alignment"]["clients"] == record["selected"]
        assert all(norm > 0 for norm in record["alignment"]["update_norms"])  # and trained
        evaluation = record["evaluation"]
        assert set(evaluation["id"]) == {"15", "30", "45", "60", "75"} and set(evaluation["ood"]) == {"0"}
        assert evaluation["id_mean"] == pytest.approx(sum(evaluation["id"].values()) / 5)
        assert evaluation["ood_mean"] == pytest.approx(evaluation["ood"]["0"])
    last = selection["last"]
    assert last["round"] == 2
    assert {kind: last[kind] for kind in ("id", "ood", "id_mean", "ood_mean")} == \
        {kind: records[1]["evaluation"][kind] for kind in ("id", "ood", "id_mean", "ood_mean")}
    assert (tmp_path / name / "summary.json").exists() and (tmp_path / name / "checkpoint.pt").exists()


# The two references that no paper proposes: pooled training and each client alone.
NO_SOURCE_PAPER = {"central", "local"}


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - NO_SOURCE_PAPER))
def test_every_method_names_its_source_in_its_summary(name):
    # `fedbed algorithms` prints the summary: a reader must find the paper from it, by an author
    # and year or by the file in ../shared/papers.
    summary = get_algorithm(name).summary
    assert re.search(r"\b(19|20)\d\d\b|\.md\b|\.txt\b", summary), summary


# Each paper's run settings on one of its datasets, read off the paper by hand: hfedf.txt Sec. 5.1;
# fedgala.md Sec. 4 and App. B.1, B.3; fedadg.md Sec. 6.1; ppdg-gradient-alignment.txt Sec. 4.1,
# 4.2; mcgdm.md, Implementation Details.
PAPERS_RUN_SETTINGS = {
    ("hfedf", "PACS"): {"rounds": 200, "local_epochs": 2, "batch_size": 64, "holdout_fraction": 0.1},
    ("pfedhn", "VLCS"): {"rounds": 200, "local_epochs": 2, "batch_size": 64, "holdout_fraction": 0.1},  # as hFedF's baseline
    ("fedgala", "TerraIncognita"): {"rounds": 100, "local_epochs": 7, "batch_size": 128, "image_size": 32},
    ("fedadg", "OfficeHome"): {"batch_size": 16, "holdout_fraction": 0.3},
    ("ppdg", "Camelyon17"): {"rounds": 10, "local_epochs": 1, "batch_size": 32},
    ("ppdg", "PovertyMap"): {"rounds": 200, "local_epochs": 1, "batch_size": 64, "participation_fraction": 0.5},
    ("mcgdm", "VLCS"): {"rounds": 40, "local_epochs": 1, "batch_size": 16, "mixstyle": True},
}


@pytest.mark.parametrize(("name", "dataset"), sorted(PAPERS_RUN_SETTINGS))
def test_a_run_that_leaves_settings_unset_trains_with_its_papers_run_settings(name, dataset):
    expected = PAPERS_RUN_SETTINGS[name, dataset]
    config = ExperimentConfig(algorithm=name, dataset=dataset)
    assert {setting: getattr(config, setting) for setting in expected} == expected
    general = ExperimentConfig(algorithm="fedavg", dataset=dataset)  # FedAvg has no paper's run settings
    untouched = set(ExperimentConfig.model_fields) - set(expected) - {"algorithm"}
    assert {s: getattr(config, s) for s in untouched} == {s: getattr(general, s) for s in untouched}
    # the run's own values win, and a run that gives a budget keeps it whole
    given = ExperimentConfig(algorithm=name, dataset=dataset, rounds=3, batch_size=5, holdout_fraction=0.25, local_steps=4)
    assert (given.rounds, given.batch_size, given.holdout_fraction, given.local_steps, given.local_epochs) == (3, 5, 0.25, 4, None)


def test_every_declared_run_setting_is_a_setting_of_a_known_dataset():
    declared = {(algorithm.name, dataset): settings for algorithm in map(get_algorithm, ALGORITHMS)
                for dataset, settings in algorithm.dataset_run_settings.items()}
    assert set(PAPERS_RUN_SETTINGS) <= set(declared)
    for (name, dataset), settings in declared.items():
        assert dataset in known_datasets(), (name, dataset)
        assert set(settings) <= set(ExperimentConfig.model_fields) - {"algorithm", "dataset", "target", "hp"}, name
        config = ExperimentConfig(algorithm=name, dataset=dataset)
        assert {s: getattr(config, s) for s in settings} == settings


def test_weighted_average_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([4.0, -1.0]), "n": torch.tensor(5)}
    averaged = weighted_average([a, b], [1, 2])
    assert torch.allclose(averaged["w"], torch.tensor([3.0, 0.0]))
    assert averaged["n"].item() == 4 and averaged["n"].dtype == torch.int64
    with pytest.raises(ValueError):
        weighted_average([a], [0])


def constant_replies(model: nn.Module, values_and_sizes: dict[int, tuple[float, int]]) -> dict[int, Reply]:
    """One reply per client whose every array is ``model``'s shape filled with the client's value,
    with the client's ``num_examples``."""
    return {client: Reply({key: torch.full_like(tensor, value) for key, tensor in model.state_dict().items()},
                          num_examples=size)
            for client, (value, size) in values_and_sizes.items()}


def test_fedavg_weights_each_reply_by_its_num_examples():
    """McMahan et al. 2017, Algorithm 1: with n = 10 and 30, θ = (10 θ_0 + 30 θ_1) / 40 (not the
    uniform mean), through the strategy FedAvg's registration builds."""
    algorithm = get_algorithm("fedavg")
    model = nn.Linear(2, 1)
    strategy = algorithm.create_strategy(algorithm.hyperparameters(), AlgorithmContext(lambda: model, TrainingBudget(batch_size=4, local_steps=1), seed=0))
    strategy.initialize(model, [ClientInfo(0, 10, (0,)), ClientInfo(1, 30, (1,))])
    summary = strategy.aggregate(1, constant_replies(model, {0: (1.0, 10), 1: (5.0, 30)}))
    expected = (10 * 1.0 + 30 * 5.0) / (10 + 30)  # 4.0; the uniform mean would be 3.0
    for tensor in strategy.global_model().state_dict().values():
        assert torch.allclose(tensor, torch.full_like(tensor, expected))
    assert summary.telemetry["weights"] == pytest.approx({"0": 10 / 40, "1": 30 / 40})


def test_ppdg_averages_the_updates_uniformly_by_default():
    """PPDG's Algorithm 1, line 10: the aligned updates are averaged with 1/K, whatever the clients'
    sizes. Two non-conflicting updates (no alignment) from clients of 10 and 30 samples:
    (2, 0) and (2, 4) give (2, 2); weighting by n_k/n would give (2, 3)."""
    from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
    from fedbed.algorithms.ppdg import PPDGAggregation

    algorithm = get_algorithm("ppdg")
    hparams = algorithm.hyperparameters()
    assert hparams.weighting == "uniform"
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    strategy = algorithm.create_strategy(hparams, AlgorithmContext(lambda: model, TrainingBudget(batch_size=4, local_steps=1), seed=0))
    assert isinstance(strategy.aggregation, PPDGAggregation)
    strategy.initialize(model, [ClientInfo(0, 10, (0,)), ClientInfo(1, 30, (1,))])
    first, second = torch.tensor([[2.0], [0.0]]), torch.tensor([[2.0], [4.0]])
    assert float(first.flatten() @ second.flatten()) > 0  # no conflict: nothing is aligned
    summary = strategy.aggregate(1, {0: Reply({"weight": first}, num_examples=10), 1: Reply({"weight": second}, num_examples=30)})
    assert torch.allclose(strategy.global_model().weight, (first + second) / 2)
    assert summary.telemetry["weights"] == [0.5, 0.5] and summary.telemetry["aligned_clients"] == [False, False]
    sized = FedAvgStrategy(0, PPDGAggregation(algorithm.hyperparameters(weighting="num_examples"), seed=0))
    sized.initialize(nn.Linear(1, 2, bias=False), [])
    sized.model.load_state_dict({"weight": torch.zeros(2, 1)})
    sized.aggregate(1, {0: Reply({"weight": first}, num_examples=10), 1: Reply({"weight": second}, num_examples=30)})
    assert torch.allclose(sized.global_model().weight, (10 * first + 30 * second) / 40)


def test_a_trimmed_mean_run_cuts_one_client_of_five_at_each_end_by_default(tmp_path):
    """``robust_aggregation: trimmed_mean`` without ``trimmed_fraction`` uses β = 0.2 (Yin et al.
    2018): of five clients, ⌊0.2 · 5⌋ = 1 is cut at each end. Every coordinate of the five replies
    is the initial value plus 0, 1, 2, 6 and 100: the kept mean adds (1 + 2 + 6) / 3 = 3 (β = 0.4
    would keep only the median, 2; no trimming would add 109 / 5)."""
    config = ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path,
                              robust_aggregation="trimmed_mean")
    built = build_run(config)
    federation = built.federation(InProcessClients(built.trainer(), []))
    start = built.initial_model.state_dict()
    offsets = [0.0, 1.0, 2.0, 6.0, 100.0]
    assert len(built.partitions) == len(offsets)
    replies = {client: Reply({key: tensor + offset for key, tensor in start.items()}, num_examples=10 * (client + 1))
               for client, offset in enumerate(offsets)}
    federation.strategy.aggregate(1, replies)
    for key, tensor in federation.strategy.global_model().state_dict().items():
        assert torch.allclose(tensor, start[key] + 3.0, atol=1e-5), key


def test_fedprox_term_by_hand():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.copy_(torch.tensor([3.0]))
    anchor = {"weight": torch.tensor([[0.0, 0.0]]), "bias": torch.tensor([1.0])}
    # ||θ − θ_g||² = 1 + 4 + 4 = 9; μ/2 · 9 with μ = 0.1 is 0.45 (the squared norm, not sqrt(9) = 3).
    term = proximal_term(model, anchor, mu=0.1)
    assert term.item() == pytest.approx(0.45)
    term.backward()
    # d/dθ μ/2 ||θ − θ_g||² = μ (θ − θ_g)
    assert torch.allclose(model.weight.grad, torch.tensor([[0.1, 0.2]]))
    assert torch.allclose(model.bias.grad, torch.tensor([0.2]))


def test_hyperparameters_are_validated_by_name():
    fedprox = get_algorithm("FedProx")
    assert resolve_hyperparameters(fedprox, {"mu": 0.5}).mu == 0.5
    with pytest.raises(AlgorithmError, match="has no hyperparameter 'lambda'"):
        resolve_hyperparameters(fedprox, {"lambda": 0.1})
    with pytest.raises(AlgorithmError, match="mu"):
        resolve_hyperparameters(fedprox, {"mu": -1})
    with pytest.raises(AlgorithmError, match="unknown algorithm"):
        get_algorithm("fedfoo")
