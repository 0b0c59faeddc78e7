"""The same FedAvg jobs in-process, on Flower's simulation engine and on a local Flower deployment
(SuperLink + one SuperNode per client on 127.0.0.1); prints each run's wall time, where its time
went (process start, data build, model build, training, messaging), the ratios flower ÷ in-process,
and a Markdown table ready for docs/results/flower.md with the machine's load average.

Jobs (FedAvg, 1 local epoch per round, batch 64, evaluation every round, seed 0):

- ``RotatedMNIST``: target 0 degrees, LeNet, 5 clients of 2 source domains each (hFedF's
  Algorithm 5); full MNIST under ``--data-root``, else the embedded 5,000-image sample.
- ``PACS-32``: PACS at 32 px (the packed copy under ``--data-root``), hFedF's client CNN
  (``hfedf_cnn``), target art_painting, one client per source domain (3).

Each run is ``fedbed run --backend B`` in its own process, as a user runs it (its wall time
includes starting Python and importing torch; no data is cached between runs), with
``FEDBED_TIMINGS`` naming a file its processes append their timing records to
(:mod:`fedbed.federation.phase_timings`); the phases are sums over processes (processes that
run side by side overlap, so a sum can exceed the wall time):

- process start: the processor time every process that served the run (the launcher, the
  ServerApp's and the ClientApps' processes) spent from its creation until FedBed's code first ran
  in it: the interpreter, imports, Flower's and Ray's own set-up (Linux only);
- data build: reading the dataset, splitting, partitioning, and each client's share;
- model build: the initial model and the clients' trainers;
- training: the clients' local training;
- messaging: on Flower, each message's round trip minus the ClientApp's handling of it (and
  minus the start of a process started for it): transit, queues and polling;
- server evaluation: the server's scoring of the global model (``rounds.jsonl``).

    python benchmarks/flower_vs_inprocess.py [--data-root ../shared/data] [--jobs RotatedMNIST PACS-32]
        [--rounds 5] [--local-steps N] [--backends in-process flower-sim flower-deployment] [--threads N] [--smoke]

``--smoke``: RotatedMNIST on the embedded MNIST sample, 2 clients, one round of two local batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from _common import parse_arguments

from fedbed.backends import BACKENDS
from fedbed.federation.phase_timings import TIMINGS_VARIABLE, read_timings
from fedbed.run_directory import LOG_NAME, SUMMARY_NAME

JOBS: dict[str, dict[str, Any]] = {
    "RotatedMNIST": dict(dataset="RotatedMNIST", model="lenet", target="0", partition="domains_per_client",
                         num_clients=5, domains_per_client=2),
    "PACS-32": dict(dataset="PACS", image_size=32, model="hfedf_cnn", target="art_painting"),
}
"""The benchmark's jobs: their settings besides the method and the budget."""

