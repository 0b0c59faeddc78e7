"""Shared math on client updates and parameter dictionaries.

Every aggregation in FedBed goes through these functions, so each is written once and tested
against hand-computed cases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def weighted_average(arrays: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """``Σ_k w_k a_k / Σ_k w_k`` key by key.

    Floating-point tensors are averaged in float64 and cast back; integer tensors (e.g.
    BatchNorm's ``num_batches_tracked``) are averaged and rounded.

    Args:
        arrays: K dicts with identical keys and shapes.
        weights: K non-negative weights, not all zero (e.g. n_k, FedAvg).

    Raises:
        ValueError: if ``arrays`` is empty, lengths differ, or the weights sum to zero.
    """
    if not arrays or len(arrays) != len(weights):
        raise ValueError(f"need as many weights as arrays (got {len(arrays)} arrays, {len(weights)} weights)")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    averaged = {}
    for key, first in arrays[0].items():
        accumulator = torch.zeros(first.shape, dtype=torch.float64)
        for array, weight in zip(arrays, weights):
            accumulator += array[key].to(torch.float64) * (float(weight) / total)
        averaged[key] = accumulator.to(first.dtype) if first.is_floating_point() else accumulator.round().to(first.dtype)
    return averaged


def clone_arrays(arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of every tensor (what crosses the server/client boundary)."""
    return {key: value.detach().clone() for key, value in arrays.items()}


def flatten(arrays: Mapping[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor:
    """Concatenate ``arrays[k]`` for ``k`` in ``keys`` into one float64 vector ``[P]``."""
    return torch.cat([arrays[key].detach().reshape(-1).to(torch.float64) for key in keys])


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Split a vector ``[P]`` back into tensors shaped and typed as ``like[k]`` for ``k`` in ``keys``."""
    out, offset = {}, 0
    for key in keys:
        size = like[key].numel()
        out[key] = vector[offset : offset + size].reshape(like[key].shape).to(like[key].dtype)
        offset += size
    return out


def clip_to_norm(updates: torch.Tensor, clipping_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each row to an L2 norm of at most ``C``: ``Δ_k · min(1, C / ||Δ_k||)``.

    The fixed clipping of client-level differential privacy (McMahan et al., "Learning
    Differentially Private Recurrent Language Models", ICLR 2018; Flower's
    ``compute_clip_model_update``, which clips ``param1 − param2`` the same way).

    Args:
        updates: ``[K, P]`` client updates (any unit: parameter change).
        clipping_norm: ``C`` > 0, in the updates' unit.

    Returns:
        ``(clipped [K, P] float64, norms before clipping [K] float64)``; an all-zero row stays zero.

    Raises:
        ValueError: ``updates`` is not ``[K, P]`` or ``clipping_norm <= 0``.
    """
    if updates.dim() != 2:
        raise ValueError(f"updates must be [K, P], got shape {tuple(updates.shape)}")
    if not clipping_norm > 0:
        raise ValueError(f"the clipping norm must be positive, got {clipping_norm}")
    updates = updates.to(torch.float64)
    norms = updates.norm(dim=1)
    scale = torch.where(norms > clipping_norm, clipping_norm / torch.where(norms > 0, norms, torch.ones_like(norms)),
                        torch.ones_like(norms))
    return updates * scale[:, None], norms


def floating_keys(sent: Mapping[str, torch.Tensor], returned: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point arrays of ``returned`` that ``sent`` holds with the same
    shape, in ``returned``'s order: the arrays over which an update ``returned − sent`` is measured."""
    return [key for key, value in returned.items()
            if value.is_floating_point() and key in sent and sent[key].shape == value.shape]


def clip_update(returned: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor],
                clipping_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``returned`` with its update ``returned − sent`` (over :func:`floating_keys`) clipped to
    norm ``C`` (:func:`clip_to_norm`); other arrays unchanged. What a client sends under
    client-side fixed clipping (Flower's ``fixedclipping_mod``).

    Returns:
        ``(clipped arrays, in the dtypes of returned, the update's norm before clipping)``.

    Raises:
        ValueError: ``clipping_norm <= 0``.
    """
    keys = floating_keys(sent, returned)
    if not keys:
        return dict(returned), 0.0
    start = flatten(sent, keys)
    clipped, norms = clip_to_norm((flatten(returned, keys) - start)[None, :], clipping_norm)
    return {**returned, **unflatten(start + clipped[0], returned, keys)}, float(norms[0])


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


def gradalign_weights(gradients: torch.Tensor, softmax_sign: str = "positive") -> torch.Tensor:
    """GradAlign (hFedF Algorithm 3): softmax of each gradient's cosine with the mean gradient.

    Args:
        gradients: ``[K, P]``, one flattened gradient per client.
        softmax_sign: ``"positive"`` — ``softmax(γ)`` as Algorithm 3; ``"negative"`` —
            ``softmax(−γ)`` as the text of Sec. 4.2.

    Returns:
        ``[K]`` float64 weights summing to 1; a zero gradient (or a zero mean) has cosine 0.
    """
    gradients = gradients.to(torch.float64)
    cosines = cosine_similarities(gradients, gradients.mean(dim=0, keepdim=True))[:, 0]
    return torch.softmax(cosines if softmax_sign == "positive" else -cosines, dim=0)


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


def visiting_orders(count: int, generator: torch.Generator) -> list[list[int]]:
    """For each ``i`` in ``0..count-1``, the other indices ``j != i`` in a random order."""
    return [[j for j in torch.randperm(count, generator=generator).tolist() if j != i] for i in range(count)]


def visiting_plan(count: int, generator: torch.Generator) -> list[tuple[int, list[int]]]:
    """The ``i`` in a random order, each with the other indices ``j != i`` in a random order."""
    outer = torch.randperm(count, generator=generator).tolist()
    inner = visiting_orders(count, generator)
    return [(i, inner[i]) for i in outer]


def ppdg_align(
    updates: torch.Tensor,
    alignment_lambda: float,
    plan: Sequence[tuple[int, Sequence[int]]],
    always_align: bool = False,
) -> torch.Tensor:
    """PPDG's pairwise gradient alignment (``ppdg-gradient-alignment.txt``, Sec. 3.2, Algorithm 1, Eq. 5).

    For each client ``i`` and each other client ``j``, both in the random order of ``plan``
    ("in a random order", Sec. 3.2): if ``⟨ĝ_i, ĝ_j⟩ < 0`` then ``ĝ_i ← ĝ_i − 2λ(ĝ_i − ĝ_j)``, where ``ĝ_j`` is the
    current, possibly already modified, vector, as in Algorithm 1. Only additions,
    multiplications and comparisons are used (no division: the homomorphic-encryption property
    of Sec. 3.2), so all-zero updates pass through unchanged.

    Args:
        updates: ``[K, P]`` client updates.
        alignment_lambda: λ of Eq. 5.
        plan: ``(i, [j, ...])`` pairs in visiting order (:func:`visiting_plan`).
        always_align: align every pair, conflicting or not (the "w/o gradient conflict" ablation, Table 6).

    Returns:
        ``[K, P]`` aligned updates ĝ (a new tensor).
    """
    aligned = updates.to(torch.float64).clone()
    for i, order in plan:
        for j in order:
            if always_align or float(aligned[i] @ aligned[j]) < 0:
                aligned[i] = aligned[i] - 2.0 * alignment_lambda * (aligned[i] - aligned[j])
    return aligned


def pcgrad_project(updates: torch.Tensor, orders: Sequence[Sequence[int]]) -> torch.Tensor:
    """PCGrad's projection (Yu et al., NeurIPS 2020, Algorithm 1) applied to client updates.

    For each ``i`` and each other ``j`` in a random order: if ``g_i^PC · g_j < 0`` then
    ``g_i^PC ← g_i^PC − (g_i^PC · g_j / ||g_j||²) g_j``, projecting onto the normal plane of the
    *original* ``g_j``. A zero ``g_j`` never conflicts, so no division by zero happens.

    Args:
        updates: ``[K, P]``.
        orders: for each ``i``, the ``j`` in visiting order (:func:`visiting_orders`).

    Returns:
        ``[K, P]`` projected updates.
    """
    original = updates.to(torch.float64)
    projected = original.clone()
    squared_norms = (original * original).sum(dim=1)
    for i, order in enumerate(orders):
        for j in order:
            dot = float(projected[i] @ original[j])
            if dot < 0:
                projected[i] = projected[i] - (dot / float(squared_norms[j])) * original[j]
    return projected


def sign_agreement(updates: torch.Tensor) -> torch.Tensor:
    """Per-coordinate sign agreement ``A_j = |(1/K) Σ_k sign(g_kj)|`` in [0, 1] (FedGMA's score).

    Args:
        updates: ``[K, P]``.

    Returns:
        ``[P]`` float64; 1 where every client has the same strict sign, 0 where signs cancel.
    """
    return torch.sign(updates.to(torch.float64)).mean(dim=0).abs()


def unanimous_sign_mask(updates: torch.Tensor) -> torch.Tensor:
    """Mansilla et al.'s agreement mask: 1 where all K updates share one strict sign, else 0.

    ``m_j = 1[|Σ_k sign(g_kj)| = K]``; a zero coordinate in any update breaks agreement.

    Returns:
        ``[P]`` float64 of zeros and ones.
    """
    count = updates.shape[0]
    return (torch.sign(updates.to(torch.float64)).sum(dim=0).abs() == count).to(torch.float64)


def gradient_masked_average_mask(updates: torch.Tensor, mask_threshold: float) -> torch.Tensor:
    """FedGMA's soft mask (Tenison et al. 2022): ``M_j = 1`` if ``A_j >= τ`` else ``A_j``.

    ``A`` is :func:`sign_agreement`. Coordinates below the threshold are scaled by their agreement,
    not zeroed; ``τ = 0`` gives the all-ones mask (FedAvg).

    Returns:
        ``[P]`` float64 in [0, 1].
    """
    agreement = sign_agreement(updates)
    return torch.where(agreement >= mask_threshold, torch.ones_like(agreement), agreement)


def global_gradient_alignment(
    updates: torch.Tensor, weights: torch.Tensor, iterations: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedGaLA's global gradient alignment (``fedgala.md``, Sec. 3.3, Algorithm 1 lines 5-10).

    Starting from the FedAvg update ``ĝ = Σ_k (n_k/n) g_k`` (line 6), ``iterations`` times:
    ``w_k = (cos(g_k, ĝ) + 1) / 2`` (line 8), ``w_k ← w_k / Σ_j w_j`` (line 9) and
    ``ĝ = Σ_k w_k g_k`` (line 10). Clients whose update points along the consensus get more
    weight; a client pointing against it keeps a weight in [0, 1/2] before normalisation (the
    paper does not drop clients at the server).

    Args:
        updates: ``[K, P]`` client updates ``g_k = Θ_k − Θ^{t−1}`` (any unit: parameter change).
        weights: ``[K]`` the FedAvg weights n_k / n of line 6 (non-negative, summing to 1).
        iterations: ``iter`` of line 7 (the paper's default and Fig. 3a's best: 3); 0 gives
            FedAvg's update and weights.

    Returns:
        ``(aggregated update [P], alignment weights [K])``, float64; the weights sum to 1. An
        all-zero update has cosine 0 with everything (weight 1/2 before normalisation); when
        every cosine is −1 (impossible for the consensus of the same vectors, but for
        safety) the weights fall back to the FedAvg weights.

    Raises:
        ValueError: ``updates`` not ``[K, P]`` with K >= 1, ``weights`` not ``[K]``, or
            ``iterations < 0``.
    """
    if updates.dim() != 2 or updates.shape[0] < 1:
        raise ValueError(f"updates must be [K, P] with K >= 1, got shape {tuple(updates.shape)}")
    if weights.shape != (updates.shape[0],):
        raise ValueError(f"weights must be [K] = [{updates.shape[0]}], got shape {tuple(weights.shape)}")
    if iterations < 0:
        raise ValueError(f"the number of alignment iterations must be >= 0, got {iterations}")
    updates, current = updates.to(torch.float64), weights.to(torch.float64)
    aggregated = current @ updates
    for _ in range(iterations):
        alignment = (cosine_similarities(updates, aggregated[None, :])[:, 0] + 1.0) / 2.0
        total = float(alignment.sum())
        current = alignment / total if total > 0 else weights.to(torch.float64)
        aggregated = current @ updates
    return aggregated, current


def update_alignment(step: torch.Tensor, reference: torch.Tensor) -> float:
    """Cosine between a parameter tensor's update direction and a reference change of it.

    FedGaLA's local alignment test (``fedgala.md``, Sec. 3.3, Algorithm 1 line 18) compares one
    layer's batch step with the global model's last change ĝ_est = θ^(t) − θ^(t−1). Both must be
    parameter changes (a gradient g points uphill; its step is −η·g), which the caller ensures.

    Args:
        step: the proposed change of one parameter tensor (any shape).
        reference: the reference change, same number of elements.

    Returns:
        The cosine in [−1, 1]; ``nan`` when either vector is all zeros (undefined: the caller
        decides what an undefined cosine means).

    Raises:
        ValueError: the two have different numbers of elements.
    """
    if step.numel() != reference.numel():
        raise ValueError(f"an update of {step.numel()} elements cannot be compared with a reference of {reference.numel()}")
    a, b = step.detach().reshape(-1).to(torch.float64), reference.detach().reshape(-1).to(torch.float64)
    scale = float(a.norm() * b.norm())
    return float(a @ b) / scale if scale > 0 else float("nan")
