"""Deterministic seeds derived from the run's seed, so every random draw can be replayed."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived deterministically from integers (seed, round, client, purpose, ...)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (int(part) + 0x632BE59BD9B4E019 + (value << 6) + (value >> 2))) & ((1 << 64) - 1)
    return value & ((1 << 63) - 1)


def name_seed(name: str) -> int:
    """A 63-bit integer for a name (a method, a hyperparameter), to be one of :func:`derive_seed`'s
    parts: the first 8 bytes of the SHA-256 of its UTF-8 text, the same in every process
    (Python's ``hash`` of a string is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") & ((1 << 63) - 1)


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``parts``."""
    return torch.Generator().manual_seed(derive_seed(*parts))