PHASE_COLUMNS = ("process start", "data build", "model build", "training", "messaging", "server evaluation")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages and the core count, as one phrase."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def split_phases(records: list[dict[str, Any]], run_dir: Path) -> dict[str, tuple[float, int]]:
    """A run's timing records summed per phase: ``{column: (seconds, count)}`` (see the module docstring)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def add(column: str, seconds: float) -> None:
        sums[column][0] += seconds
        sums[column][1] += 1

    started = {r["pid"]: r for r in records if r["phase"] == "process_start"}
    handling = {r["message_id"]: r for r in records if r["phase"] == "handling"}
    for r in records:
        column = {"data": "data build", "model": "model build", "training": "training"}.get(r["phase"])
        if column is not None:
            add(column, r["seconds"])
        if r["phase"] == "process_start":
            add("process start", r["cpu_seconds"])
        if r["phase"] == "exchange" and r["message_id"] in handling:
            handled = handling[r["message_id"]]
            spawned = started.get(handled["pid"])
            spawn = spawned["seconds"] if spawned is not None and spawned["began"] >= r["began"] else 0.0
            add("messaging", max(0.0, r["seconds"] - handled["seconds"] - spawn))
    log = run_dir / LOG_NAME
    for line in log.read_text().splitlines() if log.is_file() else []:
        seconds = json.loads(line).get("evaluation_seconds")
        if seconds is not None:
            add("server evaluation", seconds)
    return {column: (sums[column][0], int(sums[column][1])) for column in PHASE_COLUMNS if column in sums}


def run_once(job: str, backend: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """``fedbed run`` of ``job`` on ``backend`` in its own process; its wall time, summary and phases."""
    settings = {**JOBS[job], "algorithm": "fedavg", "rounds": args.rounds, "seed": 0,
                **({"local_steps": args.local_steps} if args.local_steps else {"local_epochs": 1})}
    if args.smoke:
        settings.update(num_clients=2, domains_per_client=3)
    config, run_dir, timings = folder / f"{job}.yaml", folder / job / backend, folder / f"{job}-{backend}.jsonl"
    config.write_text(yaml.safe_dump(settings))
    command = [sys.executable, "-m", "fedbed", "run", "--config", str(config), "--backend", backend, "--run-dir",
               str(run_dir), "--no-progress", *(["--data-root", str(args.data_root)] if args.data_root else [])]
    environment = {**os.environ, TIMINGS_VARIABLE: str(timings)}
    if args.threads is not None:
        environment["OMP_NUM_THREADS"] = str(args.threads)
    if args.data_root is None:
        environment.pop("FEDBED_DATA", None)  # the embedded sample
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    finished = subprocess.run(command, env=environment, cwd=folder, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if finished.returncode != 0:
        sys.exit(f"{job} on {backend} failed (exit {finished.returncode}):\n{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}")
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    return {"seconds": seconds, "ood": summary["selection"]["last"]["ood_mean"], "load": (load_before, os.getloadavg()[0]),
            "phases": split_phases(read_timings(timings), run_dir)}


def table(results: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The Markdown table of every run: wall time, ratio, phases (seconds, and how many records)."""
    lines = ["| job | backend | wall time | ÷ in-process | " + " | ".join(PHASE_COLUMNS) + " | ood accuracy (`last`) | load (1 min) |",
             "|---|---|---|---|" + "---|" * len(PHASE_COLUMNS) + "---|---|"]
    for (job, backend), result in results.items():
        base = results.get((job, "in-process"))
        ratio = f"{result['seconds'] / base['seconds']:.2f}" if base else "-"
        cells = [f"{result['phases'][c][0]:.1f} s ({result['phases'][c][1]})" if c in result["phases"] else "-"
                 for c in PHASE_COLUMNS]
        lines.append(f"| {job} | {backend} | {result['seconds']:.1f} s | {ratio} | " + " | ".join(cells)
                     + f" | {result['ood']:.2f}% | {result['load'][0]:.2f} → {result['load'][1]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=None, help="full MNIST and the packed PACS (default: the "
                                                                     "embedded MNIST sample, RotatedMNIST only)")
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=None,
                        help="default: both with --data-root, else RotatedMNIST")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=None, help="local batches per round instead of one epoch")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of every run's processes (default: unset, torch's own choice: all cores "
                             "in-process, one per Ray actor, the cores shared among a deployment's sites)")
    args = parse_arguments(parser, smoke="the embedded MNIST sample, 2 clients", rounds=1, local_steps=2, data_root=None,
                           jobs=["RotatedMNIST"])
    jobs = args.jobs or (list(JOBS) if args.data_root else ["RotatedMNIST"])
    if "PACS-32" in jobs and args.data_root is None:
        parser.error("PACS-32 needs --data-root (the folder holding PACS/pacs_32.npz or the PACS tree)")
    import flwr
    import torch

    threads = f"OMP_NUM_THREADS={args.threads}" if args.threads else f"torch's default threads ({torch.get_num_threads()} here)"
    print(f"{platform.node()}: {load_average()} before the runs; flwr {flwr.__version__}, torch {torch.__version__}, "
          f"{threads}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fedbed-flower-benchmark-") as folder:
        for job in jobs:
            for backend in args.backends:
                result = results[job, backend] = run_once(job, backend, args, Path(folder))
                phases = ", ".join(f"{column} {seconds:.1f} s ({count})" for column, (seconds, count) in result["phases"].items())
                print(f"{backend}: {result['seconds']:.1f} s wall, ood accuracy (last) {result['ood']:.2f}% [{job}]; "
                      f"{phases}", flush=True)
            if "in-process" in args.backends:
                for backend in args.backends:
                    if backend != "in-process":
                        print(f"{backend} / in-process: {results[job, backend]['seconds'] / results[job, 'in-process']['seconds']:.2f}")
    print(f"after the runs: {load_average()}")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
