"""FedGaLA (fedgala.md): local alignment keeps steps along the global model's last change and drops
those against it; global alignment on hand-made vectors; the reference the server sends; the
ablation switches and the logged discard ratios and weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.local_training import make_optimizer
from fedbed.algorithms.base.model_aggregation import ClientModels
from fedbed.algorithms.fedgala import (
    AUTHORS_CODE,
    GlobalAlignmentAggregation,
    GlobalAlignmentStrategy,
    LocalAlignment,
    global_gradient_alignment,
    reference_of,
    update_alignment,
)
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.messages import ClientInfo, Reply
from fedbed.models import DomainClassifier

SMALL = {"projection_hidden_dim": 16, "projection_dim": 8}


def one_weight_model() -> nn.Linear:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def step_with_gradient(model, gradient, reference, **options):
    """One SGD step (lr 1) with the given gradient through the local-alignment hook."""
    hook = LocalAlignment(model, {"weight": reference}, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.weight.grad = gradient.clone().view(1, 2)
    hook(optimizer)
    optimizer.step()
    return hook


def test_a_step_along_the_global_change_is_kept_and_one_against_it_dropped():
    reference = torch.tensor([[1.0, 0.0]])  # the global model's weight grew along the first axis
    along = one_weight_model()
    hook = step_with_gradient(along, torch.tensor([-1.0, 0.5]), reference)  # step -g = (1, -0.5): cosine > 0
    assert torch.allclose(along.weight, torch.tensor([[1.0, -0.5]])) and hook.metrics()["discard_ratio"] == 0.0
    against = one_weight_model()
    hook = step_with_gradient(against, torch.tensor([1.0, 0.5]), reference)  # step (-1, -0.5): cosine < 0
    assert torch.equal(against.weight, torch.zeros(1, 2)) and hook.metrics() == {"discard_ratio": 1.0, "discard_ratio/weight": 1.0}
    # "at most τ" is dropped: a step orthogonal to the reference (cosine 0) is skipped at τ = 0 ...
    orthogonal = one_weight_model()
    step_with_gradient(orthogonal, torch.tensor([0.0, -1.0]), reference)
    assert torch.equal(orthogonal.weight, torch.zeros(1, 2))
    # ... and kept at τ = -0.1 (Fig. 2d's lower threshold).
    step_with_gradient(orthogonal, torch.tensor([0.0, -1.0]), reference, threshold=-0.1)
    assert torch.allclose(orthogonal.weight, torch.tensor([[0.0, 1.0]]))


def test_reweighting_shrinks_the_unaligned_step_and_a_zero_reference_keeps_it():
    reweighted = one_weight_model()
    hook = step_with_gradient(reweighted, torch.tensor([1.0, 0.5]), torch.tensor([[1.0, 0.0]]),
                              unaligned_update="reweight", reweight_factor=0.1)
    assert torch.allclose(reweighted.weight, torch.tensor([[-0.1, -0.05]])) and hook.metrics()["discard_ratio"] == 1.0
    unchanged_layer = one_weight_model()
    hook = step_with_gradient(unchanged_layer, torch.tensor([1.0, 0.5]), torch.zeros(1, 2))
    assert torch.allclose(unchanged_layer.weight, torch.tensor([[-1.0, -0.5]]))  # undefined cosine: kept
    assert hook.metrics() == {"discard_ratio": 0.0}  # and not counted as compared
    assert math.isnan(update_alignment(torch.ones(2), torch.zeros(2)))
    with pytest.raises(ValueError, match="server and client models differ"):
        LocalAlignment(one_weight_model(), {"weight": torch.zeros(3)})


def test_with_adam_the_discarded_layer_does_not_move_at_all():
    """A dropped gradient is None, so Adam's step (and its weight decay) leaves the tensor alone."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    hparams = get_algorithm("fedgala").hyperparameters(client_weight_decay=0.1)
    optimizer = make_optimizer(model.parameters(), hparams)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 2)).sum().backward()
    # reference for layer 0's weight exactly against its step, for layer 1's weight exactly along it
    reference = {"0.weight": model[0].weight.grad.clone(), "1.weight": -model[1].weight.grad.clone()}
    hook = LocalAlignment(model, reference)
    hook(optimizer)
    optimizer.step()
    assert torch.equal(model[0].weight, before["0.weight"]) and not torch.equal(model[1].weight, before["1.weight"])
    assert hook.metrics()["discard_ratio"] == 0.5


