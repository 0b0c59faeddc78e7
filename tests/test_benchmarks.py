"""Every script under ``benchmarks/`` runs at its smallest size (``--smoke``) and prints its figure.

Each script runs as a user runs it (``python benchmarks/NAME.py --smoke``, from the repository
root, in its own process on one torch thread); the test reads the figure from its output. A
smoke run's figure measures nothing, so only its form is checked (a finite number, positive where
a rate or a ratio of times must be), never its value, except for the figures that do not depend on
time (a memory ratio, a count of trials: ``SmokeRun.exact``). A script added to ``benchmarks/`` without an entry in
:data:`SMOKE_RUNS` fails :func:`test_every_benchmark_script_has_a_smoke_run`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT = 600
"""Seconds a smoke run may take: far above the slowest one's (Flower's local deployment, about 100 s
on two busy cores), so that only a hung script reaches it."""


@dataclass(frozen=True)
class SmokeRun:
    """One smoke run: the script, its arguments after ``--smoke``, and its figure.

    Attributes:
        script: the file name under ``benchmarks/``.
        figure: a regular expression over the output (multi-line mode) whose groups are the
            figure's numbers; each must be finite and, where ``positive``, above 0.
        arguments: further arguments.
        also: further patterns the output must match, their numbers checked as the figure's.
        positive: the numbers must be above 0 (rates and ratios of times).
        exact: the figure's numbers where a smoke run fixes them (they do not depend on time).
        at_most: ``(pattern, bound)`` pairs: a further number of the output, at most its bound.
        requires: a module the script needs that the project's tests do not install (an extra).
    """

    script: str
    figure: str
    arguments: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    positive: bool = True
    exact: tuple[float, ...] | None = None
    at_most: tuple[tuple[str, float], ...] = ()
    requires: str | None = None

    @property
    def name(self) -> str:
        return " ".join([self.script.removesuffix(".py"), *self.arguments])


NUMBER = r"([-+]?[0-9][0-9,]*\.?[0-9]*(?:e[-+]?[0-9]+)?)"

SMOKE_RUNS = [
    SmokeRun("client_cost.py", rf"^fedadg / FedAvg local training time per image: {NUMBER}$", ("--method", "fedadg")),
    # 100 clients, 10 of them per round; a client holds indices, not images: memory as at 10 clients
    SmokeRun("many_clients.py", rf"^\| 100 \| 10 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \|$",
             also=(rf"^\| 10 \| 1 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \|$",),
             at_most=((rf"^peak RSS at 100 clients / at 10: {NUMBER}$", 1.5),)),
    # the two models end equal bit for bit (the script exits 1 otherwise)
    SmokeRun("max_pool_layout.py", rf"^step time torch / FedBed max-pool: {NUMBER}$",
             also=(r"^hfedf_cnn, batch 4, .*; parameters equal bit for bit after training: True$",)),
    SmokeRun("mcgdm_client_cost.py", rf"^mcgdm / FedAvg local training time per image: {NUMBER}$"),
    # images kept as uint8 take a quarter of their float32 model input
    SmokeRun("client_data_memory.py", rf"^PACS-32: 32 samples; .* as float32 model input: .* MiB \({NUMBER}x\)$",
             exact=(4.0,)),
    SmokeRun("data_loading_speed.py", rf"^folder tree \(decode \+ resize\): {NUMBER} images/s$",
             also=(rf"^packed \.npz: +{NUMBER} images/s",)),
    # after one round, the engine and the plain loop differ by the rounding of the average only
    SmokeRun("engine_overhead.py", rf"^ratio engine/plain: {NUMBER}$",
             at_most=((rf"^final global models, largest difference engine - plain: {NUMBER}$", 1e-5),)),
    SmokeRun("flower_vs_inprocess.py", rf"^flower-deployment / in-process: {NUMBER}$",
             also=(rf"^flower-sim / in-process: {NUMBER}$", r"^in-process: .* s wall")),
    SmokeRun("hfedf_server_cost.py", rf"^server step time / round time: {NUMBER}$"),
    # the last table's rows: id mean / target mean ± std over the probe seeds, both encoders
    SmokeRun("linear_probe.py", rf"^\| fedavg \| trained \| 0 \| {NUMBER} / {NUMBER} ± {NUMBER} \|",
             also=(rf"^\| fedavg \| untrained \| 0 \| {NUMBER} / {NUMBER} ± {NUMBER} \|",), positive=False),
    SmokeRun("main_job.py", rf"^fedbed run \(--rounds 1 --local-steps 2\): {NUMBER} s wall, 1 rounds, "
                            rf"id {NUMBER}%, ood {NUMBER}%"),
    SmokeRun("mutation_testing.py", rf"^mutants: {NUMBER}, run: {NUMBER}, ", requires="mutmut"),
    # a job made from the embedded sample, stopped after 1 of its 2 rounds, equals its own record
    SmokeRun("replay_committed_runs.py", rf"^jobs compared: {NUMBER}, failed: {NUMBER}$", exact=(1.0, 0.0),
             positive=False),
    # the engine's Gram matrix and the stacked updates agree on the norms (the script exits 1 otherwise); at
    # smoke size the allocator reuses freed pages, so a peak may read 0 and the ratio is not checked for sign
    SmokeRun("server_update_memory.py", rf"^peak memory stacked / Gram: {NUMBER}$", positive=False,
             also=(rf"^update norms, largest relative difference between the two ways: {NUMBER}$",)),
    # its one trial resumes to the uninterrupted run's result
    SmokeRun("sigterm_resume.py", rf"^SIGTERM then --resume, in-process: {NUMBER}/{NUMBER} trials", exact=(1.0, 1.0)),
    SmokeRun("ssl_client_speed.py", rf"^hfedf_cnn: {NUMBER} images/s$", also=(rf"^resnet18_cifar: {NUMBER} images/s$",)),
    SmokeRun("throughput.py", rf"^images per second: {NUMBER}$",
             also=(rf"^seconds per step: {NUMBER}$", rf"^model FLOP/s: {NUMBER} TFLOP/s$")),
]


def run_smoke(run: SmokeRun) -> str:
    """The output of ``python benchmarks/<script> --smoke <arguments>`` run from the repository
    root on one torch thread; fails the test, with the output, if the script does not exit 0."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("FEDBED_DATA", None)
    done = subprocess.run([sys.executable, str(BENCHMARKS / run.script), "--smoke", *run.arguments], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{run.name} --smoke exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def figure(pattern: str, output: str) -> list[float]:
    """The numbers of ``pattern``'s first match in ``output`` (commas dropped); fails if none matches."""
    match = re.search(pattern, output, flags=re.M)
    assert match is not None, f"no line matches {pattern!r} in:\n{output}"
    return [float(group.replace(",", "")) for group in match.groups()]


def test_every_benchmark_script_has_a_smoke_run():
    """No script under ``benchmarks/`` (but the shared ``_common.py``) is left out of the smoke runs."""
    scripts = {path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_")}
    assert scripts == {run.script for run in SMOKE_RUNS}


@pytest.mark.parametrize("run", SMOKE_RUNS, ids=lambda run: run.name)
def test_benchmark_prints_its_figure_at_smoke_size(run: SmokeRun):
    """The script exits 0 at its smallest size and prints its figure: finite numbers, above 0
    where the figure is a rate or a ratio of times, equal to the expected ones where a smoke run
    fixes them, and below the bounds a smoke run sets."""
    if run.requires is not None and importlib.util.find_spec(run.requires) is None:
        pytest.skip(f"{run.script} needs {run.requires}, an optional extra that is not installed")
    output = run_smoke(run)
    numbers = [number for pattern in (run.figure, *run.also) for number in figure(pattern, output)]
    assert all(math.isfinite(number) for number in numbers), output
    if run.positive:
        assert all(number > 0 for number in numbers), output
    if run.exact is not None:
        assert tuple(figure(run.figure, output)) == run.exact, output
    for pattern, bound in run.at_most:
        assert figure(pattern, output)[0] <= bound, output

