"""Shared fixtures: the real data beside the checkout (skipped with a reason when absent), tiny synthetic data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedbed.data.base import DomainDataset

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the project checkout."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not present at {SHARED_DATA} (see README, 'Datasets')")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _no_data_root_from_environment(monkeypatch):
    """Tests choose their data root explicitly."""
    monkeypatch.delenv("FEDBED_DATA", raising=False)


def make_dataset(per_domain: int = 40, domains: int = 3, classes: int = 2, side: int = 8, seed: int = 0) -> DomainDataset:
    """A learnable synthetic dataset: the class sets the mean brightness, the domain adds an offset."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(per_domain * domains) % classes
    domain_ids = torch.arange(per_domain * domains) // per_domain
    base = 60 + 120 * labels.float() + 20 * domain_ids.float()
    noise = torch.randint(-30, 30, (len(labels), 1, side, side), generator=generator).float()
    images = (base.view(-1, 1, 1, 1) + noise).clamp(0, 255).to(torch.uint8)
    return DomainDataset(
        name="Synthetic",
        images=images,
        labels=labels,
        domains=domain_ids,
        class_names=tuple(f"c{i}" for i in range(classes)),
        domain_names=tuple(f"d{i}" for i in range(domains)),
        source="synthetic",
    )


@pytest.fixture
def tiny_dataset() -> DomainDataset:
    return make_dataset()
