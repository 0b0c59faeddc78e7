"""FedADG (fedadg.md): the losses by hand, D learning to separate, what stays on a client, the
uniform average, the frozen projection, the schedule, the ablations, a resumed run, the
JiGen augmentation and the feature plot."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import AlgorithmError, get_algorithm, resolve_hyperparameters
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.fedadg import (
    Discriminator,
    FedADGModel,
    FedADGStrategy,
    discriminator_loss,
    fooling_loss,
    random_projection,
    reference_sample,
)
from fedbed.data.augmentation import Augmentation
from fedbed.experiment import ConfigError, ExperimentConfig, run_experiment
from fedbed.federation.engine import run_rounds
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import ClientInfo, Payload, Reply
from fedbed.models import DomainClassifier
from tests.helpers import build_federation, run_straight_and_resumed, small_model

QUIET = dict(progress=False, echo=lambda *_: None)
SHORT = {"classification_epochs": 1, "alignment_epochs": 2}


@pytest.fixture(autouse=True)
def one_thread():
    """These tests train tiny networks: one torch thread, which other jobs on the cores cannot stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_losses_on_a_hand_computed_case():
    # D(h) = (0.5, -1), D(h') = (1, 0): L_adv-d = (0.25 + 1)/2 + (0 + 1)/2 = 1.125;
    # L_adv-f = ((1 - 0.5)² + (1 + 1)²)/2 = 2.125; L_adv-g = (0 + 1)/2 = 0.5.
    features, reference = torch.tensor([0.5, -1.0]), torch.tensor([1.0, 0.0])
    assert discriminator_loss(features, reference).item() == pytest.approx(1.125)
    assert fooling_loss(features).item() == pytest.approx(2.125)
    assert fooling_loss(reference).item() == pytest.approx(0.5)
    # Bounded below by 0, reached by the separation the text describes (negatives 0, positives 1);
    # Eq. 2 as printed would instead reward D(h) -> -inf without bound.
    assert discriminator_loss(torch.zeros(3), torch.ones(3)).item() == 0.0
    assert discriminator_loss(torch.full((3,), -1e3), torch.ones(3)).item() > 1e5
    # Through the real module: a D whose last layer is the constant 0.25 gives 0.25² + 0.75² and 0.75².
    discriminator = Discriminator(4, 2, 8)
    nn.init.zeros_(discriminator.layers[2].weight)
    nn.init.constant_(discriminator.layers[2].bias, 0.25)
    scores = discriminator(torch.randn(5, 4), nn.functional.one_hot(torch.arange(5) % 2, 2).float())
    assert scores.shape == (5,)
    assert discriminator_loss(scores, scores).item() == pytest.approx(0.625)
    assert fooling_loss(scores).item() == pytest.approx(0.5625)


@pytest.mark.parametrize("conditioned", [False, True])
def test_the_discriminator_learns_to_separate_features_from_the_reference(conditioned):
    """h around -2 and h' around +2 (conditioned: the sides swap with the class, so only a D that
    reads y can separate them); minimising L_adv-d drives D(h) to 0 and D(h') to 1."""
    torch.manual_seed(0)
    labels = torch.arange(64) % 2
    side = (1 - 2 * labels.float()).unsqueeze(1) if conditioned else torch.ones(64, 1)
    features = -2 * side + 0.3 * torch.randn(64, 4)
    reference = 2 * side + 0.3 * torch.randn(64, 4)
    one_hot = nn.functional.one_hot(labels, 2).float() if conditioned else None
    discriminator = Discriminator(4, 2 if conditioned else 0, 16)
    optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    for _ in range(300):
        loss = discriminator_loss(discriminator(features, one_hot), discriminator(reference, one_hot))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    assert discriminator(features, one_hot).mean().item() == pytest.approx(0.0, abs=0.1)
    assert discriminator(reference, one_hot).mean().item() == pytest.approx(1.0, abs=0.1)


def spy_on_replies(federation):
    """Record every payload and reply the transport carries."""
    seen = []
    fit_round = federation.clients.fit_round

    def recording(payloads):
        replies = fit_round(payloads)
        seen.append((payloads, replies))
        return replies

    federation.clients.fit_round = recording
    return seen


