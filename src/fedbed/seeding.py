"""Deterministic seeds derived from the run's seed, so every random draw can be replayed."""

from __future__ import annotations

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived deterministically from integers (seed, round, client, purpose, ...)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (int(part) + 0x632BE59BD9B4E019 + (value << 6) + (value >> 2))) & ((1 << 64) - 1)
    return value & ((1 << 63) - 1)


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``parts``."""
    return torch.Generator().manual_seed(derive_seed(*parts))