def test_global_alignment_on_three_hand_made_vectors():
    # g1 = (1, 0), g2 = (0, 1), g3 = (1, 0), FedAvg weights 1/3 each: ĝ0 = (2/3, 1/3).
    # cos(g1, ĝ0) = cos(g3, ĝ0) = 2/√5, cos(g2, ĝ0) = 1/√5; w = (cos + 1) / 2, normalised.
    updates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    weights = torch.full((3,), 1 / 3, dtype=torch.float64)
    high, low = (2 / math.sqrt(5) + 1) / 2, (1 / math.sqrt(5) + 1) / 2
    w1 = torch.tensor([high, low, high]) / (2 * high + low)
    aggregated, alignment = global_gradient_alignment(updates, weights, iterations=1)
    assert torch.allclose(alignment, w1.double()) and torch.allclose(aggregated, torch.tensor([2 * w1[0], w1[1]]).double())
    # Second iteration from ĝ1 = (a, b), a = 2 w1[0], b = w1[1]: cos(g1, ĝ1) = a / |ĝ1|, cos(g2, ĝ1) = b / |ĝ1|.
    a, b = float(2 * w1[0]), float(w1[1])
    norm = math.hypot(a, b)
    high2, low2 = (a / norm + 1) / 2, (b / norm + 1) / 2
    w2 = torch.tensor([high2, low2, high2], dtype=torch.float64) / (2 * high2 + low2)
    aggregated2, alignment2 = global_gradient_alignment(updates, weights, iterations=2)
    assert torch.allclose(alignment2, w2) and torch.allclose(aggregated2, w2 @ updates.double())
    assert float(alignment2[1]) < float(alignment[1]) < 1 / 3  # the odd client loses weight with every iteration
    fedavg, kept = global_gradient_alignment(updates, weights, iterations=0)
    assert torch.equal(kept, weights) and torch.allclose(fedavg, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    with pytest.raises(ValueError, match="weights must be"):
        global_gradient_alignment(updates, weights[:2])


def test_compared_gradient_gradient_tests_plus_g_as_the_authors_code_does():
    """``compared_gradient: gradient`` (utils.py ``client_update``): the cosine of +g with the reference decides,
    so the step that undoes the global change is kept and the one along it dropped (the mirror of the test above)."""
    reference = torch.tensor([[1.0, 0.0]])
    undoing = one_weight_model()
    hook = step_with_gradient(undoing, torch.tensor([1.0, 0.5]), reference, compared_gradient="gradient")
    # cos(+g, ĝ) = 1 / √1.25 > 0: kept, and SGD moves the weight by −g.
    assert torch.allclose(undoing.weight, torch.tensor([[-1.0, -0.5]])) and hook.metrics()["discard_ratio"] == 0.0
    along = one_weight_model()
    hook = step_with_gradient(along, torch.tensor([-1.0, 0.5]), reference, compared_gradient="gradient")
    assert torch.equal(along.weight, torch.zeros(1, 2)) and hook.metrics()["discard_ratio"] == 1.0  # cos = −1/√1.25
    # The authors' τ = −0.1 on +g keeps a slightly negative cosine: g = (−0.05, 1), cos = −0.05/√1.0025 ≈ −0.0499.
    slight = one_weight_model()
    step_with_gradient(slight, torch.tensor([-0.05, 1.0]), reference, compared_gradient="gradient", threshold=-0.1)
    assert torch.allclose(slight.weight, torch.tensor([[0.05, -1.0]]))


def test_per_parameter_scope_aligns_each_parameter_on_its_own():
    """``global_alignment_scope: per_parameter`` (utils.py ``Aggregation_by_Alignment``): parameter a gets the
    three-vector case of the test above, parameter b's updates (1, 1, −1) get weights (1, 1, 0)/2; the buffer is
    FedAvg's average; the logged weights are the two weight vectors' mean."""
    current = {"a": torch.zeros(2), "b": torch.zeros(1), "count": torch.zeros(1)}
    shifts = [([1.0, 0.0], 1.0, 3.0), ([0.0, 1.0], 1.0, 6.0), ([1.0, 0.0], -1.0, 0.0)]
    arrays = [{"a": torch.tensor(a), "b": torch.tensor([b]), "count": torch.tensor([c])} for a, b, c in shifts]

    def aggregate(scope):
        models = ClientModels(current, [0, 1, 2], arrays, [10] * 3, 1, torch.Generator(), frozenset({"a", "b"}))
        return GlobalAlignmentAggregation(0, iterations=1, scope=scope).aggregate(models)

    state, telemetry = aggregate("per_parameter")
    high, low = (2 / math.sqrt(5) + 1) / 2, (1 / math.sqrt(5) + 1) / 2
    w_a = torch.tensor([high, low, high], dtype=torch.float64) / (2 * high + low)
    w_b = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert torch.allclose(state["a"], torch.tensor([2 * w_a[0], w_a[1]]).float())
    assert torch.allclose(state["b"], torch.tensor([1.0])) and torch.allclose(state["count"], torch.tensor([3.0]))
    assert telemetry["weights"] == pytest.approx(((w_a + w_b) / 2).tolist())
    whole, _ = aggregate("model")  # one vector per client: b's disagreement no longer zeroes client 3 on b
    assert not torch.allclose(whole["b"], torch.tensor([1.0]))


def test_size_and_alignment_consensus_follows_the_authors_abya():
    """``consensus_weighting: size_and_alignment`` (utils.py ``AbyA`` on the updates times the clients' shares):
    g1 = (1, 0), g2 = (0, 1), shares (3/4, 1/4). Iteration 1 is the paper's (both consensuses point along (3, 1));
    iteration 2's consensus is w1·(3/4)·g1 + w2·(1/4)·g2 instead of w1·g1 + w2·g2; 0 iterations give 1/K."""
    updates = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    shares = torch.tensor([0.75, 0.25], dtype=torch.float64)
    c1, c2 = 3 / math.sqrt(10), 1 / math.sqrt(10)
    w1 = torch.tensor([(c1 + 1) / 2, (c2 + 1) / 2], dtype=torch.float64)
    w1 = w1 / w1.sum()
    _, first = global_gradient_alignment(updates, shares, 1, "size_and_alignment")
    assert torch.allclose(first, w1)
    consensus = torch.stack([0.75 * w1[0], 0.25 * w1[1]])
    cosines = consensus / consensus.norm()  # cos(g_k, c) = c_k / |c| for the unit vectors g_k
    w2 = (cosines + 1) / 2
    w2 = w2 / w2.sum()
    aggregated, second = global_gradient_alignment(updates, shares, 2, "size_and_alignment")
    assert torch.allclose(second, w2) and torch.allclose(aggregated, w2)  # the model moves by Σ w_k g_k
    _, paper = global_gradient_alignment(updates, shares, 2)
    assert not torch.allclose(paper, w2)
    uniform, weights0 = global_gradient_alignment(updates, shares, 0, "size_and_alignment")
    assert torch.allclose(weights0, torch.tensor([0.5, 0.5], dtype=torch.float64)) and torch.allclose(uniform, weights0)


def test_uniform_weight_share_mixes_the_weights_with_one_over_k():
    """``uniform_weight_share`` γ (utils.py ``AbyA``'s ``gamma``): w ← (1 − γ)·w + γ/K, the update Σ w_k g_k."""
    updates = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    shares = torch.tensor([0.75, 0.25], dtype=torch.float64)
    aggregated, weights = global_gradient_alignment(updates, shares, 0, uniform_weight_share=0.5)
    assert torch.allclose(weights, torch.tensor([0.625, 0.375], dtype=torch.float64)) and torch.allclose(aggregated, weights)
    _, aligned = global_gradient_alignment(updates, shares, 1)
    _, mixed = global_gradient_alignment(updates, shares, 1, uniform_weight_share=0.2)
    assert torch.allclose(mixed, 0.8 * aligned + 0.1)


def test_reading_authors_code_sets_every_switch_not_given_and_reaches_the_server():
    spec = get_algorithm("fedgala")
    paper = spec.hyperparameters()
    assert (paper.compared_gradient, paper.global_alignment_scope, paper.consensus_weighting, paper.alignment_threshold,
            paper.uniform_weight_share) == ("step", "model", "alignment", 0.0, 0.0)
    authors = spec.hyperparameters(reading="authors_code")
    assert {name: getattr(authors, name) for name in AUTHORS_CODE} == AUTHORS_CODE
    assert AUTHORS_CODE == {"compared_gradient": "gradient", "alignment_threshold": -0.1,
                            "global_alignment_scope": "per_parameter", "consensus_weighting": "size_and_alignment"}
    assert spec.hyperparameters(reading="authors_code", alignment_threshold=0.0).alignment_threshold == 0.0
    context = type("Context", (), {"seed": 0})()
    aggregation = spec.create_strategy(spec.hyperparameters(reading="authors_code", uniform_weight_share=0.25), context).aggregation
    assert (aggregation.scope, aggregation.options, aggregation.iterations) == ("per_parameter", ("size_and_alignment", 0.25), 3)
    without = spec.create_strategy(spec.hyperparameters(reading="authors_code", global_alignment=False), context).aggregation
    assert (without.iterations, without.scope, without.options) == (0, "model", ("alignment", 0.0))  # FedAvg


def replies_of(model, shifts):
    state = model.state_dict()
    return {c: Reply({k: v + shift for k, v in state.items()}, num_examples=10, metrics={"loss": 1.0, "discard_ratio": 0.25 * c})
            for c, shift in shifts.items()}


def test_the_server_sends_the_global_models_last_change_read_only():
    torch.manual_seed(0)
    model = DomainClassifier(nn.Flatten(), nn.Linear(2, 2), 2)
    strategy = GlobalAlignmentStrategy(send_reference=True)
    strategy.initialize(model, [ClientInfo(c, 10, (c,)) for c in range(3)])
    assert all(p.read_only_arrays == {} for p in strategy.configure_round(1, [0, 1, 2]).values())  # round 1: none
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = strategy.aggregate(1, replies_of(model, {0: 1.0, 1: 1.0, 2: 1.0}))
    assert summary.metrics["discard_ratio"] == pytest.approx(0.25)  # mean over the clients' ratios
    assert summary.telemetry["weights"] == pytest.approx([1 / 3] * 3) and summary.telemetry["clients"] == [0, 1, 2]
    payloads = strategy.configure_round(2, [1])
    reference = reference_of(payloads[1])
    assert set(reference) == {"classifier.weight", "classifier.bias"} and set(payloads[1].arrays) == set(model.state_dict())
    assert torch.allclose(reference["classifier.bias"], model.state_dict()["classifier.bias"] - before["classifier.bias"])
    assert torch.allclose(reference["classifier.bias"], torch.ones(2))  # every client moved by +1
    restored = GlobalAlignmentStrategy(send_reference=True)
    restored.initialize(DomainClassifier(nn.Flatten(), nn.Linear(2, 2), 2), [])
    restored.load_state_dict(strategy.state_dict())
    assert torch.equal(reference_of(restored.configure_round(2, [0])[0])["classifier.weight"], reference["classifier.weight"])


def run(tmp_path, name, **hp):
    config = ExperimentConfig(algorithm="fedgala", model="lenet", rounds=2, local_steps=2, batch_size=16, hp={**SMALL, **hp},
                              run_dir=tmp_path / name, linear_probe={"epochs": 2})
    run_experiment(config, progress=False, echo=lambda *_: None)
    return [json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]


def test_fedgala_logs_discard_ratios_and_weights_and_its_switches_work(tmp_path):
    rounds = run(tmp_path, "full")
    assert "discard_ratio" not in rounds[0]["metrics"]  # round 1: no reference, no discard
    second = rounds[1]["metrics"]
    assert 0.0 <= second["discard_ratio"] <= 1.0
    per_layer = [k for k in second if k.startswith("discard_ratio/")]
    assert "discard_ratio/featurizer.layers.0.weight" in per_layer and "discard_ratio/projector.0.weight" in per_layer
    weights = rounds[1]["telemetry"]["weights"]
    assert sum(weights) == pytest.approx(1.0) and weights != rounds[1]["telemetry"]["fedavg_weights"]
    without_local = run(tmp_path, "no_local", local_alignment=False)
    assert not any(k.startswith("discard_ratio") for k in without_local[1]["metrics"])
    without_global = run(tmp_path, "no_global", global_alignment=False)
    assert without_global[1]["telemetry"]["weights"] == without_global[1]["telemetry"]["fedavg_weights"]
    reweighted = run(tmp_path, "reweight", unaligned_update="reweight", reweight_factor=0.01, l2_coefficient=0.001,
                     proximal_coefficient=0.01)
    assert "discard_ratio" in reweighted[1]["metrics"]


def test_global_alignment_works_with_supervised_clients(tmp_path, monkeypatch):
    """``fedavg_global_alignment`` runs FedAvg's supervised clients under FedGaLA's server: the
    logged FedAvg weights are n_k/n of the clients' sizes, and the weights it aggregates with are
    three iterations of global alignment from them (Algorithm 1, lines 6-10) on the round's
    updates, which differ from the FedAvg weights."""
    from fedbed.build import build_run

    seen = []
    original = GlobalAlignmentAggregation.aggregate_updates

    def recording(self, updates, weights, generator):
        seen.append((updates.clone(), weights.clone()))
        return original(self, updates, weights, generator)

    monkeypatch.setattr(GlobalAlignmentAggregation, "aggregate_updates", recording)
    config = ExperimentConfig(algorithm="fedavg_global_alignment", model="lenet", rounds=1, local_steps=2, batch_size=16,
                              run_dir=tmp_path)
    summary = run_experiment(config, progress=False, echo=lambda *_: None)
    telemetry = json.loads((tmp_path / "rounds.jsonl").read_text())["telemetry"]
    assert sum(telemetry["weights"]) == pytest.approx(1.0) and len(telemetry["weights"]) == 5
    sizes = [len(partition.indices) for partition in build_run(config).partitions]
    assert telemetry["fedavg_weights"] == pytest.approx([n / sum(sizes) for n in sizes])
    (updates, weights), = seen
    assert weights.tolist() == pytest.approx(telemetry["fedavg_weights"])
    _, aligned = global_gradient_alignment(updates, weights, iterations=3)
    assert telemetry["weights"] == pytest.approx(aligned.tolist())
    assert max(abs(a - b) for a, b in zip(telemetry["weights"], telemetry["fedavg_weights"])) > 1e-6
    assert summary["evaluation"]["protocol"] == "argmax"


def test_fedgala_runs_with_other_objectives_table_3():
    spec = get_algorithm("fedgala")
    for objective, expected in (("moco", "MoCoObjective"), ("byol", "BYOLObjective"), ("simclr", "SimCLRObjective")):
        built = spec.build_objective(spec.hyperparameters(objective=objective))
        assert type(built).__name__ == expected
    assert spec.build_objective(spec.hyperparameters(objective="moco")).temperature == 0.5  # FedGaLA's temperature