def test_discriminator_and_projection_never_leave_the_client_and_the_projection_stays_frozen(tmp_path):
    federation = build_federation(algorithm="fedadg", hp=SHORT)
    seen = spy_on_replies(federation)
    run_rounds(federation, rounds=1, seed=0, participation_fraction=1.0, eval_every=5, run_dir=tmp_path, progress=False)
    projections = [state["projection"].clone() for state in federation.clients.states]
    discriminators = [{k: v.clone() for k, v in state["discriminator"].items()} for state in federation.clients.states]
    run_rounds(federation, rounds=2, seed=0, participation_fraction=1.0, eval_every=5, run_dir=tmp_path, progress=False,
               resume=True)
    states = federation.clients.states  # round 2's states (the resumption reloaded them from the checkpoint)
    model_keys = set(federation.strategy.global_model().state_dict())
    assert any(key.startswith("generator.") for key in model_keys)  # G travels with F and C
    # Both rounds were recorded, each with a reply from every client: the checks below saw them all.
    assert len(seen) == 2 and all(sorted(replies) == list(range(len(states))) == sorted(payloads) for payloads, replies in seen)
    for payloads, replies in seen:
        for client, reply in replies.items():
            assert set(reply.arrays) == set(payloads[client].arrays) == model_keys
            assert not any("discriminator" in key or "projection" in key for key in reply.arrays)
            assert reply.num_bytes() == payloads[client].num_bytes()
            local = states[client]
            for tensor in [local["projection"], *local["discriminator"].values()]:
                assert not any(t.shape == tensor.shape and torch.equal(t, tensor) for t in reply.arrays.values())
    for client, state in enumerate(states):
        assert state["projection"].shape == (16, 8)  # d_1 = the featurizer's width, d_2 = d_1 / 2
        assert torch.equal(state["projection"], projections[client])  # never trained: bit-identical
        assert not torch.equal(state["discriminator"]["layers.0.weight"], discriminators[client]["layers.0.weight"])
    assert not torch.equal(states[0]["projection"], states[1]["projection"])  # each client draws its own


def test_the_server_averages_f_c_and_g_uniformly():
    torch.manual_seed(0)
    hparams = get_algorithm("fedadg").hyperparameters()
    model = FedADGModel(DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4), "generator")
    strategy = FedADGStrategy()
    strategy.initialize(model, [ClientInfo(c, n, (c,)) for c, n in enumerate((10, 30, 200))])
    sent = strategy.configure_round(1, [0, 1, 2])[0].arrays
    replies = {c: Reply({k: v + c for k, v in sent.items()}, num_examples=n) for c, n in enumerate((10, 30, 200))}
    summary = strategy.aggregate(1, replies)
    averaged = strategy.global_model().state_dict()
    for key, tensor in sent.items():  # (0 + 1 + 2) / 3 = 1, where n_k-weighting would give 430/240
        assert torch.allclose(averaged[key], tensor + 1.0)
    assert summary.telemetry["weights"] == {"0": pytest.approx(1 / 3), "1": pytest.approx(1 / 3), "2": pytest.approx(1 / 3)}
    assert {key.split(".")[0] for key in averaged} == {"classifier", "generator"} and hparams.reference == "generator"


def client(hp=None, budget=None, labels=None, model=None):
    """A FedADG trainer on a tiny model, a payload, a client's data and its (empty) state."""
    torch.manual_seed(0)
    algorithm = get_algorithm("fedadg")
    hparams = resolve_hyperparameters(algorithm, {"augmentation": None, **(hp or {})})
    factory = lambda: algorithm.wrap_model(model() if model else small_model((1, 8, 8), 3), hparams)  # noqa: E731
    context = AlgorithmContext(factory, budget or TrainingBudget(batch_size=4, local_steps=1), seed=0)
    trainer = algorithm.create_trainer(hparams, context)
    labels = labels if labels is not None else torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    data = ClientData(torch.randint(0, 255, (len(labels), 1, 8, 8), dtype=torch.uint8), labels, torch.zeros(len(labels), dtype=torch.long))
    return trainer, Payload(arrays=factory().state_dict(), config={"batch_seed": 1}), data, {}


