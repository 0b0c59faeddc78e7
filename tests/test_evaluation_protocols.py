"""Evaluation protocols: the linear probe (seeded shares, never trained on its test share, stated
in the summary) and the domain-adaptation data access (the server holds target images without
labels; their labels are never read)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import ALGORITHMS
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.fedavg import FedAvg
from fedbed.config import ConfigError, config_from_mapping
from fedbed.data.splits import split_target_for_adaptation
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.evaluation import evaluate_models, format_domain_table
from fedbed.federation.linear_probe import LinearProbe
from fedbed.federation.local_data import ClientData, UnlabeledImages
from fedbed.models import DomainClassifier
from tests.helpers import corrupt_adaptation_labels


def quiet(config, **options):
    return run_experiment(config, progress=False, echo=lambda *_: None, **options)


def separable(count=40, seed=0) -> ClientData:
    """Two classes told apart by the sign of the first feature."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 2
    features = torch.randn(count, 4, generator=generator)
    features[:, 0] = (labels.float() * 2 - 1) * (1 + features[:, 0].abs())
    return ClientData(features.view(count, 4, 1, 1), labels, torch.zeros(count, dtype=torch.long))


def identity_model() -> DomainClassifier:
    return DomainClassifier(nn.Flatten(), nn.Linear(4, 2), 4)


def test_the_probe_splits_by_seed_and_never_trains_on_its_test_share():
    probe = LinearProbe(labelled_fraction=0.25, epochs=50, learning_rate=0.05)
    labelled, test = probe.split(40, seed=3, domain=1, repeat=0)
    assert len(labelled) == 10 and len(test) == 30 and set(labelled.tolist()).isdisjoint(test.tolist())
    assert torch.equal(probe.split(40, seed=3, domain=1, repeat=0)[0], labelled)
    assert not torch.equal(probe.split(40, seed=3, domain=2, repeat=0)[0], labelled)
    data = separable()
    assert probe.accuracy(identity_model(), data, 2, seed=3, domain=1) == 100.0
    # Flip the labels of the test share: a probe that never saw them now scores 0; one trained on
    # them would not.
    flipped = data.targets.clone()
    flipped[test] = 1 - flipped[test]
    corrupted = ClientData(data.images, flipped, data.domains)
    assert probe.accuracy(identity_model(), corrupted, 2, seed=3, domain=1) == 0.0
    with pytest.raises(ValueError, match="at least two samples"):
        probe.split(1, seed=0, domain=0, repeat=0)


def test_repeated_probes_each_score_their_own_share_and_the_accuracy_is_their_mean():
    data = separable()
    # Flip the labels of repeat 0's test share only: that probe scores 0; the others see some of
    # the flipped samples in training or testing and score in between.
    probe = LinearProbe(labelled_fraction=0.25, epochs=50, learning_rate=0.05, repeats=3)
    _, test = probe.split(40, seed=3, domain=1, repeat=0)
    flipped = data.targets.clone()
    flipped[test] = 1 - flipped[test]
    corrupted = ClientData(data.images, flipped, data.domains)
    scores = probe.scores(identity_model(), corrupted, 2, seed=3, domain=1)
    assert len(scores) == 3 and scores[0] == 0.0 and all(score > 0.0 for score in scores[1:])
    assert probe.accuracy(identity_model(), corrupted, 2, seed=3, domain=1) == pytest.approx(sum(scores) / 3)
    # A run's evaluation gives the mean and, over the repeats, the sample standard deviation, and
    # the printed table shows both.
    names = ("source", "target")
    result = evaluate_models([(identity_model(), None)], {}, {1: corrupted}, names, probe=probe, num_classes=2, seed=3)
    mean = sum(scores) / 3
    deviation = math.sqrt(sum((s - mean) ** 2 for s in scores) / 2)
    assert result["ood"]["target"] == pytest.approx(mean) and result["probe_std"]["ood"]["target"] == pytest.approx(deviation)
    assert f"{mean:.1f}±{deviation:.1f}" in format_domain_table({"last": {**result, "round": 1}})
    single = evaluate_models([(identity_model(), None)], {}, {1: corrupted}, names, probe=LinearProbe(epochs=5),
                             num_classes=2, seed=3)
    assert "probe_std" not in single  # one probe has no spread


