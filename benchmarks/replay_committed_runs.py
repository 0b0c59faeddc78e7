"""Replay the first rounds of committed sweep jobs and compare them with their records.

What it checks: that the code in this checkout still computes what the committed sweeps
recorded (issue 33: a refactor must leave every method's results unchanged, "every committed
sweep's first two rounds re-run equal to their records on the machine kind that made them, or
to the tolerance the trust issue sets"). For each committed sweep folder under
``results/sweeps/`` (a folder with ``sweep.yaml``; its jobs are the subfolders whose
``rounds.jsonl`` git tracks and that hold ``done`` and ``config.yaml``), the jobs are grouped by
method configuration (the job's ``config.yaml`` without its target, seed and placement settings:
the algorithm, its hyperparameters and whatever else the sweep's variants change), and the
cheapest job of each configuration (least recorded time for the compared rounds) is a candidate;
at most ``--per-sweep`` configurations a sweep are replayed, one algorithm after another (first
the algorithms replayed least in the sweeps before, then the one the sweep is named after, then
the rarer ones: :func:`select`). A
job is re-run from its ``config.yaml`` in a temporary folder (same seed, data, hyperparameters,
on one torch thread as every committed job ran) and its first ``--rounds`` lines of
``rounds.jsonl`` are compared with the committed ones:

- ``metrics`` (``train_loss`` and every other number there): relative deviation at most 2e-5;
- ``alignment.update_norms`` (every client's update norm): relative deviation at most 5e-3;
- ``evaluation`` accuracies (``id`` per domain, ``ood`` per domain, ``id_mean``, ``ood_mean``):
  at most 1 point apart (absolute), and evaluated in the same rounds;
- ``selected`` and ``dropped``: equal;
- the data read: the replay's data fingerprint equals the committed summary's.

The tolerances are those of the trust issue's cross-machine test, ``tests/test_bit_identity.py``
(``TOLERANCES["supervised"]``; the recordings of ``tests/recordings/bit_identity.json`` show at
most 2.1e-6 relative in a loss, 6.9e-4 in an update norm and 0.12 points in an accuracy across
the CPU kinds seen so far). A relative deviation is ``|replayed - recorded| / |recorded|`` (a
recorded 0 must be met within 1e-12, as ``pytest.approx`` does); two NaNs agree. On the machine
kind that made a job (its ``provenance.jsonl``'s ``torch_cpu_capability``, printed beside this
machine's) the deviations are expected to be 0, but for the update norms of jobs recorded before
2026-11-27, which the engine then computed from the stacked updates and now from their Gram
matrix (the last bits differ).

How a job is replayed (printed per job): the engine hands every client the run's total number
of rounds (``payload.config["rounds"]``), which the cosine learning-rate schedule reads
(``client_lr_schedule: cosine``: MCGDM's default), and evaluates the last round whatever
``eval_every`` says. A job whose first rounds read the total that way is run with its recorded
``rounds`` and stopped once its compared rounds are logged ("stopped after 2 of 40 rounds"); any
other job is run with ``rounds`` set to the compared number ("rounds=2"). ``--way`` forces one.

Cost: each job's estimate is the recorded seconds of its compared rounds (``seconds`` of its
``rounds.jsonl`` lines, evaluation included) plus the time to build the run; ``--estimate``
prints the selection and the estimates without running anything. The default replay (17 sweeps,
one job each, 2 rounds; 7 of them stopped after 2 rounds) was estimated at 1,177 s (20 min) on one
core, 2,200 s with ``--per-sweep 2`` and 7,694 s (2.1 h) for all 97 configurations
(2026-11-26). Replayed on two cores shared with other jobs (load average 8), the
rmnist-fedavg job took 59.6 s against its 30 s estimate: expect two to four times the estimate
on a busy machine.

Commands (from the repository root)::

    python benchmarks/replay_committed_runs.py                      # every committed sweep, 1 job each, 2 rounds
    python benchmarks/replay_committed_runs.py --sweeps rmnist-fedavg --per-sweep 1
    python benchmarks/replay_committed_runs.py --per-sweep 0 --estimate   # every configuration, cost only
    python benchmarks/replay_committed_runs.py --smoke

It exits 1 if any job fails. ``--smoke`` replays, in place of a committed job, a two-round job made
from the embedded MNIST sample (cosine schedule, so it is stopped after 1 of its 2 rounds) and
compares it with its own record: it checks that the script works, in seconds and without the
real data.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common
import yaml

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "results" / "sweeps"

LOSS_RTOL = 2e-5
"""Relative tolerance of ``metrics`` (the training losses): tests/test_bit_identity.py."""
NORM_RTOL = 5e-3
"""Relative tolerance of ``alignment.update_norms``: tests/test_bit_identity.py."""
ACCURACY_ATOL = 1.0
"""Absolute tolerance of accuracies, in points: tests/test_bit_identity.py."""
ZERO_ATOL = 1e-12
"""How close a number must come to a recorded 0 (``pytest.approx``'s absolute default)."""

PER_JOB = {"target", "seed", "run_dir", "data_root", "id_evaluation"}
"""Settings left out of a method configuration: per job (target, seed, folder) or placement."""

SETUP_SECONDS = {"RotatedMNIST": 15.0, "PACS": 20.0}
"""A rough time to import, load the data and build a run, for the estimates (this machine,
2026-11-26, two busy cores: RotatedMNIST's packed npz loads in 8-17 s after a 3-9 s import)."""


class StopReplay(Exception):
    """Raised into the engine when a replay has logged the rounds it compares."""


@dataclass
class Job:
    sweep: str
    folder: Path
    config: dict[str, Any]
    lines: list[dict[str, Any]]

    @property
    def method_key(self) -> str:
        return json.dumps({k: v for k, v in self.config.items() if k not in PER_JOB}, sort_keys=True, default=str)

    def recorded_seconds(self, rounds: int) -> float:
        return sum(float(line.get("seconds") or 0.0) for line in self.lines[:rounds])

    def estimate(self, rounds: int) -> float:
        return self.recorded_seconds(rounds) + SETUP_SECONDS.get(self.config.get("dataset"), 20.0)

    def made_on(self) -> str:
        path = self.folder / "provenance.jsonl"
        starts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        kinds = sorted({str(start.get("torch_cpu_capability") or "unrecorded") for start in starts})
        return "/".join(kinds) or "unrecorded"


def tracked_rounds_logs(root: Path) -> set[Path] | None:
    """The ``rounds.jsonl`` files under ``root`` that git tracks (``None``: not a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", str(root)], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {(ROOT / name).resolve() for name in listed.split("\0") if name.endswith("rounds.jsonl")}


def sweep_jobs(root: Path, names: list[str] | None, committed_only: bool) -> dict[str, list[Job]]:
    """The finished jobs of every sweep folder under ``root`` (or of ``names``), committed ones only
    when ``committed_only`` (and git answers)."""
    tracked = tracked_rounds_logs(root) if committed_only else None
    folders = sorted(path.parent for path in root.glob("*/sweep.yaml"))
    if names:
        unknown = set(names) - {folder.name for folder in folders}
        if unknown:
            raise SystemExit(f"no sweep folder {', '.join(sorted(unknown))} under {root}; "
                             f"there are: {', '.join(folder.name for folder in folders)}")
        folders = [folder for folder in folders if folder.name in names]
    found: dict[str, list[Job]] = {}
    for sweep in folders:
        jobs = []
        for folder in sorted(path for path in sweep.iterdir() if path.is_dir()):
            log = folder / "rounds.jsonl"
            if not ((folder / "done").exists() and (folder / "config.yaml").exists() and log.exists()):
                continue
            if tracked is not None and log.resolve() not in tracked:
                continue
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            jobs.append(Job(sweep.name, folder, yaml.safe_load((folder / "config.yaml").read_text()), lines))
        found[sweep.name] = jobs
    return found


def select(sweep: str, jobs: list[Job], per_sweep: int, rounds: int, chosen_before: dict[str, int],
           sweeps_with: dict[str, int]) -> tuple[list[Job], int]:
    """The jobs to replay of one sweep, and its number of method configurations: the cheapest job
    (least recorded time for ``rounds`` rounds) of each configuration; configurations taken one
    algorithm after another, at most ``per_sweep`` of them (0: all). Algorithms come in this
    order: the ones replayed least so far (``chosen_before``, updated), the one the sweep is named
    after, the ones fewest sweeps hold (``sweeps_with``), the one with most jobs here, by name;
    within an algorithm, the cheapest configuration first."""
    groups: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[job.method_key].append(job)
    cheapest = [min(group, key=lambda job: (job.recorded_seconds(rounds), job.folder.name)) for group in groups.values()]
    by_algorithm: dict[str, list[Job]] = defaultdict(list)
    for job in sorted(cheapest, key=lambda job: (job.recorded_seconds(rounds), job.folder.name)):
        by_algorithm[str(job.config.get("algorithm"))].append(job)
    jobs_of = defaultdict(int)
    for job in jobs:
        jobs_of[str(job.config.get("algorithm"))] += 1
    order = sorted(by_algorithm, key=lambda name: (chosen_before.get(name, 0), name not in sweep.split("-"),
                                                   sweeps_with.get(name, 0), -jobs_of[name], name))
    ordered = []
    queues = [by_algorithm[name] for name in order]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    picked = ordered[:per_sweep] if per_sweep > 0 else ordered
    for job in picked:
        chosen_before[str(job.config.get("algorithm"))] = chosen_before.get(str(job.config.get("algorithm")), 0) + 1
    return picked, len(groups)


def evaluated(round_number: int, eval_every: int, rounds: int) -> bool:
    """Whether the engine evaluates round ``round_number`` of ``rounds`` (``run_rounds``)."""
    return bool(eval_every) and (round_number % eval_every == 0 or round_number == rounds)


def reads_total_rounds(config: dict[str, Any], rounds: int) -> list[str]:
    """What in a job's first ``rounds`` rounds depends on its total number of rounds."""
    reasons = [f"hp.{key}: {value}" for key, value in (config.get("hp") or {}).items()
               if key.endswith("schedule") and value not in (None, "constant")]
    total, every = int(config["rounds"]), int(config.get("eval_every", 1) or 0)
    if any(evaluated(r, every, total) != evaluated(r, every, rounds) for r in range(1, rounds + 1)):
        reasons.append(f"eval_every: {every}")
    return reasons


def way_of(job: Job, rounds: int, way: str) -> str:
    """How ``job`` is replayed for ``rounds`` rounds under ``--way way``, as printed."""
    reasons = reads_total_rounds(job.config, rounds)
    total = int(job.config["rounds"])
    if way == "stop" or (way == "auto" and reasons):
        return f"stopped after {rounds} of {total} rounds" + (f" ({', '.join(reasons)} read the total)" if reasons else "")
    return f"rounds={rounds}" + (f" (recorded {total}; note {', '.join(reasons)})" if reasons else "")


@contextmanager
def stopping_after(rounds: int | None) -> Iterator[None]:
    """Within the block, an in-process run stops (:class:`StopReplay`) when round ``rounds + 1``
    would start training, after round ``rounds`` is logged and checkpointed; ``None``: no stop."""
    if rounds is None:
        yield
        return
    from fedbed.federation.transport import InProcessClients

    original = InProcessClients.fit_round

    def fit_round(self, payloads):
        if any(int(payload.config.get("round", 0)) > rounds for payload in payloads.values()):
            raise StopReplay
        return original(self, payloads)

    InProcessClients.fit_round = fit_round
    try:
        yield
    finally:
        InProcessClients.fit_round = original


def replay(job: Job, rounds: int, way: str, data_root: str | None, folder: Path) -> tuple[list[dict[str, Any]], str, str]:
    """Re-run ``job`` in ``folder`` for its first ``rounds`` rounds; its log lines, how it was
    replayed and the data fingerprint it read."""
    import torch

    from fedbed.experiment import config_from_mapping, run_experiment

    values = dict(job.config)
    how = way_of(job, rounds, way)
    stop = how.startswith("stopped")
    if not stop:
        values["rounds"] = rounds
    values["run_dir"] = str(folder / "run")
    root = data_root if data_root is not None else values.get("data_root")
    if root is not None and not Path(root).expanduser().is_absolute():
        root = str(ROOT / root)  # a committed config names its data root relative to the repository root
    values["data_root"] = root
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with stopping_after(rounds if stop else None):
            try:
                run_experiment(config_from_mapping(values), progress=False, echo=lambda *_: None)
            except StopReplay:
                pass
    finally:
        torch.set_num_threads(threads)
    run = folder / "run"
    lines = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]
    starts = [json.loads(line) for line in (run / "provenance.jsonl").read_text().splitlines() if line.strip()]
    return lines, how, str(starts[0].get("data_fingerprint")) if starts else "unrecorded"


