"""MCGDM (mcgdm.md): the gradient-matching terms by hand and by finite differences, the heads in
the payload, the cosine schedule, and a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fedbed.algorithms import get_algorithm, resolve_hyperparameters
from fedbed.algorithms.base.local_training import cosine_learning_rate
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.algorithms.mcgdm import MCGDMStrategy, matching_losses, previous_heads_of
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.messages import ClientInfo, Reply
from fedbed.models import DomainClassifier
from tests.helpers import run_straight_and_resumed


def zero_head_model() -> DomainClassifier:
    model = DomainClassifier(nn.Flatten(), nn.Linear(2, 2), 2)
    nn.init.zeros_(model.classifier.weight)
    nn.init.zeros_(model.classifier.bias)
    return model


def test_intra_and_inter_on_a_hand_computed_case():
    # Zero head: p = (1/2, 1/2), dCE/dlogits = p - onehot(0) = (-1/2, 1/2).
    # Feature a = (1, 0): g = vec(W grad, b grad) = (-1/2, 0, 1/2, 0, -1/2, 1/2), |g| = 1.
    # Feature a' = (0, 1): g' = (0, -1/2, 0, 1/2, -1/2, 1/2), |g'| = 1; cos(g, g') = 1/2, L_intra = 1/2.
    # Previous head W_j = [[1, 0], [0, 0]] on a: p - onehot = (-q, q), q = 1 - sigmoid(1);
    # g_j = q (-1, 0, 1, 0, -1, 1), cos(g', g_j) = (1/2 + 1/2) q / (1 * 2q) = 1/2 -> 1 - 1/2 = 1/2.
    # A second previous head equal to the zero head gives g_j = g: 1 - cos(g', g) = 1/2 more.
    model = zero_head_model()
    x, augmented, y = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    one_hot_head = {"weight": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "bias": torch.zeros(2)}
    zero_head = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    terms = matching_losses(model, x, augmented, y, [one_hot_head])
    assert terms["intra"].item() == pytest.approx(0.5)
    assert terms["inter"].item() == pytest.approx(0.5)
    assert terms["ce"].item() == pytest.approx(math.log(2)) and terms["ce_augmented"].item() == pytest.approx(math.log(2))
    assert matching_losses(model, x, augmented, y, [one_hot_head, zero_head])["inter"].item() == pytest.approx(1.0)
    assert matching_losses(model, x, augmented, y, [])["inter"].item() == 0.0  # round 1: no previous heads


def test_the_authors_per_parameter_cosine_and_mean_over_heads_by_hand():
    # Zero head, x = (2, 0), A(x) = (2, 2), label 0: dCE/dlogits = (-1/2, 1/2).
    # g: W rows (-1, 0), (1, 0), bias (-1/2, 1/2); g': W rows (-1, -1), (1, 1), the same bias.
    # Flattened: g.g' = 1 + 1 + 1/4 + 1/4 = 5/2, |g|^2 = 5/2, |g'|^2 = 9/2: 1 - (5/2)/sqrt(45/4).
    # Per parameter: each weight row's cosine is 1/sqrt(2), the bias's 1: ((1 - 1/sqrt 2) + 0) / 2.
    model = zero_head_model()
    x, augmented, y = torch.tensor([[2.0, 0.0]]), torch.tensor([[2.0, 2.0]]), torch.tensor([0])
    flattened = matching_losses(model, x, augmented, y, [])
    assert flattened["intra"].item() == pytest.approx(1 - 2.5 / math.sqrt(45 / 4))
    per_parameter = matching_losses(model, x, augmented, y, [], gradient_cosine="per_parameter")
    assert per_parameter["intra"].item() == pytest.approx((1 - 1 / math.sqrt(2)) / 2)
    # The mean over heads is the sum (the hand-computed case above: 1/2 + 1/2) over their number.
    x, augmented = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    heads = [{"weight": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "bias": torch.zeros(2)},
             {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}]
    assert matching_losses(model, x, augmented, y, heads, inter_reduction="mean")["inter"].item() == pytest.approx(0.5)
    assert matching_losses(model, x, augmented, y, [], inter_reduction="mean")["inter"].item() == 0.0
    with pytest.raises(ValueError, match="unknown inter_reduction 'max'"):
        matching_losses(model, x, augmented, y, heads, inter_reduction="max")
    with pytest.raises(ValueError, match="unknown gradient_cosine 'rows'"):
        matching_losses(model, x, augmented, y, heads, gradient_cosine="rows")


@pytest.mark.parametrize("inter_reduction, gradient_cosine", [("sum", "flattened"), ("mean", "per_parameter")])
def test_the_matching_losses_train_the_featurizer_exactly(inter_reduction, gradient_cosine):
    """The autograd gradient of Eq. 8 with respect to the featurizer, through the head gradients
    (create_graph), equals central finite differences (float64)."""
    torch.manual_seed(0)
    model = DomainClassifier(nn.Linear(3, 4), nn.Linear(4, 3), 4).double()
    x, augmented = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 0])
    heads = [{"weight": torch.randn(3, 4, dtype=torch.float64), "bias": torch.randn(3, dtype=torch.float64)} for _ in range(2)]
    matching_lambda = 0.3

    def loss_of(weight: torch.Tensor) -> torch.Tensor:
        featurizer = lambda inputs: functional_call(model.featurizer, {"weight": weight, "bias": model.featurizer.bias}, (inputs,))  # noqa: E731
        wrapped = DomainClassifier(nn.Identity(), model.classifier, 4)
        terms = matching_losses(wrapped, featurizer(x), featurizer(augmented), y, heads, inter_reduction, gradient_cosine)
        return 0.5 * (terms["ce"] + terms["ce_augmented"]) + matching_lambda * terms["intra"] + (1 - matching_lambda) * terms["inter"]

    weight = model.featurizer.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(loss_of, (weight,), eps=1e-6, atol=1e-6)
    # The matching terms alone move the featurizer too (they are not constants of it).
    def matching_only(w):
        f = lambda inputs: functional_call(model.featurizer, {"weight": w, "bias": model.featurizer.bias}, (inputs,))  # noqa: E731
        terms = matching_losses(DomainClassifier(nn.Identity(), model.classifier, 4), f(x), f(augmented), y, heads)
        return terms["intra"] + terms["inter"]
    (gradient,) = torch.autograd.grad(matching_only(weight), weight)
    assert gradient.abs().sum() > 0


def head_gradient_by_hand(weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """∇ of the batch-mean cross-entropy of the linear head (W, b) at ``features``, flattened as
    (W row by row, b): with δ = (softmax(F Wᵀ + b) − one-hot(y)) / B, ∇W = δᵀ F and ∇b = Σ_rows δ."""
    probabilities = torch.softmax(features @ weight.T + bias, dim=1)
    delta = (probabilities - nn.functional.one_hot(targets, weight.shape[0]).to(features.dtype)) / len(targets)
    return torch.cat([(delta.T @ features).reshape(-1), delta.sum(dim=0)])


def cross_entropy_by_hand(weight: torch.Tensor, bias: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """−log softmax(F Wᵀ + b)[y], the batch mean."""
    logits = features @ weight.T + bias
    return (torch.logsumexp(logits, dim=1) - logits[torch.arange(len(targets)), targets]).mean()


def one_minus_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return 1.0 - float(a @ b) / float(a.norm() * b.norm())


HAND_WEIGHT, HAND_BIAS = torch.tensor([[0.5, -1.0], [0.25, 0.5]]), torch.tensor([0.1, -0.2])
HAND_HEADS = [(torch.tensor([[1.0, 0.0], [0.0, -1.0]]), torch.tensor([0.0, 0.3])),
              (torch.tensor([[-0.5, 0.5], [2.0, 0.0]]), torch.tensor([0.2, 0.0]))]
HAND_X, HAND_AUGMENTED, HAND_Y = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([[2.0, 0.0], [1.0, 1.0]]), torch.tensor([0, 1])


def client_batch_loss(hp: dict) -> float:
    """The MCGDM client's loss on one batch of the hand-computed case (features = inputs, a 2x2
    linear head, the two previous heads of ``HAND_HEADS`` in the payload), under ``hp``."""
    from fedbed.federation.local_data import Batch
    from fedbed.federation.messages import Payload

    algorithm = get_algorithm("mcgdm")
    hparams = resolve_hyperparameters(algorithm, hp)
    factory = lambda: DomainClassifier(nn.Flatten(), nn.Linear(2, 2), 2)  # noqa: E731  features = inputs
    trainer = algorithm.create_trainer(hparams, AlgorithmContext(factory, TrainingBudget(batch_size=2, local_steps=1), seed=0))
    read_only = {f"head{j}/{name}": tensor for j, (w, b) in enumerate(HAND_HEADS) for name, tensor in (("weight", w), ("bias", b))}
    payload = Payload(arrays={"classifier.weight": HAND_WEIGHT, "classifier.bias": HAND_BIAS}, read_only_arrays=read_only,
                      config={"round": 2, "rounds": 3, "batch_seed": 7})
    trainer.model.load_state_dict(payload.arrays)
    return trainer.batch_loss(trainer.model, Batch(inputs=HAND_X, targets=HAND_Y, views=(HAND_AUGMENTED,)), payload, {}).item()


def hand_terms() -> tuple[float, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """½(CE(x) + CE(A(x))), g, g' and the previous heads' g_j of the hand-computed case, by hand."""
    ce = cross_entropy_by_hand(HAND_WEIGHT, HAND_BIAS, HAND_X, HAND_Y) + cross_entropy_by_hand(HAND_WEIGHT, HAND_BIAS, HAND_AUGMENTED, HAND_Y)
    g, g_augmented = head_gradient_by_hand(HAND_WEIGHT, HAND_BIAS, HAND_X, HAND_Y), head_gradient_by_hand(HAND_WEIGHT, HAND_BIAS, HAND_AUGMENTED, HAND_Y)
    return 0.5 * float(ce), g, g_augmented, [head_gradient_by_hand(w, b, HAND_X, HAND_Y) for w, b in HAND_HEADS]


def test_one_mcgdm_batch_loss_is_eq_8_by_hand():
    """The loss the MCGDM client minimises on one batch, with its default hyperparameters (λ = 0.3,
    ``inter_reduction: sum``), equals ½(CE(x) + CE(A(x))) + λ L_intra + (1 − λ) L_inter computed by
    hand from the same tensors: the head's gradients from their closed form, L_intra = 1 − cos(g, g'),
    L_inter = Σ_j (1 − cos(g', g_j)) over the two previous heads the server sent."""
    hparams = get_algorithm("mcgdm").hyperparameters()
    assert hparams.matching_lambda == 0.3 and hparams.inter_reduction == "sum"
    loss = client_batch_loss({})
    classification, g, g_augmented, g_heads = hand_terms()
    intra = one_minus_cosine(g, g_augmented)
    inter = sum(one_minus_cosine(g_augmented, g_j) for g_j in g_heads)
    assert abs(intra - inter) > 0.1  # so a swapped λ, or a mean over the heads, changes the loss
    assert loss == pytest.approx(classification + 0.3 * intra + 0.7 * inter, abs=1e-6)
    assert loss != pytest.approx(classification + 0.7 * intra + 0.3 * inter, abs=1e-3)  # λ swapped
    assert loss != pytest.approx(classification + 0.3 * intra + 0.7 * inter / 2, abs=1e-3)  # mean


def test_the_authors_independent_intra_and_inter_weights_by_hand():
    """``intra_weight``/``inter_weight`` (the authors' ``args.intra``, ``args.inter``) replace λ and
    1 − λ, each independently; unset, the loss is λ's."""
    classification, g, g_augmented, g_heads = hand_terms()
    intra = one_minus_cosine(g, g_augmented)
    inter = sum(one_minus_cosine(g_augmented, g_j) for g_j in g_heads)
    assert client_batch_loss({"intra_weight": 0.7, "inter_weight": 0.0}) == pytest.approx(classification + 0.7 * intra, abs=1e-6)
    assert client_batch_loss({"intra_weight": 1.0, "inter_weight": 2.0}) == pytest.approx(classification + intra + 2 * inter, abs=1e-6)
    assert client_batch_loss({"inter_weight": 0.5}) == pytest.approx(classification + 0.3 * intra + 0.5 * inter, abs=1e-6)
    assert client_batch_loss({"intra_weight": 0.3, "inter_weight": 0.7}) == client_batch_loss({})
    assert get_algorithm("mcgdm").hyperparameters(matching_lambda=0.8).matching_weights == (0.8, pytest.approx(0.2))


def per_parameter_discrepancy_by_hand(a: torch.Tensor, b: torch.Tensor) -> float:
    """The authors' 1 − sim of two flattened gradients of a 2x2 linear head (W row by row, then b):
    the mean over W's two rows of their cosines, the cosine of the biases, 1 − each, averaged."""
    rows = sum(1 - one_minus_cosine(a[2 * r:2 * r + 2], b[2 * r:2 * r + 2]) for r in range(2)) / 2
    return ((1 - rows) + one_minus_cosine(a[4:], b[4:])) / 2


def test_reading_authors_code_sets_the_four_readings_and_its_loss_by_hand():
    """``reading: authors_code`` sets inter_reduction mean, per-parameter cosines, features
    recomputed per head and uniform server weights where a run leaves them unset (a run's own value
    wins; the paper's reading changes nothing), and the client's loss is then, by hand,
    ½(CE + CE') + λ·(per-parameter 1 − sim(g, g')) + (1 − λ)·mean_j(per-parameter 1 − sim(g', g_j))."""
    algorithm = get_algorithm("mcgdm")
    authors = resolve_hyperparameters(algorithm, {"reading": "authors_code"})
    assert (authors.inter_reduction, authors.gradient_cosine, authors.inter_features, authors.aggregation_weighting) == (
        "mean", "per_parameter", "recomputed_per_head", "uniform")
    assert authors.matching_weights == (0.3, 0.7)  # the coefficients stay the paper's λ
    assert resolve_hyperparameters(algorithm, {"reading": "authors_code", "inter_reduction": "sum"}).inter_reduction == "sum"
    paper = resolve_hyperparameters(algorithm, {"reading": "paper"})
    assert paper.model_dump(exclude={"reading"}) == algorithm.hyperparameters().model_dump(exclude={"reading"})
    classification, g, g_augmented, g_heads = hand_terms()
    intra = per_parameter_discrepancy_by_hand(g, g_augmented)
    inter = sum(per_parameter_discrepancy_by_hand(g_augmented, g_j) for g_j in g_heads) / len(g_heads)
    assert client_batch_loss({"reading": "authors_code"}) == pytest.approx(classification + 0.3 * intra + 0.7 * inter, abs=1e-6)
    assert client_batch_loss({"reading": "authors_code"}) != pytest.approx(client_batch_loss({}), abs=1e-3)
    model = DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4)
    strategy = algorithm.create_strategy(authors, AlgorithmContext(lambda: model, TrainingBudget(batch_size=4), seed=0))
    assert strategy.aggregation_weighting == "uniform"


class CountingScale(nn.Module):
    """A featurizer returning its input times the number of times it has been called (1, 2, ...),
    so each pass over the same batch gives different features."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return inputs * self.calls


def test_inter_features_recomputed_per_head_by_hand():
    """``inter_features: recomputed_per_head`` (the authors' code) runs the featurizer on x again for
    each previous head: F(x) = 1·x, F(A(x)) = 2·A(x), then head j sees (3 + j)·x. By hand:
    L_inter = Σ_j (1 − cos(g'(2 A(x)), g_j((3 + j) x))); ``shared`` gives every head 1·x."""
    def terms(inter_features: str) -> tuple[dict, int]:
        model = DomainClassifier(CountingScale(), nn.Linear(2, 2), 2)
        model.classifier.load_state_dict({"weight": HAND_WEIGHT, "bias": HAND_BIAS})
        heads = [{"weight": w, "bias": b} for w, b in HAND_HEADS]
        return matching_losses(model, HAND_X, HAND_AUGMENTED, HAND_Y, heads, inter_features=inter_features), model.featurizer.calls

    g_augmented = head_gradient_by_hand(HAND_WEIGHT, HAND_BIAS, 2 * HAND_AUGMENTED, HAND_Y)
    g = head_gradient_by_hand(HAND_WEIGHT, HAND_BIAS, HAND_X, HAND_Y)
    recomputed = sum(one_minus_cosine(g_augmented, head_gradient_by_hand(w, b, (3 + j) * HAND_X, HAND_Y))
                     for j, (w, b) in enumerate(HAND_HEADS))
    shared = sum(one_minus_cosine(g_augmented, head_gradient_by_hand(w, b, HAND_X, HAND_Y)) for w, b in HAND_HEADS)
    assert abs(recomputed - shared) > 1e-3
    (per_head, per_head_calls), (once, once_calls) = terms("recomputed_per_head"), terms("shared")
    assert (per_head_calls, once_calls) == (4, 2)
    assert per_head["inter"].item() == pytest.approx(recomputed, abs=1e-6)
    assert once["inter"].item() == pytest.approx(shared, abs=1e-6)
    assert per_head["intra"].item() == pytest.approx(one_minus_cosine(g, g_augmented), abs=1e-6) == once["intra"].item()
    with pytest.raises(ValueError, match="unknown inter_features 'twice'"):
        terms("twice")


def test_uniform_aggregation_weighting_by_hand():
    """``aggregation_weighting: uniform`` (the authors' ``domain_weight`` 1/n) averages the clients'
    models with equal weights; the default is Eq. 9's n_k / n. Client c replies the model + c with
    n_c = 10 + c examples: uniform gives + (0 + 1 + 2) / 3 = 1, n_k gives + (0·10 + 1·11 + 2·12) / 33."""
    for weighting, shift in (("uniform", 1.0), ("num_examples", 35 / 33)):
        torch.manual_seed(0)
        model = DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        strategy = MCGDMStrategy(aggregation_weighting=weighting)
        strategy.initialize(model, [ClientInfo(c, 10 + c, (c,)) for c in range(3)])
        assert strategy.client_weights(replies_with_heads(model, [0, 1, 2]), [0, 1, 2]) == (
            [1.0, 1.0, 1.0] if weighting == "uniform" else [10, 11, 12])
        strategy.aggregate(1, replies_with_heads(model, [0, 1, 2]))
        for name, tensor in model.state_dict().items():
            assert torch.allclose(tensor, start[name] + shift, atol=1e-6), (weighting, name)
    assert get_algorithm("mcgdm").hyperparameters().aggregation_weighting == "num_examples"


def replies_with_heads(model, clients):
    state = model.state_dict()
    return {c: Reply({k: v + c for k, v in state.items()}, num_examples=10 + c) for c in clients}


@pytest.mark.parametrize("include_own_head", [True, False])
def test_the_server_sends_the_previous_heads_read_only(include_own_head):
    torch.manual_seed(0)
    model = DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4)
    strategy = MCGDMStrategy(include_own_head=include_own_head)
    strategy.initialize(model, [ClientInfo(c, 10 + c, (c,)) for c in range(3)])
    first = strategy.configure_round(1, [0, 1, 2])
    assert all(p.read_only_arrays == {} for p in first.values())  # round 1: no previous heads
    replies = replies_with_heads(model, [0, 1, 2])
    strategy.aggregate(1, replies)
    second = strategy.configure_round(2, [0, 1, 2])
    expected = [0, 1, 2] if include_own_head else [1, 2]
    assert sorted({name.split("/")[0] for name in second[0].read_only_arrays}) == [f"head{j}" for j in expected]
    assert set(second[0].arrays) == set(model.state_dict())  # the model travels as arrays, the heads do not
    heads = previous_heads_of(second[0])
    assert len(heads) == len(expected) and set(heads[0]) == {"weight", "bias"}
    # Each head sent is the one its own client replied with (the replies' heads differ by client).
    for j, head in zip(expected, heads):
        for name in ("weight", "bias"):
            assert torch.equal(head[name], replies[j].arrays[f"classifier.{name}"])
            assert torch.equal(strategy.heads[j][name], replies[j].arrays[f"classifier.{name}"])
    restored = MCGDMStrategy(include_own_head=include_own_head)
    restored.initialize(DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4), [])
    restored.load_state_dict(strategy.state_dict())
    assert torch.equal(restored.configure_round(2, [0])[0].read_only_arrays[f"head{expected[0]}/weight"],
                       second[0].read_only_arrays[f"head{expected[0]}/weight"])


@pytest.mark.parametrize(("hp", "sends"), [
    ({}, True),                                                  # MCGDM: L_inter reads the heads
    ({"use_inter": False}, False),                               # Table 4 without L_inter
    ({"alignment": "kl"}, False), ({"alignment": "supcon"}, False),  # Table 5: no head read
    ({"alignment": "cofc"}, True),                               # CoFC classifies with the heads
])
def test_the_heads_travel_only_to_a_loss_that_reads_them(hp, sends):
    algorithm = get_algorithm("mcgdm")
    hparams = resolve_hyperparameters(algorithm, hp)
    assert hparams.uses_previous_heads is sends
    model = DomainClassifier(nn.Flatten(), nn.Linear(4, 3), 4)
    strategy = algorithm.create_strategy(hparams, AlgorithmContext(lambda: model, TrainingBudget(batch_size=4), seed=0))
    strategy.initialize(model, [ClientInfo(c, 10, (c,)) for c in range(3)])
    strategy.aggregate(1, replies_with_heads(model, [0, 1, 2]))
    payloads = strategy.configure_round(2, [0, 1, 2])
    assert all(bool(p.read_only_arrays) is sends for p in payloads.values())


def test_cosine_schedule_runs_from_the_first_to_the_last_round():
    assert cosine_learning_rate(1, 40, 1e-3, 1e-4) == pytest.approx(1e-3)
    assert cosine_learning_rate(40, 40, 1e-3, 1e-4) == pytest.approx(1e-4)
    assert cosine_learning_rate(3, 5, 1e-3, 1e-4) == pytest.approx(5.5e-4)
    assert cosine_learning_rate(1, 1, 1e-3, 1e-4) == 1e-3


def test_a_resumed_mcgdm_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    from fedbed.algorithms.mcgdm import MCGDMTrainer

    settings = dict(algorithm="mcgdm", model="lenet", rounds=3, local_steps=2, batch_size=16, hp={"client_lr": 0.01})
    straight, resumed, logs = run_straight_and_resumed(tmp_path, monkeypatch, MCGDMTrainer, **settings)
    assert logs["resumed"] == logs["straight"]
    assert resumed["selection"] == straight["selection"]
    assert logs["straight"][0]["mean_lr"] == 0.01 and logs["straight"][2]["mean_lr"] == pytest.approx(1e-4)
    assert logs["straight"][0]["mean_inter"] == 0 and logs["straight"][1]["mean_inter"] > 0


def test_supervised_contrastive_loss_by_hand():
    # Two unit features of one class at 90 degrees and one of another class opposite the first:
    # z0·z1 = 0, z0·z2 = -1, z1·z2 = 0. With τ = 1, anchor 0's only positive is 1:
    # -log(e^0 / (e^0 + e^-1)) = log(1 + e^-1); anchor 1 likewise: -log(e^0 / (e^0 + e^0)) = log 2;
    # anchor 2 has no positive and is left out.
    from fedbed.algorithms.mcgdm import supervised_contrastive_loss

    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 0, 1])
    expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 2
    assert supervised_contrastive_loss(features, labels, 1.0).item() == pytest.approx(expected)


