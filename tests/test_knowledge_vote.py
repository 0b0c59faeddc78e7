"""Federated domain adaptation by knowledge vote: the vote by hand, label-blind training, the log."""

from __future__ import annotations

import json

import pytest
import torch

from fedbed.algorithms.options.knowledge_vote import knowledge_vote
from fedbed.config import ConfigError
from fedbed.experiment import ExperimentConfig, run_experiment
from tests.helpers import corrupt_adaptation_labels


def test_the_vote_by_hand():
    # Image 0: model 0 is confident on class 1 (0.95), model 1 on class 2 (0.92), model 2 on
    #   nothing: one vote each, the larger confidence wins -> 1.
    # Image 1: no model exceeds 0.9 -> no pseudo-label (-1).
    # Image 2: models 0 and 1 confident on class 0, model 2 very confident on class 2: votes win -> 0.
    probabilities = torch.tensor([
        [[0.02, 0.95, 0.03], [0.5, 0.3, 0.2], [0.91, 0.05, 0.04]],
        [[0.04, 0.04, 0.92], [0.4, 0.4, 0.2], [0.93, 0.03, 0.04]],
        [[0.3, 0.5, 0.2], [0.2, 0.2, 0.6], [0.005, 0.005, 0.99]],
    ])
    assert knowledge_vote(probabilities, 0.9).tolist() == [1, -1, 0]
    assert knowledge_vote(probabilities).tolist() == [1, -1, 0]  # the default gate is KD3A's 0.9
    assert knowledge_vote(probabilities, 0.99).tolist() == [-1, -1, -1]
    assert knowledge_vote(probabilities, 0.5).tolist() == [1, 2, 0]  # image 1: model 2's 0.6 on class 2 passes 0.5


def test_a_runs_knowledge_vote_gates_at_0_9(tmp_path):
    """The strategy a ``target_adaptation: knowledge_vote`` run builds votes with KD3A's gate 0.9:
    source models whose top probability is 0.8 on every target image label nothing (and the global
    model stays the sources' average); at 0.95 every image gets their class."""
    from fedbed.build import build_run
    from fedbed.federation.messages import Reply
    from fedbed.federation.transport import InProcessClients

    built = build_run(ExperimentConfig(run_dir=tmp_path, **{**SETTINGS, "local_steps": 1}))
    federation = built.federation(InProcessClients(built.trainer(), []))
    strategy = federation.strategy
    start = built.initial_model.state_dict()
    classes = built.dataset.num_classes

    def replies_predicting_class_0_with(top: float) -> dict[int, Reply]:
        # A zero classifier weight and a bias of log p give softmax = p on every image.
        p = torch.full((classes,), (1 - top) / (classes - 1))
        p[0] = top
        arrays = {**start, "classifier.weight": torch.zeros_like(start["classifier.weight"]), "classifier.bias": p.log()}
        return {client: Reply(dict(arrays), num_examples=10) for client in range(len(built.partitions))}

    unsure = replies_predicting_class_0_with(0.8)
    summary = strategy.aggregate(1, unsure)
    labels = summary.telemetry["pseudo_labels"]
    assert len(labels) == len(built.adaptation_indices) > 0 and set(labels) == {-1}
    assert all(torch.allclose(tensor, unsure[0].arrays[key]) for key, tensor in strategy.global_model().state_dict().items())
    assert set(strategy.aggregate(2, replies_predicting_class_0_with(0.95)).telemetry["pseudo_labels"]) == {0}


def quiet(config):
    return run_experiment(config, progress=False, echo=lambda *_: None)


SETTINGS = dict(model="lenet", rounds=3, local_steps=8, batch_size=32, hp={"client_lr": 0.005},
                protocol="domain_adaptation", target_adaptation="knowledge_vote")


def test_training_never_reads_the_adaptation_labels(tmp_path, monkeypatch):
    clean = quiet(ExperimentConfig(run_dir=tmp_path / "clean", **SETTINGS))
    corrupt_adaptation_labels(monkeypatch, shift=3)
    corrupted = quiet(ExperimentConfig(run_dir=tmp_path / "corrupted", **SETTINGS))
    logs = {name: [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
            for name in ("clean", "corrupted")}
    assert [r["metrics"] for r in logs["clean"]] == [r["metrics"] for r in logs["corrupted"]]
    assert clean["selection"] == corrupted["selection"]
    # The global models the two runs end with are equal bit for bit (the knowledge-vote wrapper keeps
    # the inner strategy's state in the checkpoint).
    models = [torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["strategy"]["inner"]["model"]
              for name in ("clean", "corrupted")]
    assert models[0].keys() == models[1].keys() and all(torch.equal(v, models[1][k]) for k, v in models[0].items())
    fractions = [r["adaptation"]["pseudo_labelled_fraction"] for r in logs["clean"]]
    assert fractions[-1] > 0  # the vote labelled some images, so the test would see a leak
    accuracy = [r["adaptation"]["pseudo_label_accuracy_reads_target_labels"] for r in logs["clean"]]
    corrupted_accuracy = [r["adaptation"]["pseudo_label_accuracy_reads_target_labels"] for r in logs["corrupted"]]
    assert accuracy != corrupted_accuracy  # only the log reads the labels
    assert "pseudo_labels" not in logs["clean"][-1]["telemetry"]


def test_methods_that_generate_their_clients_models_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="knowledge-vote adaptation needs a method whose next round starts from the global model"):
        quiet(ExperimentConfig(algorithm="hfedf", run_dir=tmp_path, **{**SETTINGS, "hp": {}}))