def test_standardized_features_make_the_probe_blind_to_the_encoders_scale():
    # Features z-scored with the labelled share's statistics only: mean 0 and std 1 there.
    probe = LinearProbe(labelled_fraction=0.25, epochs=30, learning_rate=0.05, repeats=2, standardize_features=True)
    data = separable()
    features = data.outputs_of(nn.Flatten())
    labelled, test = probe.split(len(data), seed=3, domain=1, repeat=0)
    inputs = probe.probe_inputs(features, labelled)
    assert torch.allclose(inputs[labelled].mean(dim=0), torch.zeros(4), atol=1e-6)
    assert torch.allclose(inputs[labelled].std(dim=0), torch.ones(4), atol=1e-5)
    # The test rows' statistics are never used: moving a test row leaves the others unchanged.
    moved = features.clone()
    moved[test[0]] += 100.0
    assert torch.equal(probe.probe_inputs(moved, labelled)[labelled], inputs[labelled])

    # An encoder whose features are 1000 times larger and shifted scores the same standardized,
    # and differently raw (Adam at this rate is not scale-free over 30 epochs).
    def encoder(scale, shift):
        return DomainClassifier(nn.Sequential(nn.Flatten(), Affine(scale, shift)), nn.Linear(4, 2), 4)

    small, large = encoder(0.001, 0.0), encoder(1.0, 50.0)
    assert probe.scores(small, data, 2, seed=3, domain=1) == probe.scores(large, data, 2, seed=3, domain=1)
    raw = probe.model_copy(update={"standardize_features": None})
    assert raw.scores(small, data, 2, seed=3, domain=1) != raw.scores(large, data, 2, seed=3, domain=1)


class Affine(nn.Module):
    def __init__(self, scale: float, shift: float) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features * self.scale + self.shift


def test_a_linear_probe_run_says_it_reads_target_labels(tmp_path):
    """The summary and the log say the run's scores are linear-probe accuracies that read target
    labels, and the ood score is what a probe trained on 10% of the target's labels gives on the
    rest for the run's final model (recomputed here from the checkpoint), a whole number of the
    test share's samples."""
    from fedbed.experiment import restore_run

    config = ExperimentConfig(model="lenet", rounds=1, local_steps=2, batch_size=16, run_dir=tmp_path,
                              evaluation_protocol="linear_probe", linear_probe={"epochs": 5})
    summary = quiet(config)
    statement = summary["evaluation"]
    assert statement["protocol"] == "linear_probe" and statement["target_labels_read_by_evaluation"] is True
    assert "target labels" in statement["note"] and statement["linear_probe"]["labelled_fraction"] == 0.1
    assert json.loads((tmp_path / "rounds.jsonl").read_text())["evaluation"]["metric"] == "linear_probe_accuracy"
    restored = restore_run(tmp_path)
    built = restored.built
    target = built.data(built.ood_indices)
    probe = LinearProbe(epochs=5)
    assert built.probe == probe
    expected = probe.accuracy(restored.global_model, target, built.dataset.num_classes, seed=0, domain=0)
    assert summary["selection"]["last"]["ood"] == {"0": pytest.approx(expected)}
    test_share = len(target) - math.ceil(0.1 * len(target))
    correct = expected * test_share / 100
    assert correct == pytest.approx(round(correct), abs=1e-3)  # the share correct, up to float32 rounding
    argmax = quiet(ExperimentConfig(model="lenet", rounds=1, local_steps=2, batch_size=16, run_dir=tmp_path / "argmax"))
    assert argmax["evaluation"]["target_labels_read_by_evaluation"] is False


