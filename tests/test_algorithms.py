"""Every registered algorithm on tiny data, plus hand-computed cases of the shared math."""

import json
import re

import pytest
import torch
from torch import nn

from fedbed.algorithms import ALGORITHMS, AlgorithmError, get_algorithm, resolve_hyperparameters
from fedbed.algorithms.fedprox import proximal_term
from fedbed.data.catalog import known_datasets
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.gradients import weighted_average


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_runs_two_rounds(name, tmp_path):
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
    lines = (tmp_path / name / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]
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
