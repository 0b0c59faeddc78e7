"""Leave-one-domain-out splits, id-validation holdouts, client partitions and client sampling.

Every random choice here is driven by an explicit seed through its own ``torch.Generator`` (the
Dirichlet split: its own ``numpy.random.Generator``, for numpy's Dirichlet draws), so the same
seed gives the same split, partition and sample on any run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedbed.data.base import DataError, DomainDataset
from fedbed.seeding import derive_seed, seeded_generator


@dataclass(frozen=True)
class DomainSplit:
    """Which samples train, which validate (id), which test (ood).

    Attributes:
        source_domains: ids of the source domains, ascending.
        target_domains: ids of the held-out target domain(s).
        train: source domain id -> ``int64`` indices of its training samples.
        holdout: source domain id -> ``int64`` indices of its id-validation samples.
        target: ``int64`` indices of every target-domain sample (ood evaluation only).
    """

    source_domains: tuple[int, ...]
    target_domains: tuple[int, ...]
    train: dict[int, torch.Tensor]
    holdout: dict[int, torch.Tensor]
    target: torch.Tensor


def split_leave_one_domain_out(
    dataset: DomainDataset, target_domains: tuple[str, ...], holdout_fraction: float, seed: int,
    present_only: bool = False,
) -> DomainSplit:
    """Hold out the target domain(s); split every source domain into train and id-validation.

    The holdout of each source domain is ``round(holdout_fraction * n)`` samples drawn with a
    generator seeded by ``(seed, domain id)`` (DomainBed's ``holdout_fraction``, default 0.2).
    A domain's split depends on its own samples alone, so a machine holding only some domains
    (``present_only``: data spread over machines) splits them exactly as a machine holding all;
    the domains it lacks have no ``train`` or ``holdout`` entry.

    Raises:
        DataError: unknown target domain, no source domain left, a fraction outside [0, 1), or a
            source domain too small to give both a holdout and training samples.
    """
    if not 0.0 <= holdout_fraction < 1.0:
        raise DataError(f"holdout fraction must lie in [0, 1), got {holdout_fraction}")
    target_ids = tuple(sorted({dataset.domain_index(name) for name in target_domains}))
    sources = tuple(d for d in range(len(dataset.domain_names)) if d not in target_ids)
    if not sources:
        raise DataError(f"every domain of {dataset.name} is a target; leave at least one source domain")
    train, holdout = {}, {}
    present = set(dataset.present_domains())
    for domain_id in sources:
        if present_only and domain_id not in present:
            continue
        indices = dataset.indices_of_domain(domain_id)
        order = indices[torch.randperm(len(indices), generator=seeded_generator(seed, 7919, domain_id))]
        n_holdout = round(holdout_fraction * len(indices))
        name = dataset.domain_names[domain_id]
        if holdout_fraction > 0 and n_holdout == 0:
            raise DataError(f"source domain {name!r} has {len(indices)} samples: a holdout fraction of {holdout_fraction} "
                            "keeps none of them for validation; add samples or raise holdout_fraction")
        if n_holdout >= len(indices):
            raise DataError(f"source domain {name!r} has {len(indices)} samples: a holdout fraction of {holdout_fraction} "
                            "leaves none of them for training; add samples or lower holdout_fraction")
        holdout[domain_id], train[domain_id] = order[:n_holdout].sort().values, order[n_holdout:].sort().values
    target = torch.cat([dataset.indices_of_domain(d) for d in target_ids])
    return DomainSplit(sources, target_ids, train, holdout, target)


@dataclass(frozen=True)
class ClientPartition:
    """One client's training data.

    Attributes:
        indices: ``int64`` dataset indices of the client's training samples; ``None`` on a
            machine that does not hold them (data spread over machines: another site's client).
        domains: ids of the source domains the client holds samples of.
    """

    indices: torch.Tensor | None
    domains: tuple[int, ...]


def _client(pieces: list[torch.Tensor], domains: list[int]) -> ClientPartition:
    return ClientPartition(torch.cat(pieces).sort().values, tuple(sorted(set(domains))))


def partition_one_client_per_domain(split: DomainSplit) -> list[ClientPartition]:
    """One client per source domain (the default protocol of every seed paper); a domain this
    machine does not hold (data spread over machines) gives a client without ``indices``."""
    return [ClientPartition(split.train.get(d), (d,)) for d in split.source_domains]


def partition_pooled(split: DomainSplit) -> list[ClientPartition]:
    """A single client holding every source domain's training data (Central / DeepAll)."""
    return [_client([split.train[d] for d in split.source_domains], list(split.source_domains))]


def _split_evenly(indices: torch.Tensor, parts: int, generator: torch.Generator) -> list[torch.Tensor]:
    shuffled = indices[torch.randperm(len(indices), generator=generator)]
    return list(torch.tensor_split(shuffled, parts))


def partition_domains_per_client(
    split: DomainSplit, num_clients: int, domains_per_client: int, seed: int
) -> list[ClientPartition]:
    """hFedF's data split (``hfedf.txt``, App. C.8.1, Algorithm 5): each client holds ``d`` domain pieces.

    With ``a = floor(N d / |Z|)`` and ``b = (N d) mod |Z|``, the ``b`` largest source domains are
    split at random into ``a + 1`` equal pieces and the others into ``a``; then, ``d`` times, each
    client in turn takes the first remaining piece of the first source domain that still has one.

    Raises:
        DataError: if ``d`` is not in ``1..|Z|`` or ``N d < |Z|`` (some domain would reach no client).
    """
    n_sources = len(split.source_domains)
    if not 1 <= domains_per_client <= n_sources:
        raise DataError(f"domains per client must lie in 1..{n_sources} (the source domains), got {domains_per_client}")
    if num_clients * domains_per_client < n_sources:
        raise DataError(
            f"{num_clients} clients x {domains_per_client} domains each cannot cover {n_sources} source domains; "
            "raise the number of clients or domains per client"
        )
    a, b = divmod(num_clients * domains_per_client, n_sources)
    largest = sorted(split.source_domains, key=lambda d: (-len(split.train[d]), d))[:b]
    pieces = {
        d: _split_evenly(split.train[d], a + 1 if d in largest else a, seeded_generator(seed, 104729, d))
        for d in split.source_domains
    }
    holdings: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(num_clients)]
    for _ in range(domains_per_client):
        for client in holdings:
            for d in split.source_domains:
                if pieces[d]:
                    client.append((d, pieces[d].pop(0)))
                    break
    return [_client([p for _, p in held], [d for d, _ in held]) for held in holdings]


def partition_lambda_mix(split: DomainSplit, num_clients: int, mix_lambda: float, seed: int) -> list[ClientPartition]:
    """FedDG_Benchmark's heterogeneity mix over ``N`` clients.

    Client ``k``'s main domain is source domain ``k mod |Z|``. Of each source domain, a fraction
    ``λ`` is shared evenly among all ``N`` clients and the remaining ``1 − λ`` evenly among the
    clients whose main domain it is: ``λ = 1`` is a homogeneous split, ``λ = 0`` one domain per client.

    Raises:
        DataError: if ``λ`` lies outside ``[0, 1]``, ``N`` is smaller than the number of source
            domains, or a client would receive no sample (too many clients for the data).
    """
    if not 0.0 <= mix_lambda <= 1.0:
        raise DataError(f"mix lambda must lie in [0, 1], got {mix_lambda}")
    n_sources = len(split.source_domains)
    if num_clients < n_sources:
        raise DataError(f"the lambda mix needs at least one client per source domain ({n_sources}), got {num_clients}")
    held: list[list[torch.Tensor]] = [[] for _ in range(num_clients)]
    domains: list[list[int]] = [[] for _ in range(num_clients)]
    for position, d in enumerate(split.source_domains):
        indices = split.train[d][torch.randperm(len(split.train[d]), generator=seeded_generator(seed, 1299709, d))]
        n_shared = round(mix_lambda * len(indices))
        owners = [k for k in range(num_clients) if k % n_sources == position]
        for k, piece in enumerate(torch.tensor_split(indices[:n_shared], num_clients)):
            held[k].append(piece)
            if len(piece):
                domains[k].append(d)
        for k, piece in zip(owners, torch.tensor_split(indices[n_shared:], len(owners))):
            held[k].append(piece)
            if len(piece):
                domains[k].append(d)
    partitions = [_client(pieces, ds) for pieces, ds in zip(held, domains)]
    _require_samples_everywhere(partitions, f"the lambda mix (mix_lambda {mix_lambda:g})", "lower num_clients or mix_lambda")
    return partitions


DEFAULT_DIRICHLET_ALPHA = 0.5
"""α of ``partition: dirichlet`` when ``dirichlet_alpha`` is unset: the default label skew of
NIID-Bench (Li et al. 2022, "Federated Learning on Non-IID Data Silos: An Experimental Study",
Sec. 4), also FedMA's (Wang et al. 2020, Sec. 5)."""


def _require_samples_everywhere(partitions: list[ClientPartition], what: str, remedy: str) -> None:
    """Raise a :class:`DataError` naming the clients ``what`` left without a training sample."""
    empty = [k for k, partition in enumerate(partitions) if partition.indices is not None and not len(partition.indices)]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
        raise DataError(f"{what} leaves {len(empty)} of {len(partitions)} clients without a training sample (client "
                        f"{shown}); {remedy}")


def dirichlet_cut_points(shares: np.ndarray, count: int) -> np.ndarray:
    """Where ``count`` shuffled samples are cut so that client ``k`` receives about ``shares[k]``
    of them: the rounded cumulative shares, ``round(count * (s_0 + ... + s_k))`` for every client
    but the last, so the pieces are contiguous, disjoint and cover all ``count`` samples.

    Args:
        shares: ``float [N]`` non-negative, summing to 1 (one Dirichlet draw).
        count: the number of samples to cut.

    Returns:
        ``int [N - 1]`` non-decreasing cut points in ``0..count`` (``numpy.split``'s sections).
    """
    return np.rint(np.cumsum(shares)[:-1] * count).clip(0, count).astype(np.int64)


def partition_dirichlet(split: DomainSplit, labels: torch.Tensor, num_clients: int, alpha: float,
                        seed: int) -> list[ClientPartition]:
    """The Dirichlet label split over ``N`` clients: non-identical label distributions whose skew
    α sets (Hsu, Qi and Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for
    Federated Visual Classification", Sec. 3, introduced Dirichlet(α) label skew; this is its
    per-class form of Yurochkin et al. 2019, "Bayesian Nonparametric Federated Learning of Neural
    Networks", Sec. 5, and Wang et al. 2020, FedMA, used by NIID-Bench and Flower Datasets'
    ``DirichletPartitioner``).

    The source domains' training samples are pooled; for every class (ascending), its samples are
    shuffled and a share vector ``p ~ Dirichlet_N(α)`` is drawn, and client ``k`` receives the
    ``k``-th contiguous piece (:func:`dirichlet_cut_points`: about ``p_k`` of the class). Small α
    gives each client few classes, large α nearly the same mix of classes everywhere. Domains are
    not taken into account: a client holds whichever domains its samples come from. Every draw comes
    from one ``numpy.random.Generator`` seeded from ``seed``, so the same seed gives the same split.

    Args:
        split: the leave-one-domain-out split (its ``train`` indices are partitioned).
        labels: ``int64 [n]`` the dataset's class labels (indexed by the split's indices).
        num_clients: N >= 1.
        alpha: α > 0, the concentration of each class's Dirichlet draw.
        seed: the run's seed.

    Raises:
        DataError: α not positive and finite, N < 1, regression targets (no classes), or a
            client left without any sample (lower ``num_clients`` or raise α).
    """
    if not (math.isfinite(alpha) and alpha > 0):
        raise DataError(f"the Dirichlet split needs a positive, finite alpha, got {alpha}")
    if num_clients < 1:
        raise DataError(f"the Dirichlet split needs at least one client, got {num_clients}")
    if labels.is_floating_point():
        raise DataError("the Dirichlet label split needs class labels; this dataset has regression targets: use "
                        "another partition")
    pool = torch.cat([split.train[d] for d in split.source_domains])
    pool_domains = torch.cat([torch.full((len(split.train[d]),), d, dtype=torch.int64) for d in split.source_domains])
    pool_labels = labels[pool]
    generator = np.random.default_rng(derive_seed(seed, 15485867))
    held: list[list[torch.Tensor]] = [[] for _ in range(num_clients)]
    for label in torch.unique(pool_labels).tolist():
        members = torch.nonzero(pool_labels == label).flatten().numpy()
        members = members[generator.permutation(len(members))]
        shares = generator.dirichlet(np.full(num_clients, alpha))
        for k, piece in enumerate(np.split(members, dirichlet_cut_points(shares, len(members)))):
            held[k].append(torch.from_numpy(piece))
    partitions = []
    for pieces in held:
        positions = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        partitions.append(ClientPartition(pool[positions].sort().values,
                                          tuple(sorted(set(pool_domains[positions].tolist())))))
    _require_samples_everywhere(partitions, f"the Dirichlet split (alpha {alpha:g})",
                                "lower num_clients or raise dirichlet_alpha")
    return partitions


def split_target_for_adaptation(target: torch.Tensor, adaptation_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``domain_adaptation`` protocol's split of the target domain's samples: a seeded
    ``round(fraction * m)`` for unlabelled adaptation (at least one), the rest, disjoint, for
    the ood test (at least one).

    Returns:
        ``(adaptation indices, test indices)``, each sorted.

    Raises:
        DataError: a fraction outside (0, 1) or a target of fewer than two samples.
    """
    if not 0.0 < adaptation_fraction < 1.0:
        raise DataError(f"adaptation fraction must lie in (0, 1), got {adaptation_fraction}")
    if len(target) < 2:
        raise DataError(f"domain adaptation needs at least two target samples, got {len(target)}")
    order = target[torch.randperm(len(target), generator=seeded_generator(seed, 49979687))]
    count = min(len(target) - 1, max(1, round(adaptation_fraction * len(target))))
    return order[:count].sort().values, order[count:].sort().values


__all__ = [
    "ClientPartition",
    "DEFAULT_DIRICHLET_ALPHA",
    "DomainSplit",
    "dirichlet_cut_points",
    "partition_dirichlet",
    "partition_domains_per_client",
    "partition_lambda_mix",
    "partition_one_client_per_domain",
    "partition_pooled",
    "split_leave_one_domain_out",
    "split_target_for_adaptation",
]


def add_few_shot_target_samples(
    split: DomainSplit, partitions: list[ClientPartition], shots_per_client: int, seed: int
) -> tuple[list[ClientPartition], torch.Tensor]:
    """hFedF's few-shot protocol (``hfedf.txt``, Sec. 5.2, Fig. 3): each client also trains on
    ``k`` target-domain samples, drawn without replacement with a seeded generator; those samples
    leave the ood evaluation set.

    Returns:
        The partitions with the shots added, and the target indices left for ood evaluation.

    Raises:
        DataError: if the clients would need more target samples than exist.
    """
    needed = shots_per_client * len(partitions)
    if needed >= len(split.target):
        raise DataError(
            f"{len(partitions)} clients x {shots_per_client} shots need {needed} target samples; the target has {len(split.target)}"
        )
    order = split.target[torch.randperm(len(split.target), generator=seeded_generator(seed, 32452843))]
    shots = torch.tensor_split(order[:needed], len(partitions))
    enlarged = [ClientPartition(torch.cat([p.indices, s]).sort().values, p.domains) for p, s in zip(partitions, shots)]
    return enlarged, order[needed:].sort().values
