"""FedSAM and FedASAM (fedsam.py): one SAM / ASAM step computed by hand, ρ = 0 is FedAvg's client
bit for bit, SWA's running mean and cyclical learning rate on hand-made rounds, its resumption,
and short real runs."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.local_training import SupervisedTrainer
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.fedsam import (
    FedASAMHyperparameters,
    FedASAMTrainer,
    FedSAMHyperparameters,
    FedSAMTrainer,
    SWAStrategy,
    swa_start_round,
)
from fedbed.config import ConfigError
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import ClientInfo, Payload, Reply
from fedbed.models import DomainClassifier
from tests.helpers import make_dataset, run_straight_and_resumed

QUIET = {"progress": False, "echo": lambda *_: None}


def linear_case():
    """Six 4-dimensional samples of 3 classes (already model input) and a linear model's weights."""
    generator = torch.Generator().manual_seed(3)
    inputs, labels = torch.randn(6, 4, generator=generator), torch.tensor([0, 1, 2, 0, 1, 2])
    weight, bias = torch.randn(3, 4, generator=generator), torch.randn(3, generator=generator)
    return ClientData(inputs, labels, torch.zeros(6, dtype=torch.long), scaling="unit"), weight, bias


def gradient(inputs, labels, weight, bias):
    weight, bias = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(inputs @ weight.T + bias, labels)
    return float(loss.detach()), *torch.autograd.grad(loss, (weight, bias))


def one_step(trainer_class, hparams, data, weight, bias):
    context = AlgorithmContext(lambda: nn.Linear(4, 3), TrainingBudget(batch_size=6, local_steps=1), seed=0)
    return trainer_class(hparams, context).fit(Payload({"weight": weight, "bias": bias}, {"batch_seed": 0}), data, {})


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_sam_and_asam_step_by_hand(adaptive):
    data, w, b = linear_case()
    rho, eta, lr = 0.5, 0.3, 0.4
    loss, g_w, g_b = gradient(data.images, data.targets, w, b)
    sam_norm = torch.sqrt((g_w ** 2).sum() + (g_b ** 2).sum())
    t_w = w.abs() + eta  # ASAM: T_w = |w| + η on the weight, T = 1 on the bias
    asam_norm = torch.sqrt(((t_w * g_w) ** 2).sum() + (g_b ** 2).sum())
    sam, asam = (rho * g_w / sam_norm, rho * g_b / sam_norm), (rho * t_w ** 2 * g_w / asam_norm, rho * g_b / asam_norm)
    assert not torch.allclose(sam[0], asam[0], atol=1e-3)  # the case tells the two rules apart
    e_w, e_b = asam if adaptive else sam
    _, g2_w, g2_b = gradient(data.images, data.targets, w + e_w, b + e_b)  # the gradient at w + e
    sgd = {"client_optimizer": "sgd", "client_lr": lr, "client_weight_decay": 0.0, "client_momentum": 0.0}
    if adaptive:
        reply = one_step(FedASAMTrainer, FedASAMHyperparameters(neighborhood_radius=rho, adaptive_offset=eta, **sgd), data, w, b)
    else:
        reply = one_step(FedSAMTrainer, FedSAMHyperparameters(neighborhood_radius=rho, **sgd), data, w, b)
    assert torch.allclose(reply.arrays["weight"], w - lr * g2_w, atol=1e-6)
    assert torch.allclose(reply.arrays["bias"], b - lr * g2_b, atol=1e-6)
    assert reply.metrics["loss"] == pytest.approx(loss, rel=1e-6)  # the first pass's loss
    assert not torch.allclose(reply.arrays["weight"], w - lr * g_w, atol=1e-3)  # not a plain SGD step


def batchnorm_model() -> DomainClassifier:
    featurizer = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return DomainClassifier(featurizer, nn.Linear(4, 2), 4)


