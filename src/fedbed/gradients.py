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
