"""The client training seams: the batch loss sees payload, batch and state; the before-step hook
may drop a parameter group's gradients; a trainer may run several phases with several optimisers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.local_training import (
    OPTIMIZER_STATE_KEY,
    SupervisedTrainer,
    load_kept_optimizer_state,
    run_batches,
    step_learning_rate,
    train_locally,
)
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.data.augmentation import Augmentation
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from tests.helpers import make_dataset, small_model


def client_data() -> ClientData:
    dataset = make_dataset(per_domain=24, domains=1)
    return ClientData.from_dataset(dataset, torch.arange(len(dataset)))


def test_before_step_may_drop_a_parameter_groups_gradients():
    torch.manual_seed(0)
    model = small_model((1, 8, 8), 2)
    head_before = {n: p.detach().clone() for n, p in model.classifier.named_parameters()}
    body_before = {n: p.detach().clone() for n, p in model.featurizer.named_parameters()}
    head = {id(p) for p in model.classifier.parameters()}
    seen = []

    def freeze_head(optimizer):
        seen.append(len(optimizer.param_groups))
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) in head:
                    parameter.grad = None  # the optimiser skips a parameter without a gradient

    hparams = get_algorithm("fedavg").hyperparameters(client_weight_decay=0.0)
    train_locally(model, client_data(), hparams, TrainingBudget(batch_size=8, local_steps=3), torch.Generator().manual_seed(0),
                  lambda batch: nn.functional.cross_entropy(model(batch.inputs), batch.targets), before_step=freeze_head)
    assert seen == [1, 1, 1]
    assert all(torch.equal(p, head_before[n]) for n, p in model.classifier.named_parameters())
    assert any(not torch.equal(p, body_before[n]) for n, p in model.featurizer.named_parameters())


def test_phases_with_their_own_optimisers_continue_the_batch_numbering():
    torch.manual_seed(0)
    model = small_model((1, 8, 8), 2)
    data = client_data()
    generator = torch.Generator().manual_seed(0)
    optimisers = [torch.optim.SGD(model.featurizer.parameters(), lr=0.1), torch.optim.SGD(model.classifier.parameters(), lr=0.1)]
    numbers: list[tuple[int, int]] = []

    def step_of(phase):
        def step(batch):
            numbers.append((phase, batch.number))
            loss = nn.functional.cross_entropy(model(batch.views[0]), batch.targets)
            optimisers[phase].zero_grad()
            loss.backward()
            optimisers[phase].step()
            return float(loss.detach())
        return step

    augmentation = Augmentation("flip_crop")
    first_loss, first_steps = run_batches(data, TrainingBudget(batch_size=8, local_epochs=1), generator, step_of(0),
                                          augmentation=augmentation, augmentation_seed=4)
    _, second_steps = run_batches(data, TrainingBudget(batch_size=8, local_steps=2), generator, step_of(1),
                                  augmentation=augmentation, augmentation_seed=4, first_number=first_steps)
    assert (first_steps, second_steps) == (3, 2) and first_loss > 0
    assert numbers == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]


class CountsBatchesInItsState(SupervisedTrainer):
    def batch_loss(self, model, batch, payload, state):
        state["batches"] = state.get("batches", 0) + 1
        state["scale_seen"] = float(payload.read_only_arrays["scale"])
        return float(payload.config["weight"]) * super().batch_loss(model, batch, payload, state)


def test_the_batch_loss_sees_payload_batch_and_client_state():
    hparams = get_algorithm("fedavg").hyperparameters()
    context = AlgorithmContext(lambda: small_model((1, 8, 8), 2), TrainingBudget(batch_size=8, local_steps=3), seed=0)
    trainer = CountsBatchesInItsState(hparams, context)
    state: dict = {}
    sent = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    payload = Payload(sent, {"batch_seed": 1, "weight": 0.0}, read_only_arrays={"scale": torch.tensor(2.5)})
    reply = trainer.fit(payload, client_data(), state)
    assert state == {"batches": 3, "scale_seen": 2.5}
    assert not hasattr(trainer, "_prior") and set(vars(trainer)) == {"hparams", "budget", "task", "augmentation", "augment_inputs", "device", "precision", "model", "_logged"}
    # A zero-weighted loss leaves the model where it was (Adam with weight decay still decays it, so compare the loss).
    assert reply.metrics["loss"] == 0.0


def one_round_trainer(rounds: int):
    """``(trained, sent)``: ``trained(round_number, **hparams)`` is the reply of one round of
    FedAvg's SGD client of a ``rounds``-round run, from the same model ``sent``, data and batch
    order whatever the round."""
    fedavg = get_algorithm("fedavg")
    context = AlgorithmContext(lambda: small_model((1, 8, 8), 2), TrainingBudget(batch_size=8, local_steps=3), seed=0)
    torch.manual_seed(0)
    sent = {name: tensor.clone() for name, tensor in small_model((1, 8, 8), 2).state_dict().items()}
    data = client_data()

    def trained(round_number: int, **hparams):
        trainer = SupervisedTrainer(fedavg.hyperparameters(client_optimizer="sgd", **hparams), context)
        return trainer.fit(Payload(dict(sent), {"batch_seed": 7, "round": round_number, "rounds": rounds}), data, {})

    return trained, sent


def test_the_cosine_schedule_sets_each_rounds_learning_rate():
    """Round 1 of a cosine schedule trains exactly as the constant rate ``client_lr`` and the
    last round exactly as the constant rate ``client_final_lr``; a middle round logs its rate."""
    trained, sent = one_round_trainer(rounds=5)

    cosine = dict(client_lr_schedule="cosine", client_lr=0.1, client_final_lr=0.01)
    first, last, middle = trained(1, **cosine), trained(5, **cosine), trained(3, **cosine)
    assert (first.metrics["lr"], last.metrics["lr"]) == (0.1, 0.01)
    assert middle.metrics["lr"] == 0.01 + (0.1 - 0.01) / 2
    for scheduled, constant_lr in ((first, 0.1), (last, 0.01)):
        constant = trained(3, client_lr=constant_lr)
        assert "lr" not in constant.metrics
        assert all(torch.equal(scheduled.arrays[name], constant.arrays[name]) for name in sent)
    assert not torch.equal(first.arrays["classifier.weight"], last.arrays["classifier.weight"])


def test_the_step_schedule_divides_the_rate_after_each_period():
    """Hand-computed: 40 rounds at 0.8 (FedDG-GA's and FedOMG's ``StepLR``, 5 local epochs: epoch
    160 of 0..199 is round 33's first) keep 0.01 for rounds 1-32 and 0.001 from round 33; a period
    of 0.3 of 10 rounds (3 rounds) divides again every 3 rounds; 0.29 of 100 rounds is 29 rounds."""
    assert [step_learning_rate(t, 40, 0.01, 0.8, 0.1) for t in (1, 32)] == [0.01, 0.01]
    assert [step_learning_rate(t, 40, 0.01, 0.8, 0.1) for t in (33, 40)] == pytest.approx([0.001, 0.001])
    assert [step_learning_rate(t, 10, 1.0, 0.3, 0.5) for t in range(1, 11)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]
    assert step_learning_rate(29, 100, 1.0, 0.29, 0.1) == 1.0  # int(0.29 * 100) would be 28: round 29 decayed
    assert step_learning_rate(30, 100, 1.0, 0.29, 0.1) == pytest.approx(0.1)
    # a period of 0.2 rounds (one epoch of five): five decays by round 2's start, as the code's StepLR
    assert step_learning_rate(2, 2, 1.0, 0.1, 0.1) == pytest.approx(1e-5)
    # 0.8 of 41 rounds = 32.8: the code (5 epochs) decays at epoch 164, inside round 33, so here from round 34
    assert [step_learning_rate(t, 41, 1.0, 0.8, 0.1) for t in (33, 34)] == pytest.approx([1.0, 0.1])
    assert [step_learning_rate(t, 7, 1.0, 0.3, 0.1) for t in (3, 4, 5, 7)] == pytest.approx([1.0, 0.1, 0.1, 0.01])  # 2.1 rounds


def test_a_step_decayed_round_trains_as_the_constant_decayed_rate():
    """A round of the ``step`` schedule trains exactly as the constant rate it names and logs it."""
    trained, sent = one_round_trainer(rounds=10)

    step = dict(client_lr_schedule="step", client_lr=0.1, client_lr_step_fraction=0.8, client_lr_step_factor=0.5)
    before, after = trained(8, **step), trained(9, **step)
    assert (before.metrics["lr"], after.metrics["lr"]) == (0.1, 0.05)
    for scheduled, constant_lr in ((before, 0.1), (after, 0.05)):
        constant = trained(9, client_lr=constant_lr)
        assert all(torch.equal(scheduled.arrays[name], constant.arrays[name]) for name in sent)
    assert not torch.equal(before.arrays["classifier.weight"], after.arrays["classifier.weight"])


def test_a_kept_optimiser_state_continues_the_momentum_of_the_previous_round():
    """Two rounds of ``train_locally`` with ``kept_state`` equal one SGD optimiser (momentum 0.9)
    stepped over both rounds' batches by hand, the second round at its own learning rate; with a
    fresh optimiser the second round differs."""
    data = client_data()
    budget = TrainingBudget(batch_size=8, local_steps=3)
    rounds = [(get_algorithm("fedavg").hyperparameters(client_optimizer="sgd", client_momentum=0.9, client_lr=lr,
                                                      client_optimizer_state="kept"), seed)
              for lr, seed in ((0.1, 7), (0.05, 8))]

    def loss_of(model):
        return lambda batch: nn.functional.cross_entropy(model(batch.inputs), batch.targets)

    torch.manual_seed(0)
    start = small_model((1, 8, 8), 2).state_dict()
    model, kept = small_model((1, 8, 8), 2), {}
    model.load_state_dict(start)
    for hparams, seed in rounds:
        train_locally(model, data, hparams, budget, torch.Generator().manual_seed(seed), loss_of(model), kept_state=kept)
    assert set(kept) == {OPTIMIZER_STATE_KEY}

    by_hand = small_model((1, 8, 8), 2)
    by_hand.load_state_dict(start)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9, weight_decay=rounds[0][0].client_weight_decay)
    for hparams, seed in rounds:
        optimizer.param_groups[0]["lr"] = hparams.client_lr
        for batch in list(data.batches(8, torch.Generator().manual_seed(seed)))[:3]:
            optimizer.zero_grad()
            loss_of(by_hand)(batch).backward()
            optimizer.step()
    assert all(torch.equal(value, by_hand.state_dict()[name]) for name, value in model.state_dict().items())

    fresh = small_model((1, 8, 8), 2)
    fresh.load_state_dict(start)
    for hparams, seed in rounds:
        train_locally(fresh, data, hparams, budget, torch.Generator().manual_seed(seed), loss_of(fresh))
    assert not torch.equal(fresh.classifier.weight, model.classifier.weight)


def test_the_trainer_keeps_the_optimiser_state_in_the_client_state_only_when_asked():
    """``client_optimizer_state: kept`` stores the momentum buffers in the client's state, one per
    parameter; ``fresh`` stores nothing; FedADG, with three optimisers of its own, refuses ``kept``."""
    context = AlgorithmContext(lambda: small_model((1, 8, 8), 2), TrainingBudget(batch_size=8, local_steps=2), seed=0)
    sent = dict(small_model((1, 8, 8), 2).state_dict())
    for mode in ("kept", "fresh"):
        hparams = get_algorithm("fedavg").hyperparameters(client_optimizer="sgd", client_momentum=0.9,
                                                          client_optimizer_state=mode)
        state: dict = {}
        SupervisedTrainer(hparams, context).fit(Payload(dict(sent), {"batch_seed": 1, "round": 1, "rounds": 2}),
                                                client_data(), state)
        kept = state.get(OPTIMIZER_STATE_KEY, {})
        assert len(kept) == (len(list(context.model_factory().parameters())) if mode == "kept" else 0)
        assert all(entry["momentum_buffer"].abs().sum() > 0 for entry in kept.values())
    with pytest.raises(ValueError, match="client_optimizer_state"):
        get_algorithm("fedadg").hyperparameters(client_optimizer_state="kept")
    optimizer = torch.optim.SGD(context.model_factory().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="does not fit"):  # the buffers of another model's tensors
        load_kept_optimizer_state(optimizer, {0: {"momentum_buffer": torch.zeros(3)}})


def test_after_step_runs_after_every_optimiser_step():
    """The after-step hook (a momentum encoder's moving average) sees the parameters the step just set."""
    torch.manual_seed(0)
    model = small_model((1, 8, 8), 2)
    seen: list[torch.Tensor] = []
    hparams = get_algorithm("fedavg").hyperparameters()
    train_locally(model, client_data(), hparams, TrainingBudget(batch_size=8, local_steps=3), torch.Generator().manual_seed(0),
                  lambda batch: nn.functional.cross_entropy(model(batch.inputs), batch.targets),
                  after_step=lambda: seen.append(model.classifier.bias.detach().clone()))
    assert len(seen) == 3 and torch.equal(seen[-1], model.classifier.bias)
    assert not torch.equal(seen[0], seen[1])


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA device (none on this machine)"))])
def test_kept_adam_state_loads_without_copying_its_buffers_and_keeps_step_counts_on_the_host(device):
    model = nn.Linear(3, 2).to(device)
    first = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3, device=device)).sum().backward()
    first.step()
    kept = first.state_dict()["state"]
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    load_kept_optimizer_state(fresh, kept)
    for index, parameter in enumerate(model.parameters()):
        loaded = fresh.state[parameter]
        assert loaded["step"].device.type == "cpu" and float(loaded["step"]) == 1.0
        for buffer in ("exp_avg", "exp_avg_sq"):  # already on the parameter's device: the same tensor, not a copy
            assert loaded[buffer].device == parameter.device and loaded[buffer].data_ptr() == kept[index][buffer].data_ptr()
    assert fresh.param_groups[0]["lr"] == 0.01  # this round's settings, not the kept ones