@pytest.mark.parametrize("name", ["fedsam", "fedasam"])
def test_a_zero_radius_is_fedavgs_client_bit_for_bit(name):
    """ρ = 0 puts the second pass at w itself: the same gradient, and the second forward's
    BatchNorm statistics are undone, so the step, the buffers and the loss are FedAvg's."""
    dataset = make_dataset(per_domain=24, domains=1)
    data = ClientData.from_dataset(dataset, torch.arange(len(dataset)))
    context = AlgorithmContext(batchnorm_model, TrainingBudget(batch_size=8, local_steps=3), seed=0)
    torch.manual_seed(0)
    sent = {k: v.clone() for k, v in batchnorm_model().state_dict().items()}
    algorithm = get_algorithm(name)

    def fit(trainer):
        return trainer.fit(Payload(dict(sent), {"batch_seed": 5}), data, {})

    fedavg = fit(SupervisedTrainer(get_algorithm("fedavg").hyperparameters(), context))
    flat = fit(algorithm.create_trainer(algorithm.hyperparameters(neighborhood_radius=0.0), context))
    assert all(torch.equal(flat.arrays[k], fedavg.arrays[k]) for k in sent) and flat.metrics == fedavg.metrics
    sharp = fit(algorithm.create_trainer(algorithm.hyperparameters(neighborhood_radius=0.05), context))
    assert not torch.equal(sharp.arrays["classifier.weight"], fedavg.arrays["classifier.weight"])
    assert torch.equal(sharp.arrays["featurizer.1.num_batches_tracked"], fedavg.arrays["featurizer.1.num_batches_tracked"])


def play(strategy, first, last, total, values):
    """Rounds ``first``..``last`` of ``total`` as the engine plays them, two clients replying the
    BatchNorm1d arrays ``values(r) ± 1``; the telemetry of each round."""
    telemetry = []
    for r in range(first, last + 1):
        payloads = strategy.configure_round(r, [0, 1])
        for client, payload in payloads.items():
            payload.config.update({"round": r, "rounds": total, "client": client})
        replies = {c: Reply({**values(r, 2 * c - 1)}, 1, {"loss": 0.0}) for c in (0, 1)}
        telemetry.append(strategy.aggregate(r, replies).telemetry)
    return telemetry


def arrays_of(r, offset=0):
    """The mean model of round r: weight r, bias −r, running mean 100 r (a buffer)."""
    return {"weight": torch.full((2,), r + offset, dtype=torch.float32), "bias": torch.full((2,), -r - offset, dtype=torch.float32),
            "running_mean": torch.full((2,), 100.0 * r + offset), "running_var": torch.ones(2),
            "num_batches_tracked": torch.tensor(r)}


def swa_strategy(hparams, rounds=20):
    strategy = SWAStrategy(0, hparams, rounds)
    torch.manual_seed(0)
    strategy.initialize(nn.BatchNorm1d(2), [ClientInfo(0, 1, (0,)), ClientInfo(1, 1, (1,))])
    return strategy


def test_swa_averages_every_cycles_global_model_from_three_quarters_of_the_run():
    hparams = FedSAMHyperparameters(swa=True, swa_cycle_rounds=2)
    assert (swa_start_round(hparams, 20), swa_start_round(hparams, 2)) == (16, 2)
    with pytest.raises(ValueError, match="rounds"):
        swa_start_round(hparams, None)
    strategy = swa_strategy(hparams)
    play(strategy, 1, 15, 20, arrays_of)
    assert strategy.global_model() is strategy.model and torch.equal(strategy.model.weight.detach(), torch.full((2,), 15.0))
    telemetry = play(strategy, 16, 20, 20, arrays_of)
    assert [t["swa_models_averaged"] for t in telemetry] == [0, 0, 1, 1, 2]  # averaged after rounds 18 and 20
    evaluated = strategy.global_model().state_dict()
    assert torch.equal(evaluated["weight"], torch.full((2,), (18.0 + 20.0) / 2))
    assert torch.equal(evaluated["bias"], torch.full((2,), -(18.0 + 20.0) / 2))
    assert torch.equal(evaluated["running_mean"], torch.full((2,), 2000.0))  # the buffers: the global model's
    assert torch.equal(strategy.configure_round(21, [0])[0].arrays["weight"], torch.full((2,), 20.0))  # clients: the global
    # Before its first average the SWA model is the global model at the start of round 16 (after 15).
    early = swa_strategy(hparams)
    play(early, 1, 17, 20, arrays_of)
    assert torch.equal(early.global_model().weight.detach(), torch.full((2,), 15.0))
    assert torch.equal(early.model.weight.detach(), torch.full((2,), 17.0))


def test_swa_resumes_from_its_state_exactly_and_rolls_back_to_before_it_started():
    hparams = FedSAMHyperparameters(swa=True, swa_cycle_rounds=3, swa_start_round=4)
    straight = swa_strategy(hparams, 12)
    play(straight, 1, 2, 12, arrays_of)
    before_swa = copy.deepcopy(straight.state_dict())
    play(straight, 3, 8, 12, arrays_of)
    saved = copy.deepcopy(straight.state_dict())
    rest = play(straight, 9, 12, 12, arrays_of)
    resumed = swa_strategy(hparams, 12)
    resumed.load_state_dict(saved)
    assert play(resumed, 9, 12, 12, arrays_of) == rest
    assert resumed.averaged == straight.averaged == 2  # after rounds 7 and 10 (r > 4, (r − 4) mod 3 = 0)
    assert all(torch.equal(a, b) for a, b in zip(resumed.global_model().state_dict().values(),
                                                 straight.global_model().state_dict().values()))
    assert torch.equal(straight.global_model().weight.detach(), torch.full((2,), (7.0 + 10.0) / 2))
    straight.load_state_dict(before_swa)  # the engine's rollback of a round to before SWA started
    assert straight.global_model() is straight.model and straight.averaged == 0