@pytest.mark.parametrize("alignment", ["kl", "supcon", "cofc"])
def test_table_5_alignments_run_and_align(alignment):
    from fedbed.algorithms.mcgdm import alternative_alignment

    torch.manual_seed(0)
    model = DomainClassifier(nn.Linear(3, 4), nn.Linear(4, 2), 4)
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1])
    heads = [{"weight": torch.randn(2, 4), "bias": torch.zeros(2)}]
    terms = alternative_alignment(alignment, model, x, x + 0.5 * torch.randn(6, 3), y, heads, 0.1)
    assert terms["align"].item() > 0 and terms["align"].requires_grad
    same = alternative_alignment(alignment, model, x, x, y, heads, 0.1)
    if alignment == "kl":
        assert same["align"].item() == pytest.approx(0.0, abs=1e-7)  # identical views agree exactly
    if alignment == "cofc":
        # By hand: a zero head gives uniform probabilities, so its cross-entropy is log 2 whatever
        # the features; the mean over two such heads too.
        zero = {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}
        assert alternative_alignment("cofc", model, x, x, y, [zero, zero], 0.1)["align"].item() == pytest.approx(math.log(2))
        assert alternative_alignment("cofc", model, x, x, y, [], 0.1)["align"].item() == 0.0  # round 1: no heads
    with pytest.raises(ValueError, match="unknown alignment"):
        alternative_alignment("mmd", model, x, x, y, heads, 0.1)


