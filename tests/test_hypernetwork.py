"""hFedF and pFedHN: GradAlign, EMA warm-up, the server's vector-Jacobian products, payloads and the sign."""

import pytest
import torch
from torch import nn

from fedbed.algorithms.hypernetwork import (
    ExponentialMovingAverage,
    HFedFHyperparameters,
    HypernetworkStrategy,
)
from fedbed.models.hypernetwork import HyperNetwork, embedding_dimension
from fedbed.federation.messages import ClientInfo, Reply


def test_ema_warm_up_by_hand():
    value = torch.tensor([0.0])
    ema = ExponentialMovingAverage(decay=0.5, warmup_rounds=2)
    ema.update([value], 1)
    value += 10  # before the warm-up round nothing is averaged
    ema.update([value], 2)
    assert value.item() == 10 and ema.average[0].item() == 10  # the average starts at round w
    value.fill_(4.0)
    ema.update([value], 3)
    assert value.item() == pytest.approx(0.5 * 4 + 0.5 * 10)  # α·current + (1 − α)·average
    value.fill_(1.0)
    ema.update([value], 4)
    assert value.item() == pytest.approx(0.5 * 1 + 0.5 * 7)


def tiny_strategy(**hp):
    torch.manual_seed(0)
    strategy = HypernetworkStrategy(HFedFHyperparameters(**hp), seed=0)
    strategy.initialize(nn.Linear(3, 2), [ClientInfo(0, 10, (0,)), ClientInfo(1, 10, (1,))])
    return strategy


def test_embedding_table_and_heads_follow_table_8():
    network = HyperNetwork(5, {"w": torch.Size([2, 3]), "b": torch.Size([2])})
    assert network.embeddings.weight.shape == (5, embedding_dimension(5)) == (5, 2)
    linears = [m for m in network.body if isinstance(m, nn.Linear)]
    assert [l.out_features for l in linears] == [50, 50, 50, 50]
    assert sum(isinstance(m, nn.LeakyReLU) for m in network.body) == 3
    assert {k: v.shape for k, v in network(3).items()} == {"w": (2, 3), "b": (2,)}


def test_each_client_receives_only_its_own_generated_weights():
    strategy = tiny_strategy()
    payloads = strategy.configure_round(1, [0, 1])
    assert set(payloads[0].arrays) == set(nn.Linear(3, 2).state_dict()) == {"weight", "bias"}
    assert not torch.equal(payloads[0].arrays["weight"], payloads[1].arrays["weight"])
    for client in (0, 1):
        generated = strategy.hypernetwork(client)
        assert torch.allclose(payloads[client].arrays["weight"], generated["weight"])
    sent_numbers = sum(t.numel() for t in payloads[0].arrays.values())
    assert sent_numbers == 8 < sum(p.numel() for p in strategy.hypernetwork.parameters())


def test_server_vector_jacobian_products_equal_autograd():
    strategy = tiny_strategy()
    strategy.configure_round(1, [0, 1])
    torch.manual_seed(3)
    replies = {c: Reply({k: v + torch.randn_like(v) for k, v in strategy.sent[c].items()}, 10) for c in (0, 1)}
    order, g_theta, g_nu = strategy.client_gradients(replies)
    for row, client in enumerate(order):
        strategy.hypernetwork.zero_grad()
        generated = strategy.hypernetwork(client)
        # d/dθ Σ_n <h(θ, ν[i])_n, φ_before,n − φ_after,n>
        surrogate = sum((generated[n] * (strategy.sent[client][n] - replies[client].arrays[n])).sum() for n in generated)
        surrogate.backward()
        expected_theta = torch.cat([p.grad.reshape(-1) for p in strategy.hypernetwork.body_parameters()])
        assert torch.allclose(g_theta[row], expected_theta, atol=1e-6)
        assert torch.allclose(g_nu[row], strategy.hypernetwork.embeddings.weight.grad.reshape(-1), atol=1e-6)
        assert g_nu[row].view(2, -1)[1 - client].abs().sum() == 0  # only the client's own embedding row


@pytest.mark.parametrize("hp", [
    {"ema_warmup_rounds": 1}, {"use_gradalign": False, "use_ema": False}, {"gradalign_softmax": "negative"},
])
def test_one_round_moves_generated_weights_towards_the_trained_ones(hp):
    strategy = tiny_strategy(**hp)
    before = strategy.configure_round(1, [0])[0].arrays
    trained = {k: v + 0.5 for k, v in before.items()}  # what the client ended with
    strategy.aggregate(1, {0: Reply(trained, 10, {"loss": 1.0})})
    after = strategy.generate(0)

    def distance(a):
        return sum(float(((a[k] - trained[k]) ** 2).sum()) for k in trained)

    assert distance(after) < distance(before)


def test_ema_smooths_the_server_step_after_warm_up():
    plain, smoothed = tiny_strategy(use_ema=False), tiny_strategy(ema_warmup_rounds=1, ema_decay=0.5)
    for round_number in (1, 2):
        for strategy in (plain, smoothed):
            before = strategy.configure_round(round_number, [0])[0].arrays
            strategy.aggregate(round_number, {0: Reply({k: v + 0.5 for k, v in before.items()}, 10, {"loss": 1.0})})
    # Round 1 starts the average; round 2's step is halved by α = 0.5, so the weights moved less.
    start = tiny_strategy().hypernetwork.state_dict()
    moved = lambda s: sum(float((s.hypernetwork.state_dict()[k] - start[k]).abs().sum()) for k in start)  # noqa: E731
    assert 0 < moved(smoothed) < moved(plain)


def test_models_with_statistics_buffers_are_refused():
    strategy = HypernetworkStrategy(HFedFHyperparameters(), seed=0)
    with pytest.raises(ValueError, match="statistics buffers"):
        strategy.initialize(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), [ClientInfo(0, 1, (0,))])
