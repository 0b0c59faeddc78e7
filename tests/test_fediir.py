"""FedIIR (the authors' code YamingGuo98/FedIIR): the gradient penalty and the full-pass mean
gradient by hand (closed-form softmax cross-entropy gradients), the server's moving average and
its gradient slots, λ = 0 equal to FedAvg's client bit for bit, and a short real run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm, resolve_hyperparameters
from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedTrainer,
)
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.fediir import (
    GRADIENT_PREFIX,
    FedIIRHyperparameters,
    FedIIRStrategy,
    FedIIRTrainer,
    gradient_penalty,
)
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import ClientInfo, Payload, Reply
from fedbed.models import DomainClassifier

SLOTS = (GRADIENT_PREFIX + "classifier.weight", GRADIENT_PREFIX + "classifier.bias")


def linear_head_model(featurizer: nn.Module | None = None, d: int = 2, classes: int = 3) -> DomainClassifier:
    """Fixed features (``Flatten``, or ``featurizer``) and a linear head ``[classes, d]`` with set weights."""
    model = DomainClassifier(featurizer or nn.Flatten(), nn.Linear(d, classes), d)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.arange(classes * d, dtype=torch.float32).reshape(classes, d) / 10 - 0.2)
        model.classifier.bias.copy_(torch.tensor([0.1, -0.3, 0.2])[:classes])
    return model


def head_gradient_by_hand(weight, bias, features, targets):
    """∇_W, ∇_b of the batch-mean cross-entropy of a linear head: G = (softmax − onehot) / B,
    ∇_W = Gᵀ x ``[C, d]``, ∇_b = Σ_i G_i ``[C]``."""
    probabilities = torch.softmax(features @ weight.T + bias, dim=1)
    residual = (probabilities - nn.functional.one_hot(targets, len(bias)).to(features.dtype)) / len(targets)
    return residual.T @ features, residual.sum(dim=0)


def trainer_and_context(model_factory, batch_size=2, local_steps=3, **hp):
    context = AlgorithmContext(model_factory, TrainingBudget(batch_size=batch_size, local_steps=local_steps), seed=0)
    return FedIIRTrainer(FedIIRHyperparameters(**hp), context), context


def payload_of(model, mean_weight, mean_bias, **config):
    arrays = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    arrays.update({SLOTS[0]: mean_weight, SLOTS[1]: mean_bias})
    return Payload(arrays=arrays, config={"round": 1, "rounds": 1, "batch_seed": 7, **config})


def test_the_penalty_and_its_gradient_into_the_featurizer_equal_the_closed_form():
    torch.manual_seed(0)
    trainer, _ = trainer_and_context(lambda: linear_head_model(nn.Linear(2, 2)), penalty_weight=0.5)
    model = trainer.model
    x, y = torch.randn(4, 2), torch.tensor([0, 2, 1, 2])
    mean_weight, mean_bias = torch.randn(3, 2), torch.randn(3)
    model.load_state_dict(payload_of(model, mean_weight, mean_bias).arrays)
    payload = payload_of(model, mean_weight, mean_bias)
    loss = trainer.batch_loss(model, Batch(x, y), payload, {})
    features = model.featurizer(x)
    grad_w, grad_b = head_gradient_by_hand(model.classifier.weight, model.classifier.bias, features, y)
    penalty = ((grad_w - mean_weight) ** 2).sum() + ((grad_b - mean_bias) ** 2).sum()
    ce = nn.functional.cross_entropy(model(x), y)
    assert loss.item() == pytest.approx((ce + 0.5 * penalty).item(), rel=1e-6)
    assert trainer._logged["penalty"] == [pytest.approx(penalty.item(), rel=1e-6)]
    # create_graph: the penalty trains the featurizer as the closed form's own derivative says.
    by_trainer = torch.autograd.grad(loss, model.featurizer.weight)[0]
    by_hand = torch.autograd.grad(ce + 0.5 * penalty, model.featurizer.weight, retain_graph=True)[0]
    assert torch.allclose(by_trainer, by_hand, atol=1e-6)
    assert not torch.allclose(by_trainer, torch.autograd.grad(ce, model.featurizer.weight)[0], atol=1e-4)
    # The module function returns the same two terms.
    value_ce, value_penalty = gradient_penalty(model, x, y, {"classifier.weight": mean_weight, "classifier.bias": mean_bias})
    assert value_ce.item() == pytest.approx(ce.item()) and value_penalty.item() == pytest.approx(penalty.item(), rel=1e-6)


def fake_reply(model, gradient_weight, gradient_bias, num_examples, shift):
    arrays = {name: tensor + shift for name, tensor in model.state_dict().items()}
    arrays.update({SLOTS[0]: gradient_weight, SLOTS[1]: gradient_bias})
    return Reply(arrays=arrays, num_examples=num_examples, metrics={"loss": 1.0, "penalty": 0.5 + shift})


@pytest.mark.parametrize("uniform", [False, True])
def test_the_server_averages_the_returned_gradients_by_n_k_into_its_moving_average(uniform):
    model = linear_head_model()
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    strategy = FedIIRStrategy(seed=0, gradient_ema=0.9, uniform=uniform)
    strategy.initialize(model, [ClientInfo(0, 10, (0,)), ClientInfo(1, 30, (1,))])
    payloads = strategy.configure_round(1, [0, 1])
    assert all(torch.equal(payloads[c].arrays[slot], torch.zeros_like(payloads[c].arrays[slot])) for c in (0, 1) for slot in SLOTS)
    assert set(payloads[0].arrays) == {*start, *SLOTS}
    g = [(torch.full((3, 2), 1.0), torch.full((3,), 2.0)), (torch.full((3, 2), -3.0), torch.full((3,), 6.0))]
    replies = {c: fake_reply(model, *g[c], num_examples=(10, 30)[c], shift=(1.0, 2.0)[c]) for c in (0, 1)}
    summary = strategy.aggregate(1, replies)
    # new mean = 0.25 g_0 + 0.75 g_1 (n_k/n, whatever the model weighting); ḡ = 0.9 · 0 + 0.1 · new
    expected_weight, expected_bias = 0.1 * (0.25 * 1.0 + 0.75 * -3.0), 0.1 * (0.25 * 2.0 + 0.75 * 6.0)
    assert torch.allclose(strategy.mean_gradient["classifier.weight"], torch.full((3, 2), expected_weight))
    assert torch.allclose(strategy.mean_gradient["classifier.bias"], torch.full((3,), expected_bias))
    assert summary.metrics["ema_gradient_norm"] == pytest.approx(math.sqrt(6 * expected_weight ** 2 + 3 * expected_bias ** 2))
    assert summary.metrics["mean_penalty"] == pytest.approx(2.0)
    shift = 1.5 if uniform else 0.25 * 1.0 + 0.75 * 2.0  # the model: 1/K or n_k/n, and no slot in it
    assert set(model.state_dict()) == set(start)
    assert all(torch.allclose(model.state_dict()[n], start[n] + shift) for n in start)
    second = strategy.configure_round(2, [1])[1]
    assert torch.allclose(second.arrays[SLOTS[0]], torch.full((3, 2), expected_weight))
    replies = {1: fake_reply(model, torch.full((3, 2), 10.0), torch.zeros(3), num_examples=30, shift=0.0)}
    strategy.aggregate(2, replies)
    assert torch.allclose(strategy.mean_gradient["classifier.weight"], torch.full((3, 2), 0.9 * expected_weight + 0.1 * 10.0))
    assert torch.allclose(strategy.mean_gradient["classifier.bias"], torch.full((3,), 0.9 * expected_bias))
    # state_dict round trip: a fresh strategy resumes with the same ḡ and model, and owns its copy.
    state = strategy.state_dict()
    resumed = FedIIRStrategy(seed=0, gradient_ema=0.9, uniform=uniform)
    resumed.initialize(linear_head_model(), [ClientInfo(0, 10, (0,)), ClientInfo(1, 30, (1,))])
    resumed.load_state_dict(state)
    state["mean_gradient"]["classifier.bias"].add_(1.0)
    sent, again = strategy.configure_round(3, [0])[0].arrays, resumed.configure_round(3, [0])[0].arrays
    assert set(sent) == set(again) and all(torch.equal(sent[n], again[n]) for n in sent)


def test_the_reply_returns_the_full_pass_mean_gradient_of_the_received_model():
    torch.manual_seed(0)
    trainer, _ = trainer_and_context(linear_head_model, batch_size=2, local_steps=3, penalty_weight=0.1, client_lr=0.1)
    received = linear_head_model()
    features, targets = torch.randn(5, 2), torch.tensor([0, 1, 2, 2, 1])
    data = ClientData(features.reshape(5, 1, 1, 2), targets, torch.zeros(5, dtype=torch.int64))
    payload = payload_of(received, torch.randn(3, 2), torch.randn(3))
    reply = trainer.fit(payload, data, {})
    batches = [head_gradient_by_hand(received.classifier.weight.detach(), received.classifier.bias.detach(),
                                     features[s:s + 2], targets[s:s + 2]) for s in (0, 2, 4)]  # batches 2, 2, 1
    assert torch.allclose(reply.arrays[SLOTS[0]], sum(w for w, _ in batches) / 3, atol=1e-6)
    assert torch.allclose(reply.arrays[SLOTS[1]], sum(b for _, b in batches) / 3, atol=1e-6)
    assert set(reply.arrays) == set(payload.arrays) and reply.num_examples == 5
    assert not torch.equal(reply.arrays["classifier.weight"], received.classifier.weight.detach())  # it trained
    assert "penalty" in reply.metrics and math.isfinite(reply.metrics["penalty"])
    with pytest.raises(ValueError, match="needs the server's mean gradient"):
        trainer.fit(Payload(arrays=dict(received.state_dict()), config=payload.config), data, {})


def noisy_model() -> DomainClassifier:
    """BatchNorm (running statistics) and dropout (random draws) in the featurizer: a mean-gradient
    pass that touched either would change the training that follows."""
    torch.manual_seed(3)
    featurizer = nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3))
    return DomainClassifier(featurizer, nn.Linear(6, 3), 6)


def test_with_no_penalty_the_trained_model_is_fedavgs_bit_for_bit():
    data = ClientData(torch.randn(11, 1, 2, 2), torch.arange(11) % 3, torch.zeros(11, dtype=torch.int64))
    options = {"client_optimizer": "sgd", "client_lr": 0.05, "client_momentum": 0.9}
    fediir, context = trainer_and_context(noisy_model, batch_size=4, local_steps=5, penalty_weight=0.0, **options)
    fedavg = SupervisedTrainer(LocalTrainingHyperparameters(**options), context)
    received = noisy_model()
    payload = payload_of(received, torch.randn(3, 6), torch.randn(3))
    torch.manual_seed(11)
    ours = fediir.fit(payload, data, {})
    torch.manual_seed(11)
    theirs = fedavg.fit(Payload(arrays=dict(received.state_dict()), config=payload.config), data, {})
    assert set(ours.arrays) == set(theirs.arrays) | set(SLOTS)
    assert all(torch.equal(ours.arrays[n], theirs.arrays[n]) for n in theirs.arrays)
    assert ours.metrics["loss"] == theirs.metrics["loss"]
    assert not torch.equal(ours.arrays["featurizer.2.running_mean"], received.state_dict()["featurizer.2.running_mean"])


def test_registration_and_the_dataset_defaults():
    algorithm = get_algorithm("fediir")
    assert "ICML 2023" in algorithm.summary and not algorithm.secure_aggregation_compatible
    assert resolve_hyperparameters(algorithm, {}, "PACS").penalty_weight == 1e-3
    assert resolve_hyperparameters(algorithm, {}, "RotatedMNIST").penalty_weight == 1e-2
    assert resolve_hyperparameters(algorithm, {}, "OfficeHome").penalty_weight == 5e-4
    assert resolve_hyperparameters(algorithm, {"penalty_weight": 0.2}, "VLCS").penalty_weight == 0.2
    assert resolve_hyperparameters(algorithm, {}, "VLCS").gradient_ema == 0.95


def test_a_short_real_run_finishes_with_finite_losses(tmp_path):
    config = ExperimentConfig(algorithm="fediir", model="lenet", rounds=2, local_steps=2, batch_size=16, run_dir=tmp_path)
    summary = run_experiment(config, progress=False, echo=lambda *_: None)
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 and not any(r["dropped"] or r["kept_previous_model"] for r in rounds)
    for record in rounds:
        assert all(norm > 0 for norm in record["alignment"]["update_norms"])  # every client trained
        metrics = record["metrics"]
        assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["mean_penalty"])
        assert metrics["ema_gradient_norm"] > 0
    assert rounds[1]["metrics"]["ema_gradient_norm"] != rounds[0]["metrics"]["ema_gradient_norm"]
    assert summary["evaluation"]["protocol"] == "argmax"


def test_the_gradient_slots_are_left_out_of_the_measured_updates():
    """The engine's update telemetry and outlier check measure the model only: a slot that moved
    by 100 changes nothing, a model array that moved by 3 is the whole update."""
    from fedbed.algorithms.fediir import GRADIENT_PREFIX, FedIIRStrategy
    from fedbed.federation.engine import client_update_gram
    from fedbed.federation.messages import Payload, Reply

    assert FedIIRStrategy.auxiliary_array_prefixes == (GRADIENT_PREFIX,)
    sent = {"classifier.bias": torch.zeros(2), GRADIENT_PREFIX + "classifier.bias": torch.zeros(2)}
    returned = {"classifier.bias": torch.tensor([3.0, 0.0]), GRADIENT_PREFIX + "classifier.bias": torch.tensor([100.0, 0.0])}
    _, gram = client_update_gram({0: Payload(arrays=sent)}, {0: Reply(arrays=returned, num_examples=1)}, (GRADIENT_PREFIX,))
    assert gram.tolist() == [[9.0]]  # ||(3, 0)||²
    _, both = client_update_gram({0: Payload(arrays=sent)}, {0: Reply(arrays=returned, num_examples=1)})
    assert both.tolist() == [[9.0 + 10_000.0]]
