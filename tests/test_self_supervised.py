"""Self-supervised clients (FedSimCLR, FedMoCo, FedBYOL, FedSimSiam, FedEMA, FedGaLA): NT-Xent by
hand, label blindness, what travels and what stays on the client, FedEMA's moving average by
hand, a resumed run equal to an uninterrupted one (MoCo's queue, BYOL's target, FedEMA's own model,
FedGaLA's reference), and the CIFAR-style ResNet-18."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.base.self_supervised_objectives import (
    negative_cosine,
    nt_xent_loss,
    queue_contrastive_loss,
)
from fedbed.algorithms.fedema import blend, ema_weight
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from fedbed.models import ModelError, build_model
from tests.helpers import make_dataset, run_straight_and_resumed, small_model

SMALL = {"projection_hidden_dim": 16, "projection_dim": 8}
"""Projector widths small enough for fast tests."""

SSL_METHODS = ["fedsimclr", "fedmoco", "fedbyol", "fedsimsiam", "fedema", "fedgala"]


def small_hp(name: str) -> dict:
    hp = dict(SMALL)
    if name in ("fedbyol", "fedsimsiam", "fedema"):
        hp["predictor_hidden_dim"] = 16
    if name == "fedmoco":
        hp["queue_size"] = 24
    return hp


def trainer_and_model(name: str, steps: int = 2):
    spec = get_algorithm(name)
    hparams = spec.hyperparameters(**small_hp(name))
    factory = lambda: spec.wrap_model(small_model((1, 8, 8), 2), hparams)  # noqa: E731
    context = AlgorithmContext(factory, TrainingBudget(batch_size=8, local_steps=steps), seed=0)
    torch.manual_seed(0)
    model = factory()
    return spec.create_trainer(hparams, context), model


def client_data(labels_shift: int = 0) -> ClientData:
    dataset = make_dataset(per_domain=20, domains=1)
    data = ClientData.from_dataset(dataset, torch.arange(len(dataset)))
    if labels_shift:
        data = ClientData(data.images, (data.targets + labels_shift) % 2, data.domains)
    return data


def fit(trainer, arrays, data, state, round_number=1, seed=5):
    payload = Payload(arrays=clone_arrays(arrays), config={"round": round_number, "rounds": 3, "batch_seed": seed})
    torch.manual_seed(seed)  # as the engine does before every fit
    return trainer.fit(payload, data, state)


def assert_equal_states(first, second, where="state"):
    """Two client states hold the same keys and equal values, tensors bit for bit, at every depth."""
    assert type(first) is type(second), where
    if isinstance(first, dict):
        assert first.keys() == second.keys(), where
        for key in first:
            assert_equal_states(first[key], second[key], f"{where}[{key!r}]")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for index, (a, b) in enumerate(zip(first, second)):
            assert_equal_states(a, b, f"{where}[{index}]")
    elif isinstance(first, torch.Tensor):
        assert first.dtype == second.dtype and torch.equal(first, second), where
    elif isinstance(first, float) and math.isnan(first):
        assert math.isnan(second), where
    else:
        assert first == second, where


def model_name(online_name: str) -> str:
    """The model's name of a parameter of ``online_network()`` (``0.`` featurizer, ``1.`` projector),
    the names a target or key network kept on the client also uses."""
    index, _, rest = online_name.partition(".")
    return {"0": "featurizer.", "1": "projector."}[index] + rest


def record_online_parameters(trainer) -> list[dict[str, torch.Tensor]]:
    """Make ``trainer`` record the online network's parameters (named as in ``online_network()``)
    after every optimiser step, just before the objective's moving average."""
    snapshots: list[dict[str, torch.Tensor]] = []
    after_step = trainer.objective.after_step

    def recording(model, modules):
        snapshots.append({name: p.detach().clone() for name, p in model.online_network().named_parameters()})
        after_step(model, modules)

    trainer.objective.after_step = recording
    return snapshots


