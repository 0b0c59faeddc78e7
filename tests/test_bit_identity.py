"""The engine's refactorings keep every existing method's numbers bit for bit.

The values below were recorded on the code before the engine seams (read-only payload arrays,
uint8 images normalised per batch, batch-loss hooks, the split of ``experiment.py``) with one
torch thread: a short RotatedMNIST run (the embedded MNIST sample, LeNet, 2 rounds of 3 local
steps of 16 samples, seed 0). A change to the engine that alters any floating-point operation of
these methods changes at least one of these numbers.

MCGDM's two entries (the full method and its "+ RandAug" row, both with Adam as in
``docs/results/pacs32-mcgdm.md``) were recorded on commit 75daa6a, the code that ran the
committed PACS MCGDM jobs: they pin MCGDM's trainer and server on a short run (LeNet, no
MixStyle), so the later MCGDM switches left their defaults' arithmetic unchanged. The
``fedsimclr_probe`` entry (two repeated linear probes) and ``local`` (several models averaged)
were recorded on commit af819eb and pin the evaluation's probe and multi-model paths.
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
 },
 "mcgdm_adam": {
  "train_loss": [
   2.3030042330423988,
   2.302255328496297
  ],
  "update_norms": [
   [
    0.5708867724080722,
    0.567195744572519,
    0.5785189237420656,
    0.5465212353408896,
    0.5740021187328034
   ],
   [
    0.05772583423027446,
    0.05719624836490307,
    0.05751160660084637,
    0.058397454427792574,
    0.058031385601484055
   ]
  ],
  "ood_mean": [
   11.630695443645084,
   11.630695443645084
  ],
  "id_mean": [
   10.419161676646706,
   10.419161676646706
  ]
 },
 "mcgdm_adam_randaug": {
  "train_loss": [
   2.302210474014282,
   2.2968252182006834
  ],
  "update_norms": [
   [
    0.5714825365472795,
    0.5668083859574468,
    0.5782667619931485,
    0.5464443496959414,
    0.572286981095337
   ],
   [
    0.05704479399468277,
    0.05833683712090966,
    0.059151534906605796,
    0.06137764261391736,
    0.05786394998443468
   ]
  ],
  "ood_mean": [
   11.630695443645084,
   11.630695443645084
  ],
  "id_mean": [
   10.419161676646706,
   10.419161676646706
  ]
 },
 "fedsimclr_probe": {
  "train_loss": [
   3.390562629699707,
   3.269693501790365
  ],
  "update_norms": [
   [
    2.5760206154645715,
    2.581312717123871,
    2.5891948699933325,
    2.5836453526044036,
    2.602012535655207
   ],
   [
    2.039633585739308,
    2.0537247019396636,
    2.047714759503001,
    2.0413610294559015,
    2.0354411652165902
   ]
  ],
  "ood_mean": [
   13.866667076945305,
   13.600000366568565
  ],
  "id_mean": [
   10.66666666418314,
   10.333333425223827
  ]
 },
 "local": {
  "train_loss": [
   2.302034870783488,
   2.2937163352966308
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
    0.5553308332047826,
    0.5863069054141836,
    0.5822675953177269,
    0.5845672904199283,
    0.5634742257295395
   ]
  ],
  "ood_mean": [
   12.517985611510792,
   14.86810551558753
  ],
  "id_mean": [
   10.778443113772454,
   19.40119760479042
  ]
 }
}
""")


# Pinned entries that are not an algorithm with its defaults: (algorithm, hyperparameters, other settings).
VARIANTS = {
    "mcgdm_adam": ("mcgdm", {"client_optimizer": "adam"}, {}),
    "mcgdm_adam_randaug": ("mcgdm", {"client_optimizer": "adam", "use_intra": False, "use_inter": False}, {}),
    "fedsimclr_probe": ("fedsimclr", {"projection_hidden_dim": 64, "projection_dim": 32},
                        {"linear_probe": {"epochs": 5, "repeats": 2}}),
}


@pytest.mark.parametrize("entry", sorted(PINNED))
def test_short_run_is_bit_identical_to_the_recorded_one(entry, tmp_path):
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
    assert observed == PINNED[entry]
