import numpy as np
import pytest
import torch

from fedbed.data import (
    DataError,
    partition_dirichlet,
    partition_domains_per_client,
    partition_lambda_mix,
    partition_one_client_per_domain,
    split_leave_one_domain_out,
)
from fedbed.data.splits import DomainSplit, dirichlet_cut_points
from fedbed.federation.sampling import sample_clients
from tests.helpers import make_dataset


def test_holdout_is_deterministic_disjoint_and_excludes_the_target(tiny_dataset):
    first = split_leave_one_domain_out(tiny_dataset, ("d1",), 0.25, seed=3)
    again = split_leave_one_domain_out(tiny_dataset, ("d1",), 0.25, seed=3)
    other = split_leave_one_domain_out(tiny_dataset, ("d1",), 0.25, seed=4)
    assert first.source_domains == (0, 2) and first.target_domains == (1,)
    for d in first.source_domains:
        assert torch.equal(first.holdout[d], again.holdout[d])
        assert len(first.holdout[d]) == 10 and len(first.train[d]) == 30
        assert not set(first.holdout[d].tolist()) & set(first.train[d].tolist())
        assert (tiny_dataset.domains[first.train[d]] == d).all()
    assert any(not torch.equal(first.holdout[d], other.holdout[d]) for d in first.source_domains)
    target_ids = set(first.target.tolist())
    assert target_ids == set(tiny_dataset.indices_of_domain(1).tolist())
    used = set().union(*(set(first.train[d].tolist()) | set(first.holdout[d].tolist()) for d in first.source_domains))
    assert not used & target_ids


def fake_split(sizes: dict[int, int]) -> DomainSplit:
    offset, train = 0, {}
    for d, n in sizes.items():
        train[d] = torch.arange(offset, offset + n)
        offset += n
    return DomainSplit(tuple(sizes), (99,), train, {d: torch.empty(0, dtype=torch.long) for d in sizes}, torch.empty(0))


def test_algorithm_5_three_clients_two_domains_each():
    # a = floor(3*2/3) = 2, b = 0: every domain in 2 pieces; the sweep gives {0,1}, {0,2}, {1,2}.
    clients = partition_domains_per_client(fake_split({0: 10, 1: 10, 2: 10}), 3, 2, seed=0)
    assert [c.domains for c in clients] == [(0, 1), (0, 2), (1, 2)]
    assert sorted(torch.cat([c.indices for c in clients]).tolist()) == list(range(30))
    assert [len(c.indices) for c in clients] == [10, 10, 10]


def test_algorithm_5_extra_piece_goes_to_the_largest_domain():
    # N=4, d=1, |Z|=3: a=1, b=1; the largest domain (2) is split in two.
    clients = partition_domains_per_client(fake_split({0: 6, 1: 8, 2: 20}), 4, 1, seed=0)
    assert [c.domains for c in clients] == [(0,), (1,), (2,), (2,)]
    assert [len(c.indices) for c in clients] == [6, 8, 10, 10]


def test_algorithm_5_d_equal_one_is_one_client_per_domain():
    split = fake_split({0: 5, 1: 6, 2: 7})
    by_algorithm_5 = partition_domains_per_client(split, 3, 1, seed=1)
    default = partition_one_client_per_domain(split)
    assert [c.domains for c in by_algorithm_5] == [c.domains for c in default]


def test_algorithm_5_rejects_uncoverable_settings():
    with pytest.raises(DataError, match="cannot cover"):
        partition_domains_per_client(fake_split({0: 5, 1: 5, 2: 5}), 1, 2, seed=0)
    with pytest.raises(DataError, match="domains per client"):
        partition_domains_per_client(fake_split({0: 5, 1: 5}), 2, 3, seed=0)


def test_lambda_mix_extremes_and_shares():
    split = fake_split({0: 40, 1: 40, 2: 40})
    alone = partition_lambda_mix(split, 3, 0.0, seed=0)
    assert [c.domains for c in alone] == [(0,), (1,), (2,)]
    mixed = partition_lambda_mix(split, 3, 1.0, seed=0)
    assert all(c.domains == (0, 1, 2) for c in mixed)
    half = partition_lambda_mix(split, 6, 0.5, seed=0)
    # Client 0 (main domain 0): 20/6 of every domain (~3 or 4 each) plus half of the remaining 20 of domain 0.
    own = [i for i in half[0].indices.tolist() if i < 40]
    assert len(own) in (13, 14)
    assert sorted(torch.cat([c.indices for c in half]).tolist()) == list(range(120))


def test_lambda_mix_refuses_to_leave_a_client_without_samples():
    # lambda 1: each domain's 3 samples are shared among 10 clients, so clients 3..9 receive none
    with pytest.raises(DataError, match=r"leaves 7 of 10 clients without a training sample \(client 3, 4, .*lower num_clients"):
        partition_lambda_mix(fake_split({0: 3, 1: 3}), 10, 1.0, seed=0)