def moving_average_by_hand(start: dict[str, torch.Tensor], snapshots: list[dict[str, torch.Tensor]], decay: float) -> dict:
    """ξ ← decay·ξ + (1 − decay)·θ_s for the online parameters θ_s after each step s, from ξ = ``start``."""
    average = {name: tensor.double() for name, tensor in start.items()}
    for online in snapshots:
        average = {name: decay * average[name] + (1 - decay) * online[name].double() for name in average}
    return average


def test_nt_xent_on_a_four_sample_hand_computed_case():
    # z0 = (1, 0), z1 = (0, 1) are the first views, z2 = (1, 0), z3 = (-1, 0) the second; τ = 1.
    # Anchor 0: positive z2 (s = 1), others z1 (0), z3 (-1): -log(e / (1 + e + 1/e)); anchor 2 alike.
    # Anchor 1: positive z3 (0), others z0 (0), z2 (0): log 3.
    # Anchor 3: positive z1 (0), others z0 (-1), z2 (-1): log(1 + 2/e).
    first, second = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    e = math.e
    aligned = -math.log(e / (1 + e + 1 / e))
    expected = (2 * aligned + math.log(3) + math.log(1 + 2 / e)) / 4
    assert nt_xent_loss(first, second, 1.0).item() == pytest.approx(expected)
    assert nt_xent_loss(3 * first, 0.5 * second, 1.0).item() == pytest.approx(expected)  # projections are normalised
    # τ = 1/2 doubles every similarity: anchor 1 and 3 change only through the others' -1s.
    aligned_half = -math.log(e**2 / (1 + e**2 + e**-2))
    expected_half = (2 * aligned_half + math.log(3) + math.log(1 + 2 / e**2)) / 4
    assert nt_xent_loss(first, second, 0.5).item() == pytest.approx(expected_half)
    with pytest.raises(ValueError, match="two \\[B, d\\] projections"):
        nt_xent_loss(first, second[:1], 1.0)


def test_moco_and_siamese_losses_by_hand():
    # One query (1, 0), its key (1, 0), a queue with (0, 1) and (-1, 0); τ = 1:
    # -log(e / (e + 1 + 1/e)).
    loss = queue_contrastive_loss(torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0], [-1.0, 0.0]]), 1.0)
    assert loss.item() == pytest.approx(-math.log(math.e / (math.e + 1 + 1 / math.e)))
    # cos((1, 0), (1, 1)) = 1/√2 and cos((0, 1), (0, -3)) = -1: mean of the negatives = (-1/√2 + 1) / 2.
    predictions, targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 1.0], [0.0, -3.0]])
    assert negative_cosine(predictions, targets).item() == pytest.approx((1 - 1 / math.sqrt(2)) / 2)


def test_moco_sums_its_two_directions():
    """MoCo's symmetrised loss is L(q1, k2) + L(q2, k1), each a batch mean (MoCo v3, Algorithm 1;
    MoCo's CIFAR demonstration): twice the mean over the 2B queries, read from the queue as it was
    before this batch's keys were enqueued."""
    from fedbed.algorithms.base.self_supervised_objectives import (
        MoCoObjective,
        swap_halves,
    )

    class Toy(nn.Module):
        projection_dim = 3

        def __init__(self):
            super().__init__()
            self.featurizer, self.projector = nn.Flatten(), nn.Linear(4, 3)

        def online_network(self):
            return nn.Sequential(self.featurizer, self.projector)

        def embed(self, images):
            return self.projector(self.featurizer(images))

    torch.manual_seed(0)
    model, objective = Toy(), MoCoObjective(temperature=0.2, queue_size=8)
    modules, buffers = objective.local_modules(model), objective.initial_buffers(model)
    queue = buffers["queue"].clone()
    views = torch.randn(4, 1, 2, 2)  # B = 2 images, two views each
    loss = objective.loss(model, views, modules, buffers)
    queries = model.embed(views)
    keys = nn.functional.normalize(modules["key_network"](swap_halves(views)), dim=1)
    each = [queue_contrastive_loss(queries[rows], keys[rows], queue, 0.2) for rows in (slice(0, 2), slice(2, 4))]
    assert loss.item() == pytest.approx((each[0] + each[1]).item(), rel=1e-6)
    assert loss.item() == pytest.approx(2 * queue_contrastive_loss(queries, keys, queue, 0.2).item(), rel=1e-6)
    assert not torch.equal(buffers["queue"], queue)  # this batch's keys were enqueued after


