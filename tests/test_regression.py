"""The engine on a regression task (MSE loss, Pearson r), with PPDG (task-agnostic, Sec. 3.4)."""

import json

import torch

from fedbed.data.base import DomainDataset
from fedbed.federation.engine import run_rounds
from tests.helpers import build_federation


def regression_dataset(per_domain=96, domains=4, side=6):
    """Target = the image's brightness level; each domain overlays a zero-mean checkerboard of its own contrast."""
    generator = torch.Generator().manual_seed(0)
    count = per_domain * domains
    domain_ids = torch.arange(count) // per_domain
    level = torch.rand(count, generator=generator) * 150 + 50
    board = (torch.arange(side).view(-1, 1) + torch.arange(side).view(1, -1)) % 2 * 2 - 1
    images = level.view(-1, 1, 1, 1) + (10 * domain_ids).view(-1, 1, 1, 1) * board
    images = (images + torch.randn(count, 1, side, side, generator=generator) * 5).clamp(0, 255).to(torch.uint8)
    return DomainDataset("SyntheticRegression", images, level / 255.0, domain_ids, (), tuple(f"d{i}" for i in range(domains)), "synthetic")


def test_ppdg_learns_a_synthetic_regression_task(tmp_path):
    federation = build_federation(dataset=regression_dataset(), algorithm="ppdg", hp={"alignment_lambda": 0.1}, batch_size=16)
    evaluations = run_rounds(federation, rounds=4, seed=0, participation_fraction=1.0, eval_every=1, run_dir=tmp_path, progress=False)
    assert evaluations[-1]["metric"] == "pearson_r"
    losses = [json.loads(line)["metrics"]["train_loss"] for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    assert evaluations[-1]["ood_mean"] > 0.9 and evaluations[-1]["id_mean"] > 0.9