def test_label_smoothing_is_0_1_in_the_classification_loss():
    """A model whose logits are the constant (2, 0), one batch of class-0 samples: L_err =
    (1 - ε/2)(-log p_0) + (ε/2)(-log p_1), with ε = 0.1 by default (Szegedy et al. 2016)."""
    assert get_algorithm("fedadg").hyperparameters().label_smoothing == 0.1

    def constant_logits() -> DomainClassifier:
        head = nn.Linear(2, 2)
        nn.init.zeros_(head.weight)
        head.bias.data = torch.tensor([2.0, 0.0])
        return DomainClassifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 2)), head, 2)

    def first_loss(smoothing: float) -> float:
        hp = {"label_smoothing": smoothing, "classification_epochs": 1, "alignment_epochs": 0, "use_random_projection": False}
        trainer, payload, data, state = client(hp, TrainingBudget(batch_size=6, local_steps=1), torch.zeros(6, dtype=torch.long),
                                               constant_logits)
        return trainer.fit(payload, data, state).metrics["loss"]

    log_p = torch.log_softmax(torch.tensor([2.0, 0.0]), dim=0)
    assert first_loss(0.1) == pytest.approx(-(0.95 * log_p[0] + 0.05 * log_p[1]).item(), rel=1e-6)
    assert first_loss(0.0) == pytest.approx(-log_p[0].item(), rel=1e-6)


def test_e0_and_e1_count_units_of_the_runs_budget(monkeypatch):
    import fedbed.algorithms.fedadg as fedadg

    budgets = []
    original = fedadg.run_batches

    def spy(data, budget, generator, step, **options):
        budgets.append((budget.local_epochs, budget.local_steps))
        return original(data, budget, generator, step, **options)

    monkeypatch.setattr(fedadg, "run_batches", spy)
    trainer, payload, data, state = client({"classification_epochs": 3, "alignment_epochs": 7}, TrainingBudget(batch_size=4, local_steps=2))
    trainer.fit(payload, data, state)
    assert budgets == [(None, 6), (None, 14)]  # Algorithm 1 word for word with local_steps: 1 (here 2 per unit)
    budgets.clear()
    trainer, payload, data, state = client({"classification_epochs": 3, "alignment_epochs": 7}, TrainingBudget(batch_size=4, local_epochs=1))
    trainer.fit(payload, data, state)
    assert budgets == [(3, None), (7, None)]
    budgets.clear()
    trainer, payload, data, state = client({"use_alignment": False}, TrainingBudget(batch_size=4, local_steps=1))
    reply = trainer.fit(payload, data, state)
    assert budgets == [(None, 10)]  # w/o G&D: the same schedule, all of it classification
    assert state == {} and set(reply.metrics) == {"loss"}
    with pytest.raises(AlgorithmError, match="both 0"):
        resolve_hyperparameters(get_algorithm("fedadg"), {"classification_epochs": 0, "alignment_epochs": 0})


def test_ablation_switches_change_what_they_should():
    trainer, payload, data, state = client()
    reply = trainer.fit(payload, data, state)
    assert trainer.model.generator.layers[0].in_features == 16 + 3  # z (d_z = d = 16) and y (K = 3)
    assert state["discriminator"]["layers.0.weight"].shape == (16, 8 + 3)  # R h (d_2 = 8) and y
    assert {"adversarial_feature", "adversarial_discriminator", "adversarial_generator"} <= set(reply.metrics)

    trainer, payload, data, state = client({"use_label_conditioning": False})
    trainer.fit(payload, data, state)
    assert trainer.model.generator.layers[0].in_features == 16
    assert state["discriminator"]["layers.0.weight"].shape == (16, 8)

    trainer, payload, data, state = client({"use_random_projection": False})
    trainer.fit(payload, data, state)
    assert "projection" not in state and state["discriminator"]["layers.0.weight"].shape == (16, 16 + 3)

    for reference in ("gaussian", "uniform", "laplace"):
        trainer, payload, data, state = client({"reference": reference})
        reply = trainer.fit(payload, data, state)
        assert not any(key.startswith("generator.") for key in payload.arrays)  # no G to send
        assert "adversarial_generator" not in reply.metrics and "discriminator" in state

    trainer, payload, data, state = client({"use_alignment": False})
    assert set(payload.arrays) == set(small_model((1, 8, 8), 3).state_dict())  # FedAvg's arrays