@pytest.mark.parametrize("name", SSL_METHODS)
def test_training_never_reads_labels(name):
    """The same client trained on its labels and on shifted labels gives bit-identical models
    and states."""
    trainer, model = trainer_and_model(name)
    arrays = model.state_dict()
    runs = []
    for shift in (0, 1):
        state: dict = {}
        first = fit(trainer, arrays, client_data(shift), state)
        second = fit(trainer, first.arrays, client_data(shift), state, round_number=2, seed=6)
        runs.append((second, state))
    (a, state_a), (b, state_b) = runs
    assert a.metrics == b.metrics
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    assert any(not torch.equal(a.arrays[k], arrays[k]) for k in a.arrays)  # it did train
    assert_equal_states(state_a, state_b)


@pytest.mark.parametrize("name, local", [("fedbyol", {"predictor", "target_network"}), ("fedsimsiam", {"predictor"}),
                                         ("fedmoco", {"key_network"}), ("fedsimclr", set())])
def test_replies_carry_only_the_averaged_parts(name, local):
    trainer, model = trainer_and_model(name)
    arrays = model.state_dict()
    state: dict = {}
    reply = fit(trainer, arrays, client_data(), state)
    assert set(reply.arrays) == set(arrays)  # featurizer, projector, classifier: what the server averages
    assert any(k.startswith("projector.") for k in reply.arrays)
    assert not any("predictor" in k or "target" in k or "key" in k for k in reply.arrays)
    assert set(state.get("modules", {})) == local
    assert torch.equal(reply.arrays["classifier.weight"], arrays["classifier.weight"])  # the head gets no gradient
    if "predictor" in local:  # the predictor is trained, and it stays on the client from round to round
        before = clone_arrays(state["modules"]["predictor"])
        fit(trainer, reply.arrays, client_data(), state, round_number=2, seed=6)
        assert any(not torch.equal(before[k], state["modules"]["predictor"][k]) for k in before)


def test_the_moco_queue_and_momentum_encoder_stay_on_the_client():
    """MoCo's queue wraps on the client, and after two steps its key encoder is the moving average
    ξ₂ = 0.99 (0.99 θ₀ + 0.01 θ₁) + 0.01 θ₂ of the online encoder after each step (θ₀: the model
    the server sent), computed by hand from the recorded online parameters."""
    trainer, model = trainer_and_model("fedmoco", steps=2)
    assert trainer.objective.key_momentum == 0.99
    snapshots = record_online_parameters(trainer)
    state: dict = {}
    sent = model.state_dict()
    reply = fit(trainer, sent, client_data(), state)
    # 2 steps of 8 images = 2 x 16 keys into a queue of 24: the position wraps to 32 mod 24 = 8.
    assert int(state["buffers"]["queue_position"]) == 8 and state["buffers"]["queue"].shape == (24, 8)
    assert torch.allclose(state["buffers"]["queue"].norm(dim=1), torch.ones(24))
    assert len(snapshots) == 2 and all(torch.equal(snapshots[1][k], reply.arrays[model_name(k)]) for k in snapshots[1])
    key = state["modules"]["key_network"]
    expected = moving_average_by_hand({name: sent[model_name(name)] for name in snapshots[0]}, snapshots, 0.99)
    for name, tensor in expected.items():
        assert torch.allclose(key[name].double(), tensor, rtol=1e-6, atol=1e-7), name
    assert not torch.equal(key["1.3.weight"], reply.arrays["projector.3.weight"])  # 0.99: not the online encoder


