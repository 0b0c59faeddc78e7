"""How client updates agree: cosine similarities, conflicting pairs and the round's alignment telemetry.

The engine logs :func:`alignment_telemetry` of every round's updates (``rounds.jsonl``); methods
that weight clients by agreement (hFedF's GradAlign, FedGaLA's global alignment) compute their
cosines with :func:`cosine_similarities`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    dots = vectors @ others.T
    scale = torch.outer(vectors.norm(dim=1), others.norm(dim=1))
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
    """Number of unordered pairs ``i < j`` whose updates conflict: ``⟨g_i, g_j⟩ < 0``."""
    gram = updates.to(torch.float64) @ updates.to(torch.float64).T
    return int(torch.triu(gram < 0, diagonal=1).sum())


def alignment_telemetry(updates: torch.Tensor, client_ids: Sequence[int]) -> dict:
    """How the clients' updates of one round agree: cosine matrix, conflicts and norms.

    Args:
        updates: ``[K, P]`` client updates Δθ_k = θ_k − θ_sent, rows in ``client_ids`` order.
        client_ids: the K client ids.

    Returns:
        ``{"clients": [...], "cosine": K x K nested list, "conflicting_pairs": int,
        "update_norms": [...]}`` (JSON-serialisable).
    """
    return {
        "clients": [int(c) for c in client_ids],
        "cosine": cosine_matrix(updates).tolist(),
        "conflicting_pairs": conflicting_pairs(updates),
        "update_norms": updates.to(torch.float64).norm(dim=1).tolist(),
    }