def test_fixed_reference_distributions_of_table_8():
    torch.manual_seed(0)
    gaussian, uniform, laplace = (reference_sample(name, (20000, 4)) for name in ("gaussian", "uniform", "laplace"))
    assert gaussian.mean().item() == pytest.approx(0.0, abs=0.02) and gaussian.var().item() == pytest.approx(1.0, abs=0.03)
    assert uniform.min().item() >= -1.0 and uniform.max().item() <= 1.0 and uniform.var().item() == pytest.approx(1 / 3, abs=0.01)
    assert laplace.abs().mean().item() == pytest.approx(1 / math.sqrt(2), abs=0.02)  # E|X| = b = 1/√2
    with pytest.raises(ValueError, match="unknown fixed reference"):
        reference_sample("generator", (2, 2))
    with pytest.raises(ValueError, match="d_2 < d_1"):
        random_projection(8, 8)


def test_bad_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="projection_dim"):
        run_experiment(ExperimentConfig(algorithm="fedadg", model="lenet", hp={"projection_dim": 84}, run_dir=tmp_path / "a"), **QUIET)
    with pytest.raises(ConfigError, match="fedadg draws its own augmented views"):
        run_experiment(ExperimentConfig(algorithm="fedadg", model="lenet", augmentation="flip_crop", run_dir=tmp_path / "b"), **QUIET)
    with pytest.raises(ValueError, match="classification task"):
        FedADGModel(DomainClassifier(nn.Flatten(), nn.Linear(4, 1), 4), "generator")


def test_jigen_augmentation_is_seeded_and_keeps_shape():
    images = torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8)
    jigen = Augmentation("jigen")
    first, again, other = jigen.apply(images, 5)[0], jigen.apply(images, 5)[0], jigen.apply(images, 6)[0]
    assert first.shape == images.shape and first.dtype == torch.uint8
    assert torch.equal(first, again) and not torch.equal(first, other) and not torch.equal(first, images)
    grey = torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8)
    assert jigen.apply(grey, 0)[0].shape == grey.shape


def test_a_resumed_fedadg_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """Optimisers are fresh every round (plain SGD has no state); D and R are in the checkpointed
    client states, so the resumed run continues bit for bit, D included."""
    from fedbed.algorithms.fedadg import FedADGTrainer

    settings = dict(algorithm="fedadg", model="lenet", rounds=3, local_steps=1, batch_size=16, hp={**SHORT, "client_lr": 0.01})
    straight, resumed, logs = run_straight_and_resumed(tmp_path, monkeypatch, FedADGTrainer, **settings)
    assert logs["resumed"] == logs["straight"] and resumed["selection"] == straight["selection"]
    assert logs["straight"][0]["mean_adversarial_discriminator"] > 0
    checkpoints = [torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in ("straight", "resumed")]
    for mine, theirs in zip(*(c["client_states"] for c in checkpoints)):
        assert torch.equal(mine["projection"], theirs["projection"])
        assert all(torch.equal(mine["discriminator"][k], theirs["discriminator"][k]) for k in mine["discriminator"])
    assert all(torch.equal(v, checkpoints[1]["strategy"]["model"][k]) for k, v in checkpoints[0]["strategy"]["model"].items())


@pytest.mark.parametrize("algorithm", ["fedadg", "fedavg"])
def test_feature_plot_of_a_tiny_run(tmp_path, algorithm):
    from fedbed.plots import plot_features

    hp = SHORT if algorithm == "fedadg" else {}
    run_experiment(ExperimentConfig(algorithm=algorithm, model="lenet", rounds=1, local_steps=1, batch_size=16, hp=hp,
                                    run_dir=tmp_path), **QUIET)
    path, counts = plot_features(tmp_path, per_domain=12, seed=0)
    assert path.is_file() and path.stat().st_size > 0
    assert counts["source"] == 5 * 12  # five source domains of RotatedMNIST
    assert counts["reference"] == (5 * 12 if algorithm == "fedadg" else 0)  # G's samples, one per source sample's label


