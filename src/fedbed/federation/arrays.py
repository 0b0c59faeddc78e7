"""Named parameter arrays: averaging, copying, flattening, updates and clipping.

The shared array math of every aggregation, written once and tested against hand-computed cases
(``tests/test_gradients.py``); the engine's update measurements build on it
(:func:`fedbed.federation.alignment.update_gram_matrix`).
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


def write_difference(destination: torch.Tensor, returned: torch.Tensor, sent: torch.Tensor) -> None:
    """Write ``returned − sent``, flattened and computed in float64, into ``destination``: the
    values of ``returned.to(float64) − sent.to(float64)``, without a float64 copy of ``returned``
    (one of ``sent`` when it is not float64 already).

    Args:
        destination: ``[n]`` float64, written in place (e.g. a row, or a slice of a row, of a
            larger matrix).
        returned, sent: tensors of n elements each, of any floating-point dtype.
    """
    destination.copy_(returned.detach().reshape(-1))
    destination.sub_(sent.detach().reshape(-1))


def stacked_updates(arrays: Sequence[Mapping[str, torch.Tensor]], start: torch.Tensor, keys: Sequence[str]) -> torch.Tensor:
    """The K updates ``flatten(arrays_k) − start`` as rows of one float64 matrix ``[K, P]``,
    written into it array by array (:func:`write_difference`): the peak memory is the matrix
    alone, not twice it as stacking a list of flattened rows would hold. Bit for bit
    ``torch.stack([flatten(a, keys) − start for a in arrays])``.

    Args:
        arrays: K mappings of name -> tensor, each holding every key.
        start: ``[P]`` float64, :func:`flatten` of the arrays the updates start from.
        keys: the names of the arrays, in the order of ``start``.

    Returns:
        ``[K, P]`` float64.

    Raises:
        ValueError: the arrays named ``keys`` hold other than ``P`` values in all.
    """
    updates = torch.empty(len(arrays), start.numel(), dtype=torch.float64)
    for row, array in zip(updates, arrays):
        sizes = [array[key].numel() for key in keys]
        if sum(sizes) != start.numel():
            raise ValueError(f"the arrays {list(keys)} hold {sum(sizes)} values in all, but the start vector holds "
                             f"{start.numel()}: flatten the start over the same keys")
        for key, segment, start_segment in zip(keys, row.split(sizes), start.split(sizes)):
            write_difference(segment, array[key], start_segment)
    return updates


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
