"""Which clients take part in a round: client sampling by participation fraction.

Separate from the round loop (:mod:`fedbed.federation.engine`) so that the settings
(:mod:`fedbed.config`) can count a round's clients without importing the engine.
"""

from __future__ import annotations

import torch

from fedbed.seeding import seeded_generator


def clients_per_round(num_clients: int, participation_fraction: float) -> int:
    """How many clients :func:`sample_clients` selects each round: ``max(1, round(fraction * N))``.

    Raises:
        ValueError: if the fraction lies outside ``(0, 1]``.
    """
    if not 0.0 < participation_fraction <= 1.0:
        raise ValueError(f"participation fraction must lie in (0, 1], got {participation_fraction}")
    return min(num_clients, max(1, round(participation_fraction * num_clients)))


def sample_clients(num_clients: int, participation_fraction: float, seed: int, round_number: int) -> list[int]:
    """The clients taking part in one round: :func:`clients_per_round` drawn without replacement.

    The draw depends only on ``(seed, round_number)``, so a resumed run samples the same clients.

    Raises:
        ValueError: if the fraction lies outside ``(0, 1]``.
    """
    count = clients_per_round(num_clients, participation_fraction)
    if count >= num_clients:
        return list(range(num_clients))
    chosen = torch.randperm(num_clients, generator=seeded_generator(seed, 15485863, round_number))[:count]
    return sorted(int(c) for c in chosen)
