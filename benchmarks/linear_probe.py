"""The linear probe of a finished run's encoder, or of its untrained encoder (the floor a
self-supervised method must beat), at any labelled share and number of probe seeds.

Rebuilds the run a finished run folder describes (its ``config.yaml``: same data, split, seed and
model) and scores either the global model of its checkpoint (its last round: the ``last``
selection) or the seeded initial model its training started from, with the linear probe
(``fedbed.federation.linear_probe``; the run's settings unless changed here) on each source
domain's id holdout and on the target domain. **On the target this reads target labels** (the
labelled share trains the probe): FedGaLA's evaluation protocol (``fedgala.md`` Sec. 4). Prints one
line per domain, the target's last: the mean ± std over the probe seeds (``repeats``); then the
scale of the target's features (median over dimensions of their standard deviation) and their
effective rank (Roy and Vetterli 2007: exp of the entropy of the normalised squared singular
values of the centred features; the feature width if every direction carries equal variance).

    python benchmarks/linear_probe.py RUN_DIR [--encoder trained|untrained]
        [--labelled-fraction 0.3] [--repeats 5] [--standardize-features] [--data-root DATA]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from fedbed.experiment import restore_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished run folder (its config.yaml and checkpoint.pt are read)")
    parser.add_argument("--encoder", choices=("trained", "untrained"), default="trained",
                        help="the checkpoint's global model (last round) or the seeded initial model")
    parser.add_argument("--labelled-fraction", type=float, default=None,
                        help="share of each domain whose labels train the probe (default: the run's; FedGaLA: 0.1, 0.3)")
    parser.add_argument("--repeats", type=int, default=None, help="probe seeds (default: the run's)")
    parser.add_argument("--standardize-features", action="store_true",
                        help="z-score the features with the labelled share's statistics (LinearProbe.standardize_features)")
    parser.add_argument("--data-root", type=Path, default=None, help="the data root the run read (default: $FEDBED_DATA)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    probe_changes = {key: value for key, value in (("labelled_fraction", arguments.labelled_fraction),
                                                   ("repeats", arguments.repeats),
                                                   ("standardize_features", arguments.standardize_features or None))
                     if value is not None}
    built, trained, _ = restore_run(arguments.run_dir, arguments.data_root)
    if built.probe is None:
        raise SystemExit(f"{arguments.run_dir} is not scored by the linear probe; nothing to compare")
    probe = built.probe.model_copy(update=probe_changes)
    model = trained if arguments.encoder == "trained" else built.initial_model
    federation = built.federation(clients=None)
    names, classes, seed = built.dataset.domain_names, built.dataset.num_classes, built.config.seed
    print(f"{arguments.encoder} encoder of {arguments.run_dir}, linear probe: {probe.labelled_fraction:.0%} labelled, "
          f"{probe.repeats} probe seed(s), {probe.epochs} epochs, "
          f"{'standardized' if probe.standardize_features else 'raw'} features")
    for kind, domains in (("id", federation.holdout), ("target (reads target labels)", federation.target)):
        for domain, data in domains.items():
            scores = probe.scores(model, data, classes, seed, domain)
            spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
            print(f"{kind} {names[domain]}: {statistics.mean(scores):.1f} ± {spread:.1f}")
    for domain, data in federation.target.items():
        features = data.outputs_of(model.featurizer)
        print(f"target {names[domain]} features: median per-dimension std {features.std(dim=0).median():.3g}, "
              f"effective rank {effective_rank(features):.1f} of {features.shape[1]}")


def effective_rank(features: torch.Tensor) -> float:
    """Roy and Vetterli's effective rank of ``features`` ``[n, d]`` (centred): in [1, min(n, d)]."""
    squared = torch.linalg.svdvals(features - features.mean(dim=0)) ** 2
    shares = squared / squared.sum()
    return float(torch.exp(-(shares * shares.clamp_min(1e-12).log()).sum()))


if __name__ == "__main__":
    main()