def numbers(value: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a nested JSON value by its dotted path."""
    if isinstance(value, dict):
        return {key: leaf for k, v in value.items() for key, leaf in numbers(v, f"{path}.{k}" if path else str(k)).items()}
    if isinstance(value, list):
        return {key: leaf for i, v in enumerate(value) for key, leaf in numbers(v, f"{path}[{i}]").items()}
    return {path: value}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def deviation(mine: Any, theirs: Any, relative: bool) -> float:
    """How far ``mine`` is from the recorded ``theirs``: relative (a recorded 0: 0 within
    :data:`ZERO_ATOL`, else infinite) or absolute; 0 for two NaNs, infinite for one."""
    mine, theirs = float(mine), float(theirs)
    if math.isnan(mine) or math.isnan(theirs):
        return 0.0 if math.isnan(mine) and math.isnan(theirs) else math.inf
    if mine == theirs:
        return 0.0
    gap = abs(mine - theirs)
    if not relative:
        return gap
    if theirs == 0:
        return 0.0 if gap <= ZERO_ATOL else math.inf
    return gap / abs(theirs)


@dataclass
class Comparison:
    loss: float = 0.0
    metrics: float = 0.0
    norms: float = 0.0
    accuracy: float = 0.0
    problems: list[str] = field(default_factory=list)

    def passed(self) -> bool:
        return (not self.problems and self.loss <= LOSS_RTOL and self.metrics <= LOSS_RTOL
                and self.norms <= NORM_RTOL and self.accuracy <= ACCURACY_ATOL)


def compare(replayed: list[dict[str, Any]], recorded: list[dict[str, Any]], rounds: int, forced_last: bool) -> Comparison:
    """The largest deviations of ``replayed``'s first ``rounds`` lines from ``recorded``'s, and what
    else differs. ``forced_last``: the replay ran ``rounds`` rounds in all, so its last round is
    evaluated whether or not the recorded run evaluated it."""
    result = Comparison()
    if len(replayed) < rounds or len(recorded) < rounds:
        result.problems.append(f"{len(replayed)} replayed and {len(recorded)} recorded rounds, {rounds} compared")
    for number, (mine, theirs) in enumerate(zip(replayed[:rounds], recorded[:rounds]), start=1):
        for key in ("selected", "dropped"):
            if mine.get(key) != theirs.get(key):
                result.problems.append(f"round {number} {key}: replayed {mine.get(key)}, recorded {theirs.get(key)}")
        my_metrics, their_metrics = numbers(mine.get("metrics") or {}), numbers(theirs.get("metrics") or {})
        for key, value in their_metrics.items():
            if key not in my_metrics:
                result.problems.append(f"round {number} metrics.{key}: recorded, not replayed")
            elif is_number(value) and is_number(my_metrics[key]):
                gap = deviation(my_metrics[key], value, relative=True)
                if key == "train_loss":
                    result.loss = max(result.loss, gap)
                else:
                    result.metrics = max(result.metrics, gap)
            elif my_metrics[key] != value:
                result.problems.append(f"round {number} metrics.{key}: replayed {my_metrics[key]!r}, recorded {value!r}")
        my_norms = ((mine.get("alignment") or {}).get("update_norms")) or []
        their_norms = ((theirs.get("alignment") or {}).get("update_norms")) or []
        if len(my_norms) != len(their_norms):
            result.problems.append(f"round {number}: {len(my_norms)} update norms replayed, {len(their_norms)} recorded")
        for a, b in zip(my_norms, their_norms):
            result.norms = max(result.norms, deviation(a, b, relative=True))
        my_eval, their_eval = mine.get("evaluation"), theirs.get("evaluation")
        if their_eval is None:
            if my_eval is not None and not (forced_last and number == rounds):
                result.problems.append(f"round {number}: evaluated in the replay, not in the record")
            continue
        if my_eval is None:
            result.problems.append(f"round {number}: evaluated in the record, not in the replay")
            continue
        for key in ("id", "ood", "id_mean", "ood_mean"):
            mine_scores, their_scores = numbers(my_eval.get(key), key), numbers(their_eval.get(key), key)
            if set(mine_scores) != set(their_scores):
                result.problems.append(f"round {number} evaluation.{key}: domains {sorted(mine_scores)} replayed, "
                                       f"{sorted(their_scores)} recorded")
                continue
            for name, value in their_scores.items():
                if value is None or mine_scores[name] is None:
                    if value != mine_scores[name]:
                        result.problems.append(f"round {number} evaluation.{name}: {mine_scores[name]} replayed, {value} recorded")
                    continue
                result.accuracy = max(result.accuracy, deviation(mine_scores[name], value, relative=False))
    return result


def smoke_sweeps(folder: Path) -> Path:
    """A sweeps folder holding one finished job made from the embedded MNIST sample (LeNet, 2
    rounds of 3 local steps of 16 samples, seed 0, cosine learning rate), as a committed one."""
    import torch

    from fedbed.experiment import ExperimentConfig, run_experiment

    run_dir = folder / "smoke-sample" / "job"
    run_dir.parent.mkdir(parents=True)
    (run_dir.parent / "sweep.yaml").write_text("name: smoke-sample\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(ExperimentConfig(algorithm="fedavg", model="lenet", rounds=2, local_steps=3, batch_size=16, seed=0,
                                        run_dir=run_dir, hp={"client_lr_schedule": "cosine"}),
                       progress=False, echo=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    (run_dir / "done").write_text("")
    return folder


def main(arguments: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", nargs="+", default=None, help="sweep folders to replay (default: every one)")
    parser.add_argument("--per-sweep", type=int, default=1,
                        help="method configurations replayed per sweep, one job each (0: every configuration)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds compared per job")
    parser.add_argument("--way", choices=("auto", "rounds", "stop"), default="auto",
                        help="rounds: run with rounds set to --rounds; stop: run the recorded rounds and stop after "
                             "--rounds; auto: stop where the first rounds read the total, else rounds")
    parser.add_argument("--data-root", default=None, help="where the data is (default: each job's recorded data root)")
    parser.add_argument("--estimate", action="store_true", help="print the selection and its estimated cost, run nothing")
    parsed = _common.parse_arguments(parser, arguments,
                                     smoke="a 2-round job made from the embedded MNIST sample, stopped after 1 round "
                                           "and compared with its own record", rounds=1, per_sweep=1, sweeps=None)
    if parsed.rounds < 1:
        parser.error("--rounds must be at least 1")
    import torch

    here = torch.backends.cpu.get_cpu_capability()
    with tempfile.TemporaryDirectory(prefix="fedbed-replay-") as scratch:
        root = smoke_sweeps(Path(scratch) / "sweeps") if parsed.smoke else SWEEPS
        found = sweep_jobs(root, parsed.sweeps, committed_only=not parsed.smoke)
        print(f"replaying the first {parsed.rounds} round(s) of committed jobs, at most {parsed.per_sweep or 'every'} "
              f"method configuration(s) per sweep; tolerances (tests/test_bit_identity.py): metrics rtol {LOSS_RTOL:g}, "
              f"update norms rtol {NORM_RTOL:g}, accuracies {ACCURACY_ATOL:g} point; this machine: {here}, 1 torch thread",
              flush=True)
        selection: list[Job] = []
        chosen_before: dict[str, int] = {}
        sweeps_with: dict[str, int] = defaultdict(int)
        for jobs in found.values():
            for algorithm in {str(job.config.get("algorithm")) for job in jobs}:
                sweeps_with[algorithm] += 1
        for sweep, jobs in found.items():
            chosen, configurations = select(sweep, jobs, parsed.per_sweep, parsed.rounds, chosen_before, sweeps_with)
            print(f"{sweep}: {len(jobs)} jobs, {configurations} method configurations, {len(chosen)} replayed", flush=True)
            selection.extend(chosen)
        estimate = sum(job.estimate(parsed.rounds) for job in selection)
        if parsed.estimate:
            for job in selection:
                print(f"  {job.sweep}/{job.folder.name} {job.config.get('algorithm')} target {job.config.get('target')} "
                      f"seed {job.config.get('seed')} [{way_of(job, parsed.rounds, parsed.way)}]: recorded "
                      f"{job.recorded_seconds(parsed.rounds):.1f} s for "
                      f"{parsed.rounds} round(s), estimated {job.estimate(parsed.rounds):.0f} s")
            print(f"estimated cost: {len(selection)} jobs, {estimate:.0f} s ({estimate / 3600:.2f} h) on one core")
            return 0
        failed, spent = 0, 0.0
        for job in selection:
            began = time.perf_counter()
            label = (f"{job.sweep}/{job.folder.name} {job.config.get('algorithm')} target {job.config.get('target')} "
                     f"seed {job.config.get('seed')}")
            with tempfile.TemporaryDirectory(prefix="job-", dir=scratch) as folder:
                try:
                    lines, how, fingerprint = replay(job, parsed.rounds, parsed.way, parsed.data_root, Path(folder))
                except Exception as error:  # noqa: BLE001 (a job that cannot run fails; the others go on)
                    seconds = time.perf_counter() - began
                    spent += seconds
                    failed += 1
                    print(f"{label}: FAIL, the replay raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
                          f"({seconds:.1f} s)", flush=True)
                    continue
            seconds = time.perf_counter() - began
            spent += seconds
            result = compare(lines, job.lines, parsed.rounds, forced_last=how.startswith("rounds="))
            summary_path = job.folder / "summary.json"
            recorded_data = json.loads(summary_path.read_text()).get("data_fingerprint") if summary_path.exists() else None
            if recorded_data and recorded_data != fingerprint:
                result.problems.append(f"read data {fingerprint}, the record data {recorded_data}")
            verdict = "PASS" if result.passed() else "FAIL"
            failed += verdict == "FAIL"
            print(f"{label} [{how}]: max deviation loss {result.loss:.2e}, other metrics {result.metrics:.2e}, "
                  f"update norms {result.norms:.2e} (relative), accuracies {result.accuracy:.3f} point; "
                  f"{seconds:.1f} s (estimated {job.estimate(parsed.rounds):.0f} s; recorded rounds "
                  f"{job.recorded_seconds(parsed.rounds):.1f} s); made on {job.made_on()}, here {here}: {verdict}", flush=True)
            for problem in result.problems[:10]:
                print(f"    {problem}", flush=True)
        print(f"time: {spent:.1f} s for {len(selection)} jobs (estimated {estimate:.0f} s)")
        print(f"jobs compared: {len(selection)}, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
