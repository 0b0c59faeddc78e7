"""The shared gradient math and every update aggregator on hand-computed cases."""

import math

import pytest
import torch

from fedbed.algorithms import ALGORITHMS, get_algorithm, resolve_hyperparameters
from fedbed.algorithms.base.update_aggregation import UpdateAggregation
from fedbed.algorithms.fedgala import GlobalAlignmentAggregation
from fedbed.algorithms.gradient_agreement import (
    AgreementAggregation,
    FedGMAAggregation,
    FedGMAHyperparameters,
    PCGradAggregation,
    gradient_masked_average_mask,
    pcgrad_project,
    sign_agreement,
    unanimous_sign_mask,
)
from fedbed.algorithms.fedomg import FedOMGAggregation, FedOMGHyperparameters
from fedbed.algorithms.hypernetwork import gradalign_weights
from fedbed.algorithms.ppdg import PPDGAggregation, PPDGHyperparameters, ppdg_align
from fedbed.federation.alignment import (
    alignment_telemetry,
    alignment_telemetry_from_gram,
    conflicting_pairs,
    cosine_matrix,
    cosine_similarities,
    mean_pairwise_cosine,
    update_gram_matrix,
)
from fedbed.federation.arrays import flatten, stacked_updates

T = lambda *rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731


def test_ppdg_conflicting_pair_by_hand():
    # <(1,0), (-1,1)> = -1 < 0: ĝ_0 = (1,0) - 2·0.25·((1,0) - (-1,1)) = (0, 0.5);
    # then <ĝ_1, ĝ_0> = <(-1,1), (0,0.5)> = 0.5 >= 0, so ĝ_1 stays.
    aligned = ppdg_align(T([1, 0], [-1, 1]), 0.25, [(0, [1]), (1, [0])])
    assert torch.allclose(aligned, T([0, 0.5], [-1, 1]))


def test_ppdg_leaves_agreeing_updates_alone_unless_asked():
    updates = T([1, 0], [1, 1])
    assert torch.equal(ppdg_align(updates, 0.25, [(0, [1]), (1, [0])]), updates)
    # "w/o gradient conflict" (Table 6): ĝ_0 = (1,0) - 0.5((1,0)-(1,1)) = (1, 0.5); ĝ_1 = (1,1) - 0.5((1,1)-(1,0.5)) = (1, 0.75)
    assert torch.allclose(ppdg_align(updates, 0.25, [(0, [1]), (1, [0])], always_align=True), T([1, 0.5], [1, 0.75]))


def test_ppdg_visiting_order_changes_the_result():
    updates = T([1, 0], [-1, 1], [-1, -1])
    # j = 1 then 2: (1,0) -> (0,0.5) -> (0,0.5) - 0.5((0,0.5) - (-1,-1)) = (-0.5,-0.25)
    first = ppdg_align(updates, 0.25, [(0, [1, 2])])
    # j = 2 then 1: (1,0) -> (0,-0.5) -> (0,-0.5) - 0.5((0,-0.5) - (-1,1)) = (-0.5, 0.25)
    second = ppdg_align(updates, 0.25, [(0, [2, 1])])
    assert torch.allclose(first[0], T([-0.5, -0.25])[0]) and torch.allclose(second[0], T([-0.5, 0.25])[0])
    # The order of the i matters too: visiting 1 before 0 aligns g_1 against the unmodified g_0 first.
    # g_1 = (-1,1) - 0.5((-1,1) - (1,0)) = (0, 0.5); then <g_0, ĝ_1> = 0, no conflict: g_0 stays.
    one_first = ppdg_align(T([1, 0], [-1, 1]), 0.25, [(1, [0]), (0, [1])])
    assert torch.allclose(one_first, T([1, 0], [0, 0.5]))


def test_pcgrad_projection_by_hand():
    # g_0 · g_1 = -1: g_0 - (-1/2) g_1 = (0.5, 0.5); g_1 - (-1/1) g_0 = (0, 1).
    projected = pcgrad_project(T([1, 0], [-1, 1]), [[1], [0]])
    assert torch.allclose(projected, T([0.5, 0.5], [0, 1]))
    assert float(projected[0] @ T([-1, 1])[0]) == pytest.approx(0.0)  # on the normal plane of the original g_1


