"""FedSR: the KL term by hand, the prior kept on the client, the test-time averaging."""

import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.fedsr import gaussian_kl
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from fedbed.models import DomainClassifier, build_model


def test_gaussian_kl_by_hand():
    zero = gaussian_kl(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3))
    assert zero.item() == pytest.approx(0.0)
    # KL(N(1, 1) || N(0, 2²)) = log 2 + (1 + 1) / 8 − 1/2 per dimension
    kl = gaussian_kl(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2), 2 * torch.ones(1, 2))
    assert kl.item() == pytest.approx(2 * (math.log(2) + 0.25 - 0.5))


def fedsr_client():
    """A FedSR trainer, a payload, a client's data and its (empty) state."""
    torch.manual_seed(0)
    algorithm = get_algorithm("fedsr")
    hparams = algorithm.hyperparameters()
    factory = lambda: algorithm.wrap_model(build_model("lenet", (1, 28, 28), 3), hparams)  # noqa: E731
    trainer = algorithm.create_trainer(hparams, AlgorithmContext(factory, TrainingBudget(batch_size=4, local_steps=2), seed=0))
    data = ClientData(torch.rand(8, 1, 28, 28), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), torch.zeros(8, dtype=torch.long))
    return trainer, Payload(arrays=factory().state_dict(), config={"batch_seed": 1}), data, {}


def test_prior_stays_on_the_client_and_only_the_model_is_sent():
    trainer, payload, data, state = fedsr_client()
    sent = payload.arrays
    reply = trainer.fit(payload, data, state)
    assert set(reply.arrays) == set(sent)  # the prior is not among the arrays sent back
    assert set(state["prior"]) == {"mean", "raw_std", "scale"}
    assert state["prior"]["mean"].shape == (3, 84) and not torch.equal(state["prior"]["mean"], torch.zeros(3, 84))


def test_evaluation_averages_probabilities_over_samples():
    """In evaluation, the model FedSR's registration builds returns log((1/20) Σ_s softmax(C(μ + σ ε_s)))
    over 20 draws ε_s of z (the authors' test-time averaging), computed here by hand from the same
    draws: μ and σ = softplus(·) from the representation's linear map, then the classifier's."""
    algorithm = get_algorithm("fedsr")
    model = algorithm.wrap_model(DomainClassifier(nn.Flatten(), nn.Linear(2, 3), 2), algorithm.hyperparameters()).eval()
    representation_weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5], [-1.0, 0.25]])  # [2 z, d]: mean rows, std rows
    representation_bias = torch.tensor([0.0, 0.5, -1.0, 0.0])
    classifier_weight, classifier_bias = torch.tensor([[1.0, -1.0], [0.5, 2.0], [-2.0, 0.0]]), torch.tensor([0.1, 0.0, -0.1])
    with torch.no_grad():
        model.featurizer.head.weight.copy_(representation_weight)
        model.featurizer.head.bias.copy_(representation_bias)
        model.classifier.weight.copy_(classifier_weight)
        model.classifier.bias.copy_(classifier_bias)
    x = torch.tensor([[1.0, 2.0], [-0.5, 0.5]])
    calls = []
    model.classifier.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(3)
    log_probabilities = model(x)
    assert len(calls) == 20  # one classification per sample of z

    out = x @ representation_weight.T + representation_bias
    mean, std = out[:, :2], torch.log1p(torch.exp(out[:, 2:]))
    torch.manual_seed(3)
    draws = [torch.randn(2, 2) for _ in range(20)]
    expected = sum(torch.softmax((mean + std * draw) @ classifier_weight.T + classifier_bias, dim=1) for draw in draws) / 20
    assert torch.allclose(log_probabilities, expected.log(), atol=1e-6)
    one_draw = torch.softmax((mean + std * draws[0]) @ classifier_weight.T + classifier_bias, dim=1)
    assert not torch.allclose(log_probabilities, one_draw.log(), atol=1e-3)
    assert torch.allclose(log_probabilities.exp().sum(dim=1), torch.ones(2), atol=1e-6)


def test_a_failing_round_leaves_the_client_state_as_it_was(monkeypatch):
    """The prior is trained on a copy that replaces the state only when the round succeeds, so a
    dropped client keeps its state in-process as it does on Flower (where the state is not saved)."""
    from fedbed.algorithms.fedsr import FedSRTrainer

    trainer, payload, data, state = fedsr_client()
    trainer.fit(payload, data, state)
    before = {name: tensor.clone() for name, tensor in state["prior"].items()}
    calls = {"n": 0}
    original = FedSRTrainer.batch_loss

    def fails_on_the_second_batch(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("lost power")
        return original(self, *args)

    monkeypatch.setattr(FedSRTrainer, "batch_loss", fails_on_the_second_batch)
    with pytest.raises(RuntimeError):
        trainer.fit(payload, data, state)
    assert all(torch.equal(state["prior"][name], before[name]) for name in before)
    assert not any(tensor.requires_grad for tensor in state["prior"].values())