def test_an_alternative_alignment_trains_end_to_end(tmp_path):
    run_experiment(ExperimentConfig(algorithm="mcgdm", model="lenet", rounds=2, local_steps=2, batch_size=16,
                                    hp={"alignment": "cofc", "client_lr": 0.01}, run_dir=tmp_path),
                   progress=False, echo=lambda *_: None)
    first, second = [json.loads(line)["metrics"] for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert first["mean_align"] == 0.0 and second["mean_align"] > 0  # the heads of round 1 reached round 2
    assert "mean_intra" not in second and "mean_inter" not in second


def test_the_runs_augmentation_setting_is_refused_for_mcgdm(tmp_path):
    from fedbed.config import ConfigError

    with pytest.raises(ConfigError, match="mcgdm draws its own augmented views"):
        run_experiment(ExperimentConfig(algorithm="mcgdm", model="lenet", augmentation="flip_crop", run_dir=tmp_path),
                       progress=False, echo=lambda *_: None)


def test_the_papers_run_settings_fill_only_what_a_run_leaves_unset():
    from fedbed.algorithms.mcgdm import MCGDM

    def settings(config):
        return config.rounds, config.local_epochs, config.local_steps, config.batch_size, config.mixstyle

    # mcgdm.md, Implementation Details and Table 4: 40 rounds x 1 epoch, batch 16 (Office-Home 30), MixStyle.
    assert settings(ExperimentConfig(dataset="pacs", algorithm="MCGDM", target="sketch")) == (40, 1, None, 16, True)
    assert settings(ExperimentConfig(dataset="OfficeHome", algorithm="mcgdm", target="Art")) == (40, 1, None, 30, True)
    # a value the run gives wins, even when it equals a general default; either budget keeps the run's own
    given = ExperimentConfig(dataset="PACS", algorithm="mcgdm", target="sketch", rounds=15, batch_size=64, mixstyle=False)
    assert settings(given) == (15, 1, None, 64, False)
    assert settings(ExperimentConfig(dataset="PACS", algorithm="mcgdm", target="sketch", local_steps=5)) == (40, None, 5, 16, True)
    # a switch set to null is off, and stays off through Flower's run config (which drops nulls)
    off = ExperimentConfig(dataset="PACS", algorithm="mcgdm", target="sketch", mixstyle=None)
    assert off.mixstyle is False
    assert ExperimentConfig(**json.loads(off.model_dump_json(exclude_none=True))).mixstyle is False
    # the paper gives nothing for RotatedMNIST, and other methods keep the general defaults on PACS
    general = settings(ExperimentConfig(dataset="RotatedMNIST", algorithm="fedavg"))
    assert general == (15, 2, None, 64, None)
    assert settings(ExperimentConfig(dataset="RotatedMNIST", algorithm="mcgdm")) == general
    assert settings(ExperimentConfig(dataset="PACS", algorithm="fedavg", target="sketch")) == general
    assert set(MCGDM.dataset_run_settings) == {"PACS", "VLCS", "OfficeHome"}