def test_sign_masks_by_hand():
    updates = T([1, -2, 3, 0], [2, 1, 1, 1])
    assert unanimous_sign_mask(updates).tolist() == [1, 0, 1, 0]  # a zero breaks agreement
    three = T([1, 1, 1, 1], [1, 1, -1, 1], [1, -1, 0, 0])
    # A = |mean sign| = [1, 1/3, 0, 2/3]; with τ = 0.5: M = [1, 1/3, 0, 1] (soft below τ, 1 above)
    assert torch.allclose(sign_agreement(three), T([1, 1 / 3, 0, 2 / 3])[0])
    assert torch.allclose(gradient_masked_average_mask(three, 0.5), T([1, 1 / 3, 0, 1])[0])
    assert torch.equal(gradient_masked_average_mask(three, 0.0), torch.ones(4, dtype=torch.float64))


def test_agrsum_and_agrrand_by_hand():
    updates, weights = T([1, -2, 3, 0], [2, 1, 1, 1]), T(0.5, 0.5)
    agrsum, telemetry = AgreementAggregation(0, random_fill=False).aggregate_updates(updates, weights, torch.Generator())
    assert agrsum.tolist() == [1.5, 0, 2, 0] and telemetry["masked_fraction"] == 0.5
    generator = torch.Generator().manual_seed(3)
    agrrand, _ = AgreementAggregation(0, random_fill=True).aggregate_updates(updates, weights, generator)
    noise = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    scale = (1.5 + 2.0) / 2  # mean |combined| over the agreeing coordinates
    assert torch.allclose(agrrand, T([1.5, scale * noise[1], 2, scale * noise[3]])[0])


def test_fedgma_aggregation_applies_mask_and_server_step():
    strategy = FedGMAAggregation(FedGMAHyperparameters(mask_threshold=0.5, server_learning_rate=0.1), seed=0)
    updates = T([1, 1, 1, 1], [1, 1, -1, 1], [1, -1, 0, 0])
    weights = torch.full((3,), 1 / 3, dtype=torch.float64)
    aggregated, telemetry = strategy.aggregate_updates(updates, weights, torch.Generator())
    mean = updates.mean(dim=0)
    assert torch.allclose(aggregated, T([1, 1 / 3, 0, 1])[0] * mean)
    assert strategy.server_learning_rate == 0.1 and telemetry["mask_mean"] == pytest.approx((1 + 1 / 3 + 0 + 1) / 4)