@pytest.mark.parametrize("changes, message", [
    ({"evaluation_protocol": "linear_probe", "id_evaluation": "clients"}, "trains its probes on the server"),
    ({"linear_probe": {"epochs": 3}}, "apply to evaluation_protocol: linear_probe only"),
])
def test_probe_settings_that_cannot_work_are_refused(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        quiet(ExperimentConfig(model="lenet", rounds=1, local_steps=1, run_dir=tmp_path, **changes))
    assert not any(tmp_path.iterdir())


def test_the_adaptation_split_is_seeded_and_disjoint():
    target = torch.arange(100, 200)
    adaptation, test = split_target_for_adaptation(target, 0.3, seed=1)
    assert len(adaptation) == 30 and len(test) == 70
    assert sorted(adaptation.tolist() + test.tolist()) == target.tolist()
    assert torch.equal(split_target_for_adaptation(target, 0.3, seed=1)[0], adaptation)


class HoldsTheTarget(FedAvgStrategy):
    received: list = []

    def receive_adaptation_target(self, images):
        HoldsTheTarget.received.append(images)


class Adapting(FedAvg):
    name = "adapting"

    def create_strategy(self, hparams, context):
        return HoldsTheTarget(context.seed)


def test_domain_adaptation_gives_the_server_unlabelled_images_and_tests_on_the_rest(tmp_path, monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "adapting", Adapting)
    HoldsTheTarget.received = []
    settings = dict(algorithm="adapting", model="lenet", rounds=1, local_steps=2, batch_size=16,
                    protocol="domain_adaptation", adaptation_fraction=0.4)
    summary = quiet(ExperimentConfig(run_dir=tmp_path / "a", **settings))
    (images,) = HoldsTheTarget.received
    assert type(images) is UnlabeledImages and not hasattr(images, "targets") and not hasattr(images, "labels")
    statement = summary["evaluation"]
    assert statement["data_access"] == "domain_adaptation"
    total = statement["adaptation_samples"] + statement["target_test_samples"]
    assert statement["adaptation_samples"] == len(images) == round(0.4 * total)
    with pytest.raises(ConfigError, match="adaptation_fraction applies to protocol: domain_adaptation only"):
        config_from_mapping({"model": "lenet", "run_dir": tmp_path / "b", "adaptation_fraction": 0.4})


def test_the_adaptation_share_labels_are_never_read(tmp_path, monkeypatch):
    """Corrupting the labels of the target's adaptation share changes nothing of the run."""
    monkeypatch.setitem(ALGORITHMS, "adapting", Adapting)
    settings = dict(algorithm="adapting", model="lenet", rounds=1, local_steps=2, batch_size=16, protocol="domain_adaptation")
    clean = quiet(ExperimentConfig(run_dir=tmp_path / "clean", **settings))
    corrupt_adaptation_labels(monkeypatch)
    corrupted = quiet(ExperimentConfig(run_dir=tmp_path / "corrupted", **settings))
    assert corrupted["selection"] == clean["selection"]
    logs = [[json.loads(line)["metrics"] for line in (tmp_path / r / "rounds.jsonl").read_text().splitlines()]
            for r in ("clean", "corrupted")]
    assert logs[0] == logs[1]


def test_a_report_of_probed_runs_says_they_read_target_labels(tmp_path):
    from typer.testing import CliRunner

    from fedbed.cli import app

    quiet(ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path / "probe",
                           evaluation_protocol="linear_probe", linear_probe={"epochs": 2}))
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--html", str(tmp_path / "report.html")])
    assert result.exit_code == 0, result.output
    assert "evaluation (1 run): linear probe" in result.output and "target labels" in result.output
    assert "target labels" in (tmp_path / "report.html").read_text()


def test_the_accuracy_plots_of_probed_runs_carry_the_note_that_they_read_target_labels(tmp_path, monkeypatch):
    import fedbed.plots as plots

    quiet(ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path / "probe",
                           evaluation_protocol="linear_probe", linear_probe={"epochs": 2}))
    captions = []
    original = plots._caption
    monkeypatch.setattr(plots, "_caption", lambda figure, notes: (captions.append(notes), original(figure, notes)))
    written = plots.plot_sweep(tmp_path, "last")
    assert {"curve_0.png", "domains_last.png"} <= {p.name for p in written} and len(captions) == 2
    assert all(any("linear probe" in note and "target labels" in note for note in notes) for notes in captions)
