"""hFedF's server cost: the hypernetwork step time as a fraction of the round time (goal <= 10%).

Runs hFedF on PACS at 32 px with hFedF's client CNN (one client per source domain, target
photo) for a few rounds and reads the per-round telemetry: ``server_seconds`` (generating each
client's φ_i, the vector-Jacobian products, GradAlign, Adam and EMA) and the round's wall time
without evaluation (``seconds - evaluation_seconds``); also the bytes sent to and
received from each client per round. Prints the fraction last.

    python benchmarks/hfedf_server_cost.py --data-root ../shared/data [--rounds 3] [--local-epochs 2] [--smoke]

``--smoke``: one round of one local epoch on a tiny synthetic PACS (``_common.smoke_data``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import parse_arguments, smoke_data
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.run_directory import LOG_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=None, help="holds PACS (default: $FEDBED_DATA)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=2)
    args = parse_arguments(parser, smoke="a tiny synthetic PACS", rounds=1, local_epochs=1)
    with smoke_data(args.smoke, args.data_root) as data_root, tempfile.TemporaryDirectory() as run_dir:
        config = ExperimentConfig(
            dataset="PACS", image_size=32, model="hfedf_cnn", algorithm="hfedf", target="photo",
            rounds=args.rounds, local_epochs=args.local_epochs, holdout_fraction=0.1, data_root=data_root,
            eval_every=args.rounds, run_dir=Path(run_dir),
        )
        run_experiment(config, progress=False, echo=lambda *_: None)
        records = [json.loads(line) for line in (Path(run_dir) / LOG_NAME).read_text().splitlines()]
    server = sum(r["telemetry"]["server_seconds"] for r in records)
    total = sum(r["seconds"] - r["evaluation_seconds"] for r in records)
    for r in records:
        telemetry = r["telemetry"]
        print(f"round {r['round']}: round {r['seconds'] - r['evaluation_seconds']:.1f} s without evaluation, server step {telemetry['server_seconds']:.2f} s, "
              f"MB sent per client {max(telemetry['bytes_sent'].values()) / 1e6:.2f}, "
              f"MB received per client {max(telemetry['bytes_received'].values()) / 1e6:.2f}")
    print(f"server step time / round time: {server / total:.3f}")


if __name__ == "__main__":
    main()