@pytest.mark.parametrize("reading", ["paper", "authors_code"])
def test_one_alignment_step_replayed_by_hand(reading):
    """One alignment batch (E0 = 0, E1 = 1 unit of one step, plain SGD), replayed with the same
    inputs, D, R and noise. ``paper``: F, C on 0.85·L_adv-f + 0.15·L_err against the old D (c5),
    then D (c7), then G on E[(1 − D(h'))²] (c8, Eq. 4). ``authors_code`` (the authors'
    ``pacs-ours/localTrain.py``): D first, then F, C on 0.85·L_err + 0.15·L_adv-f against the
    updated D, then G on E[D(h')²]."""
    hp = {"classification_epochs": 0, "alignment_epochs": 1, "reading": reading, "client_lr": 0.1,
          "generator_lr": 0.2, "discriminator_lr": 0.3}
    labels = torch.zeros(8, dtype=torch.long)  # one class: the batch's order cannot change any batch mean
    trainer, payload, data, state = client(hp, TrainingBudget(batch_size=8, local_steps=1), labels)
    torch.manual_seed(3)
    trainer.client_networks(state)
    replay = copy.deepcopy(trainer.model)
    replay.load_state_dict(payload.arrays)
    discriminator = trainer.new_discriminator()
    discriminator.load_state_dict(state["discriminator"])
    projection = state["projection"].clone()
    inputs = []
    trainer.model.featurizer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    torch.manual_seed(7)
    reply = trainer.fit(payload, data, state)

    torch.manual_seed(7)
    trainer.new_discriminator()  # the round builds D afresh before loading its state: the same draws
    x, y = inputs[0], labels
    one_hot = nn.functional.one_hot(y, 3).float()
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr)  # noqa: E731
    task = sgd([*replay.featurizer.parameters(), *replay.classifier.parameters()], 0.1)
    generator, critic = sgd(replay.generator.parameters(), 0.2), sgd(discriminator.parameters(), 0.3)
    score = lambda h: discriminator(h @ projection, one_hot)  # noqa: E731
    smoothed_ce = lambda logits: nn.functional.cross_entropy(logits, y, label_smoothing=0.1)  # noqa: E731

    def step(optimizer, loss):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def discriminator_step(h, h_reference):
        step(critic, score(h.detach()).pow(2).mean() + (1 - score(h_reference.detach())).pow(2).mean())

    features = replay.featurizer(x)
    if reading == "authors_code":
        reference = replay.generator(torch.rand(8, 16), one_hot)
        discriminator_step(features, reference)
        step(task, 0.85 * smoothed_ce(replay.classifier(features)) + 0.15 * (1 - score(features)).pow(2).mean())
        step(generator, score(reference).pow(2).mean())
    else:
        step(task, 0.85 * (1 - score(features)).pow(2).mean() + 0.15 * smoothed_ce(replay.classifier(features)))
        reference = replay.generator(torch.rand(8, 16), one_hot)
        discriminator_step(features, reference)
        step(generator, (1 - score(reference)).pow(2).mean())

    assert len(inputs) == 1
    for key, value in replay.state_dict().items():
        assert torch.allclose(reply.arrays[key], value, rtol=1e-5, atol=1e-7), key
        assert not torch.equal(value, payload.arrays[key]), key  # every array of F, C and G moved
    for key, value in discriminator.state_dict().items():
        assert torch.allclose(state["discriminator"][key], value, rtol=1e-5, atol=1e-7), key


def test_the_two_readings_train_differently():
    """The switch changes the computation: one round under each reading from the same start."""
    replies = {}
    for reading in ("paper", "authors_code"):
        trainer, payload, data, state = client({"reading": reading, "client_lr": 0.1})
        torch.manual_seed(7)
        replies[reading] = trainer.fit(payload, data, state)
    paper, authors = replies["paper"].arrays, replies["authors_code"].arrays
    assert any(not torch.allclose(paper[key], authors[key]) for key in paper if key.startswith("generator."))
    assert any(not torch.allclose(paper[key], authors[key]) for key in paper if key.startswith("featurizer."))
