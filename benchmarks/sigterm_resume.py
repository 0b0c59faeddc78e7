"""SIGTERM at a random moment, then ``--resume``: does every process stop, and does the resumed
run end exactly where an uninterrupted one ends?

A short run (FedAvg, LeNet, RotatedMNIST from the embedded MNIST sample, target 0, ``--rounds``
rounds of ``--local-steps`` batches, evaluated every round) is first run twice uninterrupted, in
subprocesses, to record its result (equal both times) and to time it. Then, ``--trials`` times,
the same run starts in a new process group and gets SIGTERM at a moment placed by the run's own
progress, so that wall-clock speed (a busy machine) does not move it: after k logged rounds, k
drawn uniformly from 0..R-1, plus a delay drawn uniformly within about one round (within the
start-up for k = 0: importing, loading data, building), seeded by ``--seed``. A trial passes when

1. the process exits (code 130 "stopped: interrupted"; or, if the run had finished first, 0, 130
   or killed by the signal on its way out, its files complete) and no process of its group is left
   within 10 s, and
2. ``fedbed run ... --resume`` on its run directory (or a fresh start where the signal came before
   the run directory held anything to resume) finishes with ``rounds.jsonl`` and
   ``summary.json``'s per-rule selections equal, value for value, to the uninterrupted run's
   (seconds and provenance left out).

Prints one line per failed trial and, last, the passing fraction (goal: 100/100 in-process).
Flower backends keep client state on their sites and do not resume (README, "Running across
machines"), so the benchmark is in-process only.

    python benchmarks/sigterm_resume.py [--trials 100] [--rounds 6] [--local-steps 4] [--seed 0] [--smoke]

``--smoke``: one trial of a run of two rounds of one batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import parse_arguments
from fedbed.run_directory import LOG_NAME, SUMMARY_NAME

VOLATILE = ("seconds", "evaluation_seconds", "fit_seconds")
"""Keys whose values are wall-clock times, which differ between any two runs."""


def command(run_dir: Path, rounds: int, local_steps: int, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "fedbed", "run", "--model", "lenet", "--target", "0", "--rounds", str(rounds),
            "--local-steps", str(local_steps), "--run-dir", str(run_dir), "--no-progress",
            *(["--resume"] if resume else [])]


def without_times(value):
    """``value`` (parsed JSON) with every wall-clock entry removed, recursively."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in VOLATILE and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def outcome(run_dir: Path) -> tuple[list, dict] | None:
    """What must be equal across runs: the per-round log and the summary's selections (``None``
    if either cannot be read)."""
    try:
        rounds = [without_times(json.loads(line)) for line in (run_dir / LOG_NAME).read_text().splitlines()]
        summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    except (OSError, ValueError, KeyError):
        return None
    return rounds, without_times(summary["selection"])


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def rounds_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / LOG_NAME).read_text().splitlines())
    except OSError:
        return 0


def trial(run_dir: Path, moment: tuple[int, float], arguments: argparse.Namespace,
          environment: dict[str, str]) -> tuple[str, str | None]:
    """One SIGTERM and resume: ``(what the signal met, None if the trial passed else why not)``;
    the signal is sent ``moment[1]`` seconds after the run has logged ``moment[0]`` rounds (from
    its start when 0), and met ``start-up`` (nothing to resume yet), ``a round`` (resumed from a
    checkpoint) or ``the end`` (the run had finished)."""
    job = subprocess.Popen(command(run_dir, arguments.rounds, arguments.local_steps), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=environment, start_new_session=True)
    rounds, delay = moment
    while rounds_logged(run_dir) < rounds and job.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    os.killpg(job.pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    deadline = time.monotonic() + 10
    while group_alive(job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_alive(job.pid):
        os.killpg(job.pid, signal.SIGKILL)
        return "?", f"a process of the run outlived SIGTERM by 10 s (exit code {job.returncode})"
    # A signal that meets a finished run on its way out (printing, or exiting) leaves its files complete.
    finished_first = job.returncode in (0, 130, -signal.SIGTERM) and (run_dir / SUMMARY_NAME).exists()
    if not (finished_first or job.returncode == 130) or "Traceback" in output:
        return "?", f"exit code {job.returncode}: {output.strip().splitlines()[-1:]}"
    met = "the end"
    if not finished_first:
        resume = run_dir.exists() and any(run_dir.iterdir())
        met = "a round" if resume else "start-up"
        finished = subprocess.run(command(run_dir, arguments.rounds, arguments.local_steps, resume=resume),
                                  capture_output=True, text=True, env=environment, timeout=600)
        if finished.returncode != 0:
            return met, f"--resume failed ({finished.returncode}): {finished.stderr.strip().splitlines()[-1:]}"
    return met, None if outcome(run_dir) == arguments.expected else "the resumed run differs from the uninterrupted one"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parse_arguments(parser, trials=1, rounds=2, local_steps=1)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    draw = random.Random(arguments.seed)
    with tempfile.TemporaryDirectory(prefix="fedbed-sigterm-") as folder:
        started = time.monotonic()
        for number in range(2):
            reference = Path(folder) / f"uninterrupted-{number}"
            subprocess.run(command(reference, arguments.rounds, arguments.local_steps), check=True, capture_output=True,
                           env=environment)
            if number and outcome(reference) != arguments.expected:
                raise SystemExit("two uninterrupted runs differ: the run is not deterministic, nothing to compare")
            arguments.expected = outcome(reference)
        startup = (time.monotonic() - started) / 2 / 2  # about half of a run is the process's start-up
        round_time = max(0.05, startup / arguments.rounds)
        print(f"uninterrupted run: about {2 * startup:.1f} s; SIGTERM after 0..{arguments.rounds - 1} logged rounds "
              f"and 0..{round_time:.2f} s (0..{startup:.1f} s from the start for 0 rounds)")
        passed, met = 0, {}
        for number in range(arguments.trials):
            rounds = draw.randrange(arguments.rounds)
            moment = (rounds, draw.uniform(0.0, startup if rounds == 0 else round_time))
            what, failure = trial(Path(folder) / f"trial-{number}", moment, arguments, environment)
            met[what] = met.get(what, 0) + 1
            if failure is None:
                passed += 1
            else:
                print(f"trial {number} (SIGTERM {moment[1]:.2f} s after {rounds} rounds): {failure}")
        print("the signal met: " + ", ".join(f"{moment} {count}" for moment, count in sorted(met.items())))
        print(f"SIGTERM then --resume, in-process: {passed}/{arguments.trials} trials left no process and resumed to "
              "the uninterrupted run's result exactly")


if __name__ == "__main__":
    main()