def test_dirichlet_cut_points_by_hand():
    # client k receives round(count x cumulative share) - the cut before it
    assert dirichlet_cut_points(np.array([0.5, 0.25, 0.25]), 8).tolist() == [4, 6]  # pieces 4, 2, 2
    assert dirichlet_cut_points(np.array([0.1, 0.9]), 10).tolist() == [1]  # pieces 1, 9
    assert dirichlet_cut_points(np.array([0.0, 0.3, 0.7]), 5).tolist() == [0, 2]  # pieces 0, 2, 3 (1.5 rounds to 2)


def labelled_split() -> tuple[DomainSplit, torch.Tensor]:
    """Two source domains of 60 samples each (ids 0..59 and 60..119), 3 classes of 40: label = id mod 3."""
    return fake_split({0: 60, 1: 60}), torch.arange(120) % 3


def test_dirichlet_split_is_seeded_disjoint_and_complete():
    split, labels = labelled_split()
    clients = partition_dirichlet(split, labels, 4, 1.0, seed=0)
    held = [c.indices.tolist() for c in clients]
    assert sorted(sum(held, [])) == list(range(120))  # every training sample, each to one client
    assert all(held) and all(c.indices.tolist() == sorted(c.indices.tolist()) for c in clients)
    assert [c.domains for c in clients] == [tuple(sorted({i // 60 for i in h})) for h in held]
    again = partition_dirichlet(split, labels, 4, 1.0, seed=0)
    assert all(torch.equal(a.indices, b.indices) for a, b in zip(clients, again))
    other = partition_dirichlet(split, labels, 4, 1.0, seed=1)
    assert any(not torch.equal(a.indices, b.indices) for a, b in zip(clients, other))


def test_dirichlet_split_proportions_follow_alpha():
    split, labels = labelled_split()
    # a huge alpha draws shares of almost exactly 1/4: every client gets 10 of each class's 40
    even = partition_dirichlet(split, labels, 4, 1e6, seed=0)
    assert [[int((labels[c.indices] == label).sum()) for label in range(3)] for c in even] == [[10, 10, 10]] * 4
    # a tiny alpha gives each class (almost) wholly to one client: 3 classes cannot reach 4 clients
    with pytest.raises(DataError, match=r"Dirichlet split \(alpha 0.001\) leaves [1-3] of 4 clients without a training "
                                        r"sample .*raise dirichlet_alpha"):
        partition_dirichlet(split, labels, 4, 1e-3, seed=0)


def test_dirichlet_split_refuses_bad_input():
    split, labels = labelled_split()
    for alpha in (0.0, -1.0, float("inf")):
        with pytest.raises(DataError, match="positive, finite alpha"):
            partition_dirichlet(split, labels, 4, alpha, seed=0)
    with pytest.raises(DataError, match="needs class labels"):
        partition_dirichlet(split, labels.float(), 4, 1.0, seed=0)


def test_client_sampling_is_seeded_per_round():
    assert sample_clients(10, 1.0, seed=0, round_number=1) == list(range(10))
    picks = sample_clients(10, 0.3, seed=0, round_number=5)
    assert len(picks) == 3 and picks == sample_clients(10, 0.3, seed=0, round_number=5)
    assert len({tuple(sample_clients(10, 0.3, seed=0, round_number=r)) for r in range(1, 20)}) > 1
    with pytest.raises(ValueError, match="participation fraction"):
        sample_clients(10, 0.0, seed=0, round_number=1)


def test_split_with_more_domains():
    dataset = make_dataset(per_domain=10, domains=4)
    split = split_leave_one_domain_out(dataset, ("d3",), 0.2, seed=0)
    assert split.source_domains == (0, 1, 2)
    assert [len(split.holdout[d]) for d in split.source_domains] == [2, 2, 2]


def test_few_shot_samples_move_from_evaluation_to_training(tiny_dataset):
    from fedbed.data import add_few_shot_target_samples

    split = split_leave_one_domain_out(tiny_dataset, ("d1",), 0.25, seed=0)
    partitions = partition_one_client_per_domain(split)
    enlarged, ood = add_few_shot_target_samples(split, partitions, 3, seed=0)
    shots = [set(p.indices.tolist()) - set(q.indices.tolist()) for p, q in zip(enlarged, partitions)]
    assert [len(s) for s in shots] == [3, 3]
    target = set(split.target.tolist())
    assert all(s <= target for s in shots) and not (shots[0] & shots[1])
    assert set(ood.tolist()) == target - shots[0] - shots[1]
    with pytest.raises(DataError, match="need"):
        add_few_shot_target_samples(split, partitions, 20, seed=0)