def cyclical_trainer(**hp):
    context = AlgorithmContext(lambda: nn.Linear(4, 3), TrainingBudget(batch_size=6, local_steps=1), seed=0)
    return FedSAMTrainer(FedSAMHyperparameters(**hp), context)


def test_the_cyclical_learning_rate_from_swas_start():
    trainer = cyclical_trainer(swa=True, swa_cycle_rounds=4, client_lr=0.1, swa_lr=0.02)  # 12 rounds: S = 10
    rates = [trainer.round_hyperparameters(Payload({}, {"round": r, "rounds": 12})) for r in range(1, 13)]
    assert all(hparams is trainer.hparams for hparams in rates[:9])  # before S: client_lr, no lr reported
    # rounds 10, 11, 12 are 9, 10, 11 from 0: t = 2/4, 3/4, 4/4
    assert [h.client_lr for h in rates[9:]] == pytest.approx([0.06, 0.04, 0.02])
    constant = cyclical_trainer(swa=True, swa_cycle_rounds=1, client_lr=0.1)
    assert constant.round_hyperparameters(Payload({}, {"round": 12, "rounds": 12})) is constant.hparams
    data, w, b = linear_case()
    reply = trainer.fit(Payload({"weight": w, "bias": b}, {"batch_seed": 0, "round": 11, "rounds": 12}), data, {})
    assert reply.metrics["lr"] == pytest.approx(0.04)
    with pytest.raises(ValueError, match="client_lr_schedule"):
        FedSAMHyperparameters(swa=True, client_lr_schedule="cosine")


def test_fedsam_and_fedasam_run_on_the_sample_data(tmp_path):
    for name, hp in (("fedsam", {}), ("fedasam", {"swa": True, "swa_start_round": 1})):
        config = ExperimentConfig(algorithm=name, model="lenet", rounds=2, local_steps=2, batch_size=16, hp=hp,
                                  run_dir=tmp_path / name)
        summary = run_experiment(config, **QUIET)
        records = [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
        assert all(math.isfinite(r["metrics"]["train_loss"]) and r["dropped"] == {} for r in records)
        assert 0.0 <= summary["selection"]["last"]["ood_mean"] <= 100.0
    assert [r["telemetry"]["swa_models_averaged"] for r in records] == [0, 1]
    with pytest.raises(ConfigError, match="fedsam trains in fp32 or bf16 only, not fp16"):
        run_experiment(ExperimentConfig(algorithm="fedsam", precision="fp16", run_dir=tmp_path / "fp16"), **QUIET)


def test_a_resumed_swa_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    straight, resumed, logs = run_straight_and_resumed(
        tmp_path, monkeypatch, FedSAMTrainer, algorithm="fedsam", model="lenet", rounds=4, local_steps=1, batch_size=16,
        hp={"swa": True, "swa_start_round": 2, "swa_cycle_rounds": 2})
    assert logs["straight"] == logs["resumed"] and straight["selection"] == resumed["selection"]
    # rounds 2, 3, 4 are 1, 2, 3 from 0: t = 1, 1/2, 1 between client_lr 1e-3 and swa_lr 1e-4
    assert [round_metrics.get("mean_lr") for round_metrics in logs["straight"]] == pytest.approx([None, 1e-4, 5.5e-4, 1e-4])
    evaluations = {name: [(json.loads(line)["evaluation"], json.loads(line)["telemetry"]["swa_models_averaged"]
                           if r > 1 else None) for r, line in enumerate((tmp_path / name / "rounds.jsonl").read_text().splitlines(), 1)]
                   for name in ("straight", "resumed")}
    assert evaluations["straight"] == evaluations["resumed"]
    assert [averaged for _, averaged in evaluations["straight"]] == [None, 0, 0, 1]
    swa = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["strategy"]["swa"] for name in evaluations}
    assert swa["straight"]["averaged"] == swa["resumed"]["averaged"] == 1
    assert all(torch.equal(tensor, swa["resumed"]["model"][key]) for key, tensor in swa["straight"]["model"].items())
