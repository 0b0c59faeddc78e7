"""The engine's refactorings keep every existing method's numbers bit for bit.

A short RotatedMNIST run per entry (the embedded MNIST sample, LeNet, 2 rounds of 3 local steps
of 16 samples, seed 0, one torch thread) must equal, exactly, its recording for one of the
machines in ``tests/recordings/bit_identity.json``. A change to the engine that alters any
floating-point operation of these methods changes at least one of these numbers.

Exact values depend on the machine's arithmetic, not only on the code: torch's CPU kernels
differ by instruction set and vendor. On an AMD EPYC with torch CPU capability AVX2 the first
recordings are missed by up to 5e-7 relative for the supervised entries and by 4% for
``fedsimclr_probe`` (6e-4 already in its first round's loss; its probe's accuracies amplify the
rest). So each kind of machine has its own recording, and a new one is recorded on a commit whose
runs equal an existing recording on the machine that made it.

The first recordings: the method entries on the code before the engine seams (read-only payload
arrays, uint8 images normalised per batch, batch-loss hooks, the split of ``experiment.py``);
MCGDM's two entries (the full method and its "+ RandAug" row, both with Adam as in
``docs/results/pacs32-mcgdm.md``) on commit 75daa6a, the code that ran the committed PACS MCGDM
jobs, so the later MCGDM switches left their defaults' arithmetic unchanged; ``fedsimclr_probe``
(two repeated linear probes) and ``local`` (several models averaged) on commit af819eb, pinning
the evaluation's probe and multi-model paths. The AVX2 recording: commit d413a36, whose code
passed the exact comparison with the first recordings in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedbed.experiment import ExperimentConfig, run_experiment

RECORDINGS = json.loads((Path(__file__).parent / "recordings" / "bit_identity.json").read_text())["machines"]
ENTRIES = sorted(next(iter(RECORDINGS.values()))["entries"])


# Pinned entries that are not an algorithm with its defaults: (algorithm, hyperparameters, other settings).
VARIANTS = {
    "mcgdm_adam": ("mcgdm", {"client_optimizer": "adam"}, {}),
    "mcgdm_adam_randaug": ("mcgdm", {"client_optimizer": "adam", "use_intra": False, "use_inter": False}, {}),
    "fedsimclr_probe": ("fedsimclr", {"projection_hidden_dim": 64, "projection_dim": 32},
                        {"linear_probe": {"epochs": 5, "repeats": 2}}),
}


@pytest.mark.parametrize("entry", ENTRIES)
def test_short_run_is_bit_identical_to_a_recorded_one(entry, tmp_path):
    algorithm, hp, settings = VARIANTS.get(entry, (entry, {}, {}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the values were recorded with one thread (reductions differ across thread counts)
    try:
        config = ExperimentConfig(algorithm=algorithm, model="lenet", rounds=2, local_steps=3, batch_size=16,
                                  run_dir=tmp_path / "run", seed=0, hp=hp, **settings)
        run_experiment(config, progress=False, echo=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    observed = {
        "train_loss": [line["metrics"]["train_loss"] for line in lines],
        "update_norms": [line["alignment"]["update_norms"] for line in lines],
        "ood_mean": [line["evaluation"]["ood_mean"] for line in lines],
        "id_mean": [line["evaluation"]["id_mean"] for line in lines],
    }
    matching = [machine for machine, recording in RECORDINGS.items() if observed == recording["entries"][entry]]
    assert matching, (
        f"{entry}: the run equals none of the recordings in tests/recordings/bit_identity.json "
        f"(machines: {', '.join(RECORDINGS)}); this machine's torch CPU capability is "
        f"{torch.backends.cpu.get_cpu_capability()}. If the code's arithmetic is meant to be unchanged, check the "
        f"change against a recorded machine; a new kind of machine gets its own recording, made on a commit whose "
        f"runs equal an existing recording.\nobserved: {observed}")