@pytest.mark.parametrize("name, module, decay", [("fedbyol", "target_network", "target_decay"),
                                                 ("fedmoco", "key_network", "key_momentum")])
def test_the_target_and_key_encoders_are_moving_averages_after_one_step(name, module, decay):
    """BYOL's target network and MoCo's key encoder after one step: ξ = decay·θ₀ + (1 − decay)·θ₁
    for each parameter, θ₀ the online network the server sent (the encoder's copy at the client's
    first round) and θ₁ the online network after the step (the reply), decay 0.99."""
    trainer, model = trainer_and_model(name, steps=1)
    decay_value = getattr(trainer.objective, decay)
    assert decay_value == 0.99
    state: dict = {}
    sent = model.state_dict()
    reply = fit(trainer, sent, client_data(), state)
    average = state["modules"][module]
    moved = 0.0
    for name, _ in model.online_network().named_parameters():
        before, after = sent[model_name(name)].double(), reply.arrays[model_name(name)].double()
        moved = max(moved, float((after - before).abs().max()))
        expected = decay_value * before + (1 - decay_value) * after
        assert torch.allclose(average[name].double(), expected, rtol=1e-6, atol=1e-7), name
    assert moved > 1e-3  # the step moved the online network: an average that stayed put would differ by 1e-5 or more


def test_fedema_moving_average_by_hand():
    # W_g = (3, 4) and the client's own W_k = (0, 0): divergence 5; τ = 0.7 fixes λ = 0.7 / 5 = 0.14,
    # so μ = 0.7 and the round starts from 0.7 (0, 0) + 0.3 (3, 4) = (0.9, 1.2).
    global_arrays, own = {"w": torch.tensor([3.0, 4.0]), "steps": torch.tensor(7)}, {"w": torch.zeros(2), "steps": torch.tensor(2)}
    weight, scaler = ema_weight(global_arrays, own, ["w"], None, 0.7)
    assert weight == pytest.approx(0.7) and scaler == pytest.approx(0.14)
    start = blend(own, global_arrays, weight)
    assert torch.allclose(start["w"], torch.tensor([0.9, 1.2])) and int(start["steps"]) == 7
    # Later rounds keep λ: a divergence of 2.5 gives μ = 0.35, one of 10 is capped at μ = 1.
    assert ema_weight({"w": torch.tensor([1.5, 2.0])}, {"w": torch.zeros(2)}, ["w"], scaler, 0.7)[0] == pytest.approx(0.35)
    assert ema_weight({"w": torch.tensor([6.0, 8.0])}, {"w": torch.zeros(2)}, ["w"], scaler, 0.7)[0] == 1.0


def test_the_fedema_client_starts_from_its_moving_average():
    trainer, model = trainer_and_model("fedema")
    state: dict = {}
    first = fit(trainer, model.state_dict(), client_data(), state)
    assert first.metrics["ema_weight"] == 0.0  # no own model yet: the round starts from the global one
    # FedEMA's predictor travels and trains (the authors average it); the target network stays.
    assert any(k.startswith("predictor.") for k in first.arrays) and set(state["modules"]) == {"target_network"}
    assert not torch.equal(first.arrays["predictor.0.weight"], model.state_dict()["predictor.0.weight"])
    own = clone_arrays(state["own_model"])
    assert all(torch.equal(own[k], first.arrays[k]) for k in own)
    # The divergence is the encoder's: a global model that differs only in projector and predictor
    # gives no divergence, hence nothing to average (μ = 0) and λ not fixed yet.
    heads_moved = {k: v + 0.5 if k.startswith(("projector.", "predictor.")) else v for k, v in first.arrays.items()}
    probe_state = copy.deepcopy(state)
    assert fit(trainer, heads_moved, client_data(), probe_state, round_number=2, seed=6).metrics["ema_weight"] == 0.0
    moved = {k: v + 0.5 if v.is_floating_point() else v for k, v in first.arrays.items()}
    second = fit(trainer, moved, client_data(), state, round_number=2, seed=6)
    assert second.metrics["ema_weight"] == pytest.approx(0.7)  # τ at the first moving average
    assert state["ema_scaler"] > 0


