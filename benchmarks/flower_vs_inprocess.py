"""The same FedAvg job in-process, on Flower's simulation engine and on a local Flower
deployment (SuperLink + one SuperNode per client on 127.0.0.1); prints each wall time and the
ratios flower ÷ in-process last.

Job: RotatedMNIST (the embedded MNIST sample unless ``--data-root`` points at full MNIST),
target 0 degrees, 3 clients (2 source domains each, hFedF's Algorithm 5), 3 rounds of 1 local
epoch, batch 64, evaluation every round.

    python benchmarks/flower_vs_inprocess.py [--data-root ../shared/data] [--rounds 3] [--smoke]

``--smoke``: one round of two local batches, on the embedded MNIST sample, evaluated once.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import parse_arguments
from fedbed.experiment import ExperimentConfig
from fedbed.backends import BACKENDS, run_on_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=None, help="local batches per round instead of one epoch")
    args = parse_arguments(parser, smoke="the embedded MNIST sample", rounds=1, local_steps=2, data_root=None)
    seconds: dict[str, float] = {}
    ood: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for backend in BACKENDS:
            config = ExperimentConfig(
                dataset="RotatedMNIST", target="0", algorithm="fedavg", rounds=args.rounds,
                local_epochs=None if args.local_steps else 1, local_steps=args.local_steps,
                partition="domains_per_client", num_clients=3, domains_per_client=2, data_root=args.data_root,
                run_dir=Path(folder) / backend,
            )
            began = time.perf_counter()
            summary = run_on_backend(config, backend, progress=False, echo=lambda *_: None)
            seconds[backend] = time.perf_counter() - began
            ood[backend] = summary["selection"]["last"]["ood_mean"]
            print(f"{backend}: {seconds[backend]:.1f} s wall, ood accuracy (last) {ood[backend]:.2f}%")
    for backend in BACKENDS[1:]:
        print(f"{backend} / in-process: {seconds[backend] / seconds['in-process']:.2f}")


if __name__ == "__main__":
    main()
