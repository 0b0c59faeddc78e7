"""Helpers the tests import (``from tests.helpers import ...``): tiny synthetic data, a small
model of the real kind, a built federation on them, and a run crashed then resumed. Fixtures stay
in ``tests/conftest.py``, which pytest loads itself and test modules do not import."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.data import partition_one_client_per_domain, split_leave_one_domain_out
from fedbed.data.base import DomainDataset
from fedbed.federation.engine import Federation, client_infos
from fedbed.federation.local_data import ClientData
from fedbed.federation.transport import InProcessClients
from fedbed.models.networks import DomainClassifier


def make_dataset(per_domain: int = 40, domains: int = 3, classes: int = 2, side: int = 8, seed: int = 0) -> DomainDataset:
    """A learnable synthetic dataset: the class sets the mean brightness, the domain adds an offset."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(per_domain * domains) % classes
    domain_ids = torch.arange(per_domain * domains) // per_domain
    base = 60 + 120 * labels.float() + 20 * domain_ids.float()
    noise = torch.randint(-30, 30, (len(labels), 1, side, side), generator=generator).float()
    images = (base.view(-1, 1, 1, 1) + noise).clamp(0, 255).to(torch.uint8)
    return DomainDataset(
        name="Synthetic",
        images=images,
        labels=labels,
        domains=domain_ids,
        class_names=tuple(f"c{i}" for i in range(classes)),
        domain_names=tuple(f"d{i}" for i in range(domains)),
        source="synthetic",
    )


def small_model(input_shape: tuple[int, int, int], num_classes: int) -> DomainClassifier:
    """A two-layer CNN (8 then 16 channels, global average pooling) for the small synthetic images:
    the engine's tests need a model of the real kind (featurizer and classifier), not a large one,
    and hFedF's hypernetwork has one output head per parameter tensor."""
    featurizer = nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    return DomainClassifier(featurizer, nn.Linear(16, num_classes), 16)


def build_federation(dataset=None, target="d3", algorithm="fedavg", trainer_class=None, hp=None, batch_size=8):
    """A built :class:`Federation` on small data (:func:`small_model`), one client per source
    domain, initialised with seed 1."""
    dataset = dataset if dataset is not None else make_dataset(per_domain=48, domains=4)
    split = split_leave_one_domain_out(dataset, (target,), 0.25, seed=0)
    partitions = partition_one_client_per_domain(split)
    torch.manual_seed(0)
    spec = get_algorithm(algorithm)
    hparams = spec.hyperparameters(**(hp or {}))
    factory = lambda: spec.wrap_model(small_model(dataset.input_shape, dataset.num_classes), hparams)  # noqa: E731
    context = AlgorithmContext(factory, TrainingBudget(batch_size=batch_size, local_epochs=1), seed=0, task=dataset.task)
    federation = Federation(
        strategy=spec.create_strategy(hparams, context),
        clients=InProcessClients(
            (trainer_class or type(spec.create_trainer(hparams, context)))(hparams, context),
            [ClientData.from_dataset(dataset, p.indices) for p in partitions],
        ),
        holdout={d: ClientData.from_dataset(dataset, i) for d, i in split.holdout.items()},
        target={d: ClientData.from_dataset(dataset, dataset.indices_of_domain(d)) for d in split.target_domains},
        domain_names=dataset.domain_names,
        task=dataset.task,
    )
    torch.manual_seed(1)
    federation.strategy.initialize(factory(), client_infos(partitions))
    return federation


def corrupt_adaptation_labels(monkeypatch, shift: int = 1) -> None:
    """Make every later in-process run shift the labels of its target's adaptation share by
    ``shift`` classes (on a copy: the loaded dataset is cached for later runs), so a test can
    check that nothing but the log reads them."""
    import dataclasses

    import fedbed.build as build
    import fedbed.experiment as experiment

    original = build.build_run

    def build_then_corrupt(config):
        built = original(config)
        labels = built.dataset.labels.clone()
        labels[built.adaptation_indices] = (labels[built.adaptation_indices] + shift) % built.dataset.num_classes
        assert not torch.equal(labels, built.dataset.labels)
        built.dataset = dataclasses.replace(built.dataset, labels=labels)
        return built

    monkeypatch.setattr(experiment, "build_run", build_then_corrupt)


class ProcessCrash(BaseException):
    """The whole process stops (a power cut), not one client's exception: the engine drops a
    client that raises an ``Exception`` and goes on, while this escapes the round."""


def run_straight_and_resumed(tmp_path, monkeypatch, trainer_class, **settings):
    """Run ``settings`` uninterrupted (``tmp_path/straight``), and again (``tmp_path/resumed``) with
    the process crashing in round 3 (:class:`ProcessCrash` from ``trainer_class.fit``), then
    resumed from its checkpoint.

    Returns:
        ``(straight summary, resumed summary, {"straight": [...], "resumed": [...]})``, the last
        holding each run's per-round ``metrics`` from ``rounds.jsonl``.
    """
    import json

    from fedbed.experiment import ExperimentConfig, run_experiment

    quiet = dict(progress=False, echo=lambda *_: None)
    straight = run_experiment(ExperimentConfig(run_dir=tmp_path / "straight", **settings), **quiet)
    fit = trainer_class.fit

    def crash_in_round_3(self, payload, data, state):
        if payload.config["round"] == 3:
            raise ProcessCrash("power cut")
        return fit(self, payload, data, state)

    monkeypatch.setattr(trainer_class, "fit", crash_in_round_3)
    with pytest.raises(ProcessCrash, match="power cut"):
        run_experiment(ExperimentConfig(run_dir=tmp_path / "resumed", **settings), **quiet)
    monkeypatch.setattr(trainer_class, "fit", fit)
    resumed = run_experiment(ExperimentConfig(run_dir=tmp_path / "resumed", **settings), resume=True, **quiet)
    logs = {name: [json.loads(line)["metrics"] for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")}
    return straight, resumed, logs