def test_a_resumed_moco_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """MoCo's momentum encoder and queue live in the client states of the checkpoint."""
    from fedbed.algorithms.base.self_supervised import SelfSupervisedTrainer

    settings = dict(algorithm="fedmoco", model="lenet", rounds=3, local_steps=2, batch_size=16, hp=small_hp("fedmoco"),
                    linear_probe={"epochs": 2})
    straight, resumed, logs = run_straight_and_resumed(tmp_path, monkeypatch, SelfSupervisedTrainer, **settings)
    assert logs["resumed"] == logs["straight"] and len(logs["straight"]) == 3
    assert resumed["selection"] == straight["selection"]
    checkpoints = [torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in ("straight", "resumed")]
    queues = [[s["buffers"]["queue"] for s in c["client_states"]] for c in checkpoints]
    keys = [[s["modules"]["key_network"]["0.layers.0.weight"] for s in c["client_states"]] for c in checkpoints]
    assert all(torch.equal(a, b) for a, b in zip(*queues)) and all(torch.equal(a, b) for a, b in zip(*keys))
    models = [c["strategy"]["model"] for c in checkpoints]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


@pytest.mark.parametrize("name", ["fedbyol", "fedema", "fedgala"])
def test_a_resumed_run_equals_an_uninterrupted_one(name, tmp_path, monkeypatch):
    """What each method keeps between rounds survives the checkpoint: BYOL's target network on the
    client, FedEMA's own previous model and its scaler on the client, FedGaLA's previous global
    model on the server (the reference of round 3 is θ² − θ¹)."""
    settings = dict(algorithm=name, model="lenet", rounds=3, local_steps=2, batch_size=16, hp=small_hp(name),
                    linear_probe={"epochs": 2})
    straight, resumed, logs = run_straight_and_resumed(tmp_path, monkeypatch, get_algorithm(name).trainer_class,
                                                       **settings)
    assert logs["resumed"] == logs["straight"] and len(logs["straight"]) == 3
    assert resumed["selection"] == straight["selection"]
    checkpoints = [torch.load(tmp_path / run / "checkpoint.pt", weights_only=False) for run in ("straight", "resumed")]
    models = [c["strategy"]["model"] for c in checkpoints]
    assert models[0].keys() == models[1].keys() and all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_self_supervised_methods_choose_the_linear_probe_and_their_own_views():
    for name in SSL_METHODS:
        spec = get_algorithm(name)
        assert spec.evaluation_protocol == "linear_probe" and spec.draws_its_own_views
        assert spec.hyperparameters().augmentation == "simclr"
    assert get_algorithm("fedsimclr").hyperparameters().temperature == 0.5
    with pytest.raises(TypeError, match="SelfSupervisedModel"):
        spec = get_algorithm("fedsimclr")
        spec.create_trainer(spec.hyperparameters(), AlgorithmContext(lambda: small_model((1, 8, 8), 2), TrainingBudget(8, 1), 0))


def test_cifar_resnet18_follows_appendix_b2():
    torch.manual_seed(0)
    model = build_model("resnet18_cifar", (3, 32, 32), 7)
    featurizer = model.featurizer
    assert featurizer.conv1.kernel_size == (3, 3) and featurizer.conv1.stride == (1, 1)
    assert isinstance(featurizer.maxpool, nn.Identity) and isinstance(featurizer.avgpool, nn.AvgPool2d)
    assert featurizer.avgpool.kernel_size == 4 and isinstance(featurizer.fc, nn.Identity)
    model.eval()
    assert featurizer(torch.randn(2, 3, 32, 32)).shape == (2, 512) and model.feature_dim == 512
    with pytest.raises(ModelError, match="32x32"):
        build_model("resnet18_cifar", (3, 64, 64), 7)
