"""How client updates agree: cosine similarities, conflicting pairs and the round's alignment telemetry.

The engine logs the alignment telemetry of every round's updates (``rounds.jsonl``) from their
Gram matrix (:func:`update_gram_matrix`, then :func:`alignment_telemetry_from_gram`), which it
accumulates one array at a time rather than from the ``[K, P]`` matrix of the updates; methods
that weight clients by agreement (hFedF's GradAlign, FedGaLA's global alignment) compute their
cosines with :func:`cosine_similarities`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedbed.federation.arrays import write_difference


def cosine_similarities(vectors: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """Cosine ``⟨a_k, b_m⟩ / (||a_k|| ||b_m||)`` of every row of ``vectors`` with every row of ``others``.

    Args:
        vectors: ``[K, P]``.
        others: ``[M, P]``.

    Returns:
        ``[K, M]`` float64; an entry involving an all-zero vector is 0 (cosine undefined), so the
        result is always finite.
    """
    vectors, others = vectors.to(torch.float64), others.to(torch.float64)
    return cosines_from_dots(vectors @ others.T, vectors.norm(dim=1), others.norm(dim=1))


def cosines_from_dots(dots: torch.Tensor, norms: torch.Tensor, other_norms: torch.Tensor) -> torch.Tensor:
    """``dots[k, m] / (norms[k] other_norms[m])``, 0 where either norm is 0 (cosine undefined).

    Args:
        dots: ``[K, M]`` inner products ``⟨a_k, b_m⟩``.
        norms: ``[K]`` the ``||a_k||``.
        other_norms: ``[M]`` the ``||b_m||``.

    Returns:
        ``[K, M]``, always finite.
    """
    scale = torch.outer(norms, other_norms)
    return torch.where(scale > 0, dots / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(dots))


def cosine_matrix(updates: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarities of K update vectors (:func:`cosine_similarities` of ``updates`` with itself).

    Args:
        updates: ``[K, P]``.

    Returns:
        ``[K, K]`` float64; a row or column of an all-zero update is 0 (cosine undefined), so the
        result is always finite.
    """
    return cosine_similarities(updates, updates)


def mean_pairwise_cosine(cosine: torch.Tensor) -> float | None:
    """Mean of the ``K(K−1)/2`` cosines above the diagonal of a cosine matrix, i.e. over the
    unordered client pairs ``i < j``.

    Args:
        cosine: ``[K, K]``, e.g. :func:`cosine_matrix` or the ``"cosine"`` of :func:`alignment_telemetry`.

    Returns:
        The mean, or ``None`` for ``K < 2`` (no pair).
    """
    count = cosine.shape[0]
    if count < 2:
        return None
    rows, columns = torch.triu_indices(count, count, offset=1)
    return float(cosine.to(torch.float64)[rows, columns].mean())


def conflicting_pairs(updates: torch.Tensor) -> int:
    """Number of unordered pairs ``i < j`` whose updates conflict: ``⟨g_i, g_j⟩ < 0``.

    Args:
        updates: ``[K, P]``.
    """
    return conflicting_pairs_from_gram(updates.to(torch.float64) @ updates.to(torch.float64).T)


def conflicting_pairs_from_gram(gram: torch.Tensor) -> int:
    """Number of unordered pairs ``i < j`` with ``G_ij = ⟨g_i, g_j⟩ < 0``.

    Args:
        gram: ``[K, K]`` Gram matrix of K vectors.
    """
    return int(torch.triu(gram < 0, diagonal=1).sum())


def update_gram_matrix(sent: Sequence[Mapping[str, torch.Tensor]], returned: Sequence[Mapping[str, torch.Tensor]],
                       keys: Sequence[str]) -> torch.Tensor:
    """Gram matrix ``G_ij = ⟨Δ_i, Δ_j⟩`` of the K updates ``Δ_k = returned_k − sent_k`` over the
    arrays named ``keys``, accumulated one array at a time in float64.

    Equal, up to the order of float64 summation, to ``U @ U.T`` for the updates ``U [K, P]``
    (:func:`fedbed.federation.arrays.flatten` of each difference), without holding ``U``: the
    memory is K + 1 float64 copies of the largest array instead of K × P, e.g. at K = 100
    clients of ResNet-50 (P ≈ 23.5 million, the largest array 2.36 million) 1.9 GB instead of
    18.8 GB.

    Args:
        sent: K mappings of name -> tensor, what each client was sent.
        returned: K mappings, what each client returned; each holds every key with as many
            values as ``sent`` holds it with.
        keys: the names of the arrays the updates run over.

    Returns:
        ``[K, K]`` float64 (squared parameter units), symmetric up to rounding, with a
        non-negative diagonal: the squared update norms.

    Raises:
        ValueError: ``sent`` and ``returned`` differ in length, or an array's size differs
            between two clients.
    """
    if len(sent) != len(returned):
        raise ValueError(f"update_gram_matrix needs one sent mapping per returned one, got {len(sent)} and {len(returned)}")
    gram = torch.zeros(len(returned), len(returned), dtype=torch.float64)
    for key in keys if returned else ():
        sizes = [arrays[key].numel() for arrays in (*sent, *returned)]
        if len(set(sizes)) > 1:
            raise ValueError(f"array {key!r} holds {sorted(set(sizes))} values across the clients' sent and "
                             "returned arrays; an update needs the same size in each")
        differences = torch.empty(len(returned), sizes[0], dtype=torch.float64)
        for row, sent_arrays, returned_arrays in zip(differences, sent, returned):
            write_difference(row, returned_arrays[key], sent_arrays[key])
        gram += differences @ differences.T
    return gram


def norms_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """The vectors' norms ``√G_kk`` from their Gram matrix ``[K, K]`` (a diagonal entry below 0
    by rounding reads 0).

    Returns:
        ``[K]`` float64, in the vectors' units.
    """
    return gram.to(torch.float64).diagonal().clamp_min(0).sqrt()


def alignment_telemetry(updates: torch.Tensor, client_ids: Sequence[int]) -> dict:
    """How the clients' updates of one round agree: cosine matrix, conflicts and norms
    (:func:`alignment_telemetry_from_gram` of the updates' Gram matrix).

    Args:
        updates: ``[K, P]`` client updates Δθ_k = θ_k − θ_sent, rows in ``client_ids`` order.
        client_ids: the K client ids.

    Returns:
        As :func:`alignment_telemetry_from_gram`.
    """
    updates = updates.to(torch.float64)
    return alignment_telemetry_from_gram(updates @ updates.T, client_ids)


def alignment_telemetry_from_gram(gram: torch.Tensor, client_ids: Sequence[int]) -> dict:
    """How the clients' updates of one round agree, from their Gram matrix ``G_ij = ⟨Δ_i, Δ_j⟩``
    (:func:`update_gram_matrix`): norms ``√G_kk``, cosines ``G_ij / (√G_ii √G_jj)`` (0 where
    an update is all zero, as :func:`cosine_similarities`) and conflicting pairs ``G_ij < 0``.

    Args:
        gram: ``[K, K]``, rows and columns in ``client_ids`` order.
        client_ids: the K client ids.

    Returns:
        ``{"clients": [...], "cosine": K x K nested list, "conflicting_pairs": int,
        "update_norms": [...]}`` (JSON-serialisable).
    """
    gram = gram.to(torch.float64)
    norms = norms_from_gram(gram)
    return {
        "clients": [int(c) for c in client_ids],
        "cosine": cosines_from_dots(gram, norms, norms).tolist(),
        "conflicting_pairs": conflicting_pairs_from_gram(gram),
        "update_norms": norms.tolist(),
    }
