"""FedSR: the KL term by hand, the prior kept on the client, the test-time averaging."""

import math

import pytest
import torch

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.fedsr import FedSRModel, gaussian_kl
from fedbed.algorithms.registry import AlgorithmContext, TrainingBudget
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from fedbed.models import build_model


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
    torch.manual_seed(0)
    model = FedSRModel(build_model("lenet", (1, 28, 28), 4), z_dim=5).eval()
    log_probabilities = model(torch.rand(6, 1, 28, 28))
    assert log_probabilities.shape == (6, 4)
    assert torch.allclose(log_probabilities.exp().sum(dim=1), torch.ones(6), atol=1e-5)


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
