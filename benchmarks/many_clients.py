"""Many clients on one machine: time per round and peak memory of a run of 10, 100 and 1,000 clients.

Job: RotatedMNIST (full MNIST with ``--data-root``, else the embedded sample), target 0 degrees,
FedAvg with LeNet, the source domains' training samples split over N clients (``--partition``:
the λ-mix with λ 0, each client one domain's share, or the Dirichlet label split with α 0.5), 10%
of the clients sampled per round (``participation_fraction: 0.1``), ``--rounds`` rounds of
``--local-steps`` batches of 64 per client (a client's work is fixed, so a round's work is that of
its participants), evaluated after the last round only. Also 1,000 clients at 1% (10 per round, as
100 at 10%): what a round costs beyond its participants' work grows with the total if these
differ.

Each configuration runs in its own process (``--one``), so its peak RSS (``getrusage``'s
``ru_maxrss``) is its own; on ``--backend flower-sim`` the Flower processes' memory is summed over
the process tree and sampled every half second. The time per round is the mean over rounds 2..R
of ``rounds.jsonl``'s ``seconds`` less ``evaluation_seconds`` (round 1 warms up), per round and per
participating client. The load average before and after is printed: on a busy machine compare
the ratios, not the times.

    python benchmarks/many_clients.py --data-root ../shared/data [--clients 10 100 1000] [--rounds 4]

``--smoke``: the embedded MNIST sample, 10 and 100 clients, 2 rounds of 1 local batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import parse_arguments

PARTICIPATION = 0.1
"""Share of the clients sampled each round."""
FIXED_PARTICIPANTS = 10
"""The extra configuration's participants per round, out of the most clients."""


def run_one(clients: int, participation: float, args: argparse.Namespace, run_dir: Path) -> dict:
    """Run one configuration in this process and return its figures (peak RSS: this process's)."""
    from fedbed.backends import run_on_backend
    from fedbed.config import ExperimentConfig

    began = time.perf_counter()
    config = ExperimentConfig(dataset="RotatedMNIST", target="0", algorithm="fedavg", model="lenet", rounds=args.rounds,
                              local_steps=args.local_steps, batch_size=64, partition=args.partition,
                              num_clients=clients, participation_fraction=participation, eval_every=args.rounds,
                              data_root=args.data_root, run_dir=run_dir)
    run_on_backend(config, args.backend, progress=False, echo=lambda *_: None)
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    return {"clients": clients, "per_round": len(records[0]["selected"]),
            "round_seconds": statistics.mean(r["seconds"] - r["evaluation_seconds"] for r in timed),
            "wall_seconds": time.perf_counter() - began,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def tree_rss_mib(root: int) -> float:
    """The resident memory of process ``root`` and all its descendants, MiB (Linux's ``/proc``)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / 2**20


def measure(clients: int, participation: float, args: argparse.Namespace, folder: Path) -> dict:
    """Run one configuration in a child process (``--one``) and return its figures; on Flower the
    peak RSS is the process tree's, sampled."""
    command = [sys.executable, __file__, "--one", str(clients), str(participation), "--rounds", str(args.rounds),
               "--local-steps", str(args.local_steps), "--partition", args.partition, "--backend", args.backend,
               "--run-dir", str(folder / f"{clients}-{participation}")]
    if args.data_root is not None:
        command += ["--data-root", str(args.data_root)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak = [0.0]

    def sample() -> None:
        while child.poll() is None:
            peak[0] = max(peak[0], tree_rss_mib(child.pid))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    if args.backend != "in-process":
        sampler.start()
    output, _ = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"{clients} clients: the run exited {child.returncode}")
    figures = json.loads(output.strip().splitlines()[-1])
    if args.backend != "in-process":
        sampler.join()
        figures["peak_rss_mib"] = peak[0]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, default=None, help="holds full MNIST (default: the embedded sample)")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--partition", choices=("lambda_mix", "dirichlet"), default="lambda_mix")
    parser.add_argument("--backend", choices=("in-process", "flower-sim"), default="in-process")
    parser.add_argument("--one", nargs=2, metavar=("CLIENTS", "PARTICIPATION"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parse_arguments(parser, smoke="the embedded MNIST sample", clients=[10, 100], rounds=2, local_steps=1,
                           data_root=None)
    if args.one is not None:  # a child: one configuration, its figures as the last line
        print(json.dumps(run_one(int(args.one[0]), float(args.one[1]), args, args.run_dir)))
        return
    load_before = os.getloadavg()[0]
    args.clients = sorted(set(args.clients))  # the first (fewest clients) is the base of the ratios
    configurations = [(n, PARTICIPATION) for n in args.clients]
    most = max(args.clients)
    if most * PARTICIPATION > FIXED_PARTICIPANTS:
        configurations.append((most, FIXED_PARTICIPANTS / most))
    rows = []
    print(f"{args.backend}, {args.partition}, {args.rounds} rounds of {args.local_steps} local batches of 64; "
          f"load average before: {load_before:.1f} on {os.cpu_count()} cores")
    print("| clients | per round | s per round | s per participant | peak RSS MiB | run wall s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fedbed-many-clients-") as folder:
        for clients, participation in configurations:
            row = measure(clients, participation, args, Path(folder))
            rows.append(row)
            print(f"| {row['clients']} | {row['per_round']} | {row['round_seconds']:.2f} | "
                  f"{row['round_seconds'] / row['per_round']:.3f} | {row['peak_rss_mib']:.0f} | {row['wall_seconds']:.1f} |",
                  flush=True)
    base = rows[0]
    for row in rows[1:]:
        label = f"{row['clients']} clients ({row['per_round']} per round)"
        print(f"{label} / {base['clients']} clients ({base['per_round']} per round): time per round "
              f"{row['round_seconds'] / base['round_seconds']:.2f}, per participant "
              f"{row['round_seconds'] / row['per_round'] / (base['round_seconds'] / base['per_round']):.2f}, "
              f"peak RSS {row['peak_rss_mib'] / base['peak_rss_mib']:.2f}")
    print(f"peak RSS at {most} clients / at {base['clients']}: {rows[len(args.clients) - 1]['peak_rss_mib'] / base['peak_rss_mib']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