def test_stacked_updates_by_hand():
    # rows flatten(a_k) - start over the keys in order: ("w" [2], "b" [1])
    start = T([1, 1, 0.5])[0]
    arrays = [{"b": torch.tensor([2.5]), "w": torch.tensor([2.0, 1.0])}, {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([1.5])}]
    updates = stacked_updates(arrays, start, ["w", "b"])
    assert updates.dtype == torch.float64 and updates.tolist() == [[1, 0, 2], [0, -3, 1]]
    with pytest.raises(ValueError, match="start vector holds 3"):
        stacked_updates(arrays, start, ["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_stacked_updates_equal_the_stack_of_flattened_differences_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    current = {"conv": torch.randn(4, 3, generator=generator).to(dtype), "empty": torch.zeros(0, dtype=dtype),
               "bias": torch.randn(5, generator=generator).to(dtype)}
    arrays = [{key: (value.double() + torch.randn(value.shape, generator=generator, dtype=torch.float64)).to(dtype)
               for key, value in current.items()} for _ in range(3)]
    keys = ["conv", "empty", "bias"]
    start = flatten(current, keys)
    expected = torch.stack([flatten(array, keys) - start for array in arrays])
    assert torch.equal(stacked_updates(arrays, start, keys).view(torch.int64), expected.view(torch.int64))


def test_the_gram_matrix_of_updates_by_hand_array_by_array():
    # Updates over two arrays, "w" [2] and "b" [1]: Δ_0 = (1, 0 | 2), Δ_1 = (0, -3 | 1), Δ_2 = 0.
    # G = [[1+4, 2, 0], [2, 9+1, 0], [0, 0, 0]]; norms √5, √10, 0; cos_01 = 2/√50; no conflict.
    sent = [{"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.5])}] * 3
    returned = [{"w": torch.tensor([2.0, 1.0]), "b": torch.tensor([2.5]), "count": torch.tensor(7)},
                {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([1.5])},
                {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.5])}]
    gram = update_gram_matrix(sent, returned, ["w", "b"])
    assert gram.dtype == torch.float64 and gram.tolist() == [[5, 2, 0], [2, 10, 0], [0, 0, 0]]
    telemetry = alignment_telemetry_from_gram(gram, [3, 1, 2])
    assert telemetry["clients"] == [3, 1, 2] and telemetry["conflicting_pairs"] == 0
    assert telemetry["update_norms"] == pytest.approx([math.sqrt(5), math.sqrt(10), 0])
    assert telemetry["cosine"][0][1] == pytest.approx(2 / math.sqrt(50)) and telemetry["cosine"][2] == [0, 0, 0]
    # The same as the telemetry of the stacked updates [K, P].
    stacked = alignment_telemetry(T([1, 0, 2], [0, -3, 1], [0, 0, 0]), [3, 1, 2])
    assert stacked["conflicting_pairs"] == 0 and stacked["update_norms"] == pytest.approx(telemetry["update_norms"])
    assert torch.allclose(torch.tensor(stacked["cosine"]), torch.tensor(telemetry["cosine"]))
    with pytest.raises(ValueError, match="one sent mapping per returned one"):
        update_gram_matrix(sent[:2], returned, ["w"])
    with pytest.raises(ValueError, match="array 'w' holds \\[1, 2\\] values"):
        update_gram_matrix(sent, [*returned[:2], {"w": torch.tensor([1.0]), "b": torch.tensor([0.5])}], ["w", "b"])
    assert update_gram_matrix([], [], ["w"]).shape == (0, 0)


def test_cosines_and_conflicts():
    updates = T([1, 0], [-1, 0], [0, 0], [0, 2])
    cos = cosine_matrix(updates)
    assert cos[0, 1] == -1 and cos[0, 3] == 0 and cos[2].tolist() == [0, 0, 0, 0] and cos[3, 3] == 1
    assert conflicting_pairs(updates) == 1
    telemetry = alignment_telemetry(updates, [4, 5, 6, 7])
    assert telemetry["clients"] == [4, 5, 6, 7] and telemetry["update_norms"] == [1, 1, 0, 2]
    # The six pairs above the diagonal: only (0, 1) is non-zero, at -1.
    assert mean_pairwise_cosine(cos) == pytest.approx(-1 / 6)
    assert mean_pairwise_cosine(torch.tensor(telemetry["cosine"])) == pytest.approx(-1 / 6)
    assert mean_pairwise_cosine(T([1])) is None
    # Against other vectors: (1,0)·(1,1)/√2, and the zero row and the zero column are 0.
    against = cosine_similarities(updates, T([1, 1], [0, 0]))
    assert against.shape == (4, 2) and against[0, 0] == pytest.approx(1 / math.sqrt(2)) and against[3, 0] == pytest.approx(1 / math.sqrt(2))
    assert against[2].tolist() == [0, 0] and against[:, 1].tolist() == [0, 0, 0, 0]


def test_gradalign_weights_by_hand():
    gradients = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # mean (2/3, 2/3): cosines 1/sqrt(2), 1/sqrt(2), 1
    c = 1 / math.sqrt(2)
    positive = torch.softmax(torch.tensor([c, c, 1.0], dtype=torch.float64), dim=0)
    assert torch.allclose(gradalign_weights(gradients), positive)
    assert torch.allclose(gradalign_weights(gradients, "positive"), torch.tensor([0.2994, 0.2994, 0.4013], dtype=torch.float64), atol=1e-4)
    assert torch.allclose(gradalign_weights(gradients, "negative"), torch.tensor([0.3641, 0.3641, 0.2717], dtype=torch.float64), atol=1e-4)
    zeros = gradalign_weights(torch.zeros(3, 4))
    assert torch.allclose(zeros, torch.full((3,), 1 / 3, dtype=torch.float64))


def aggregators():
    return {
        "ppdg": PPDGAggregation(PPDGHyperparameters(alignment_lambda=0.2), seed=0),
        "ppdg_always": PPDGAggregation(PPDGHyperparameters(alignment_lambda=0.2, always_align=True), seed=0),
        "agrsum": AgreementAggregation(0, random_fill=False),
        "agrrand": AgreementAggregation(0, random_fill=True),
        "pcgrad": PCGradAggregation(0),
        "fedgma": FedGMAAggregation(FedGMAHyperparameters(), seed=0),
        "global_alignment": GlobalAlignmentAggregation(0),  # FedGaLA's server, also fedavg_global_alignment's
        "fedomg": FedOMGAggregation(FedOMGHyperparameters(server_learning_rate=1.0)),
        "fedomg_authors_code": FedOMGAggregation(FedOMGHyperparameters(server_learning_rate=1.0, reading="authors_code")),
    }


@pytest.mark.parametrize("name", list(aggregators()))
def test_every_aggregator_on_zero_and_single_client_inputs(name):
    strategy = aggregators()[name]
    zeros, _ = strategy.aggregate_updates(torch.zeros(3, 5, dtype=torch.float64), torch.full((3,), 1 / 3, dtype=torch.float64), torch.Generator())
    assert torch.equal(zeros, torch.zeros(5, dtype=torch.float64))
    single = T([0.5, -1.0, 2.0, 0.0, 3.0])
    alone, _ = strategy.aggregate_updates(single, T(1.0), torch.Generator())
    assert torch.isfinite(alone).all()
    if name.startswith("fedomg"):  # the lone update is its own best match: g + κ‖g‖ g/‖g‖ (the code: / (1 + κ²))
        growth = 1.5 if name == "fedomg" else 1.5 / 1.25
        assert torch.allclose(alone, growth * single[0], rtol=1e-3)
        return
    nonzero = single[0] != 0  # AgrRand fills a zero coordinate (no strict sign: not "agreeing") with noise
    assert torch.allclose(alone[nonzero], single[0][nonzero])
    if name != "agrrand":
        assert torch.allclose(alone, single[0])


def test_every_update_aggregator_is_covered():
    registered = {name for name, cls in ALGORITHMS.items()
                  if isinstance(getattr(cls().create_strategy(cls.hyperparameters(), _Context()), "aggregation", None),
                                UpdateAggregation)}
    assert registered == {"ppdg", "agrsum", "agrrand", "pcgrad", "fedgma", "fedgala", "fedavg_global_alignment", "fedomg"}


class _Context:
    seed = 0
    rounds = 10


def test_ppdg_defaults_follow_the_paper_per_dataset():
    ppdg = get_algorithm("ppdg")
    assert resolve_hyperparameters(ppdg, {}, "RotatedMNIST").alignment_lambda == 0.001
    assert resolve_hyperparameters(ppdg, {}, "TerraIncognita").alignment_lambda == 0.2
    assert resolve_hyperparameters(ppdg, {"alignment_lambda": 0.05}, "RotatedMNIST").alignment_lambda == 0.05
    with pytest.warns(UserWarning, match="Theorem 1"):
        resolve_hyperparameters(ppdg, {"alignment_lambda": 0.5})


def test_ppdg_with_zero_lambda_and_size_weights_is_fedavg():
    updates, weights = T([1, 2], [-3, 1], [0.5, -1]), T(0.2, 0.3, 0.5)
    strategy = PPDGAggregation(PPDGHyperparameters(alignment_lambda=0.0, weighting="num_examples"), seed=0)
    aggregated, _ = strategy.aggregate_updates(updates, weights, torch.Generator())
    assert torch.allclose(aggregated, weights @ updates)
