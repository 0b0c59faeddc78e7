"""The engine's refactorings keep every existing method's numbers bit for bit.

The values below were recorded on the code before the engine seams (read-only payload arrays,
uint8 images normalised per batch, batch-loss hooks, the split of ``experiment.py``) with one
torch thread: a short RotatedMNIST run (the embedded MNIST sample, LeNet, 2 rounds of 3 local
steps of 16 samples, seed 0). A change to the engine that alters any floating-point operation of
these methods changes at least one of these numbers.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedbed.experiment import ExperimentConfig, run_experiment

PINNED = json.loads(r"""
{
 "fedavg": {
  "train_loss": [
   2.302034870783488,
   2.2945868810017904
  ],
  "update_norms": [
   [
    0.5632837038668965,
    0.5533327543253639,
    0.5785809978018666,
    0.5489225593096223,
    0.57628493415555
   ],
   [
    0.551466636318957,
    0.5743417104295742,
    0.5679715069872313,
    0.5812626937196218,
    0.5617738368392565
   ]
  ],
  "ood_mean": [
   11.630695443645084,
   11.630695443645084
  ],
  "id_mean": [
   10.419161676646706,
   12.095808383233534
  ]
 },
 "fedprox": {
  "train_loss": [
   2.3023242950439453,
   2.2949111302693685
  ],
  "update_norms": [
   [
    0.40710838873793975,
    0.39230866839174544,
    0.41032411323497947,
    0.37696047441638647,
    0.4230398611069856
   ],
   [
    0.38379752862235056,
    0.41487443560760023,
    0.41867856863050057,
    0.45099235811739413,
    0.4123238892332363
   ]
  ],
  "ood_mean": [
   11.630695443645084,
   11.270983213429256
  ],
  "id_mean": [
   10.419161676646706,
   11.736526946107784
  ]
 },
 "fedsr": {
  "train_loss": [
   2.978122584025065,
   3.045978848139445
  ],
  "update_norms": [
   [
    0.6168249497132767,
    0.6083363616410089,
    0.6368333068066789,
    0.6170517973781465,
    0.6303488017924959
   ],
   [
    0.6050316953495245,
    0.6202865912669998,
    0.6310071457966844,
    0.6378725876768743,
    0.6396659407039215
   ]
  ],
  "ood_mean": [
   9.712230215827338,
   8.752997601918466
  ],
  "id_mean": [
   9.580838323353294,
   11.257485029940119
  ]
 },
 "hfedf": {
  "train_loss": [
   2.3356005986531576,
   2.280634593963623
  ],
  "update_norms": [
   [
    0.6221637152247326,
    0.5830755396617194,
    0.6074564160188736,
    0.5845273838866476,
    0.6053906778493852
   ],
   [
    0.6225210942137757,
    0.613851212071056,
    0.615317288668263,
    0.6454311544230968,
    0.6156207386563574
   ]
  ],
  "ood_mean": [
   9.61630695443645,
   17.62589928057554
  ],
  "id_mean": [
   8.502994011976048,
   23.353293413173652
  ]
 }
}
""")


@pytest.mark.parametrize("algorithm", sorted(PINNED))
def test_short_run_is_bit_identical_to_the_recorded_one(algorithm, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the values were recorded with one thread (reductions differ across thread counts)
    try:
        config = ExperimentConfig(algorithm=algorithm, model="lenet", rounds=2, local_steps=3, batch_size=16,
                                  run_dir=tmp_path / "run", seed=0)
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
    assert observed == PINNED[algorithm]
