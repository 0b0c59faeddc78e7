"""Mutation testing of FedBed's methods and engine (``src/fedbed/algorithms/``, ``src/fedbed/federation/``)
with mutmut: how many deliberate small bugs the tests catch.

mutmut (https://github.com/boxed/mutmut) makes one small change at a time in the code under test (an
operator, a constant, an argument, a returned value: a *mutant*) and runs the tests that execute the
changed function; a mutant that no test fails *survives*. The figure printed is mutmut's count:
mutants generated, mutants run, killed, survived, timeouts, and the mutants no selected test
executes ("no tests"). Survivors are listed in the log this script writes and by ``--list-survivors``.

The run happens in a temporary copy of the work tree's ``src/``, ``tests/`` and ``pyproject.toml``
(to which a ``[tool.mutmut]`` section is added), so the work tree is never changed. It is a benchmark,
not part of CI: the two folders hold about 5,000 mutants (2026-11-25), and six modules' 520 took 17
minutes on two shared cores against four unit-test files, so the default run takes hours.
``--modules`` and ``--tests`` bound it (files, and the pytest selection); ``--smoke`` runs a tiny set
(one small module, one test: under a minute), checking that the tool works.

Install the tool with the project's ``mutation`` extra (the ``test`` extra includes it): ``pip install -e ".[mutation]"``.

Usage::

    python benchmarks/mutation_testing.py                          # algorithms/ and federation/, default tests
    python benchmarks/mutation_testing.py --modules algorithms/fedavg.py algorithms/ppdg.py \\
        --tests tests/test_algorithms.py -k "not runs_two_rounds"  # a bounded subset
    python benchmarks/mutation_testing.py --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MODULES = ["algorithms/*.py", "algorithms/base/*.py", "algorithms/options/*.py", "federation/*.py"]
"""Files to mutate, as globs relative to ``src/fedbed``."""

DEFAULT_TESTS = [
    "tests/test_algorithms.py", "tests/test_gradients.py", "tests/test_mcgdm.py", "tests/test_fedsr.py",
    "tests/test_fedgala.py", "tests/test_fedadg.py", "tests/test_self_supervised.py", "tests/test_knowledge_vote.py",
    "tests/test_hypernetwork.py", "tests/test_robustness.py", "tests/test_privacy.py", "tests/test_engine.py",
    "tests/test_faults.py", "tests/test_client_evaluation.py", "tests/test_evaluation_protocols.py",
    "tests/test_training_hooks.py", "tests/test_read_only_arrays.py",
    # every registered method end to end is the slowest test of all, and each method has its own tests
    "-k", "not runs_two_rounds",
]
"""The pytest selection: the tests of the methods and of the engine (the CLI, data, report and
Flower tests are left out; they exercise these folders only through end-to-end runs)."""

SMOKE_MODULES = ["algorithms/base/local_training.py"]
SMOKE_TESTS = ["tests/test_algorithms.py", "-k", "fedprox_term_by_hand"]
"""``--smoke``: FedProx's module against its hand-computed proximal term (23 mutants, 8 of them in
the function that test executes)."""

RUN_STATUSES = ("killed", "survived", "timeout", "suspicious", "segfault")
"""mutmut's outcomes of a mutant whose tests ran."""


def mutmut_section(modules: list[str], tests: list[str]) -> str:
    """The ``[tool.mutmut]`` section for the temporary copy's ``pyproject.toml``."""
    only = [f"src/fedbed/{module}" for module in modules]
    return "\n".join([
        "",
        "[tool.mutmut]",
        'source_paths = ["src"]',
        f"only_mutate = {json.dumps(only)}",
        # one process per test run (the project's addopts start two xdist workers), no cache files
        'pytest_add_cli_args = ["-n", "0", "-p", "no:cacheprovider", "-q"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        # each mutant's worker is forked from a server process that has imported and collected the tests
        # but run none: forked from mutmut's own process, which ran them, workers deadlock now and then on
        # a lock held by a thread the tests left behind (tqdm's monitor, torch's pools)
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
        "",
    ])


def prepare_workspace(workspace: Path, modules: list[str], tests: list[str]) -> None:
    """Copy the work tree's ``src/``, ``tests/`` and ``pyproject.toml`` (plus the mutmut section)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for folder in ("src", "tests"):
        shutil.copytree(ROOT / folder, workspace / folder, ignore=ignore)
    pyproject = (ROOT / "pyproject.toml").read_text()
    if "[tool.mutmut]" in pyproject:
        raise SystemExit("pyproject.toml has its own [tool.mutmut] section; this script writes the section itself")
    (workspace / "pyproject.toml").write_text(pyproject + mutmut_section(modules, tests))


def run_mutmut(workspace: Path, arguments: list[str], log) -> subprocess.CompletedProcess:
    """Run ``mutmut ARGUMENTS`` in ``workspace``, its output appended to ``log``; torch single-threaded
    in every test process (``--max-children`` of them run in parallel on a few cores)."""
    environment = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mutmut", *arguments], cwd=workspace, stdout=log,
                          stderr=subprocess.STDOUT, env=environment, check=False)


def outcomes(workspace: Path) -> dict[str, str]:
    """Mutant name -> mutmut's status of every mutant (``mutmut results --all true``)."""
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=workspace,
                            capture_output=True, text=True, check=True).stdout
    statuses = {}
    for line in listed.splitlines():
        name, separator, status = line.strip().rpartition(": ")
        if separator:
            statuses[name] = status
    return statuses


def figure(statuses: dict[str, str]) -> dict[str, int]:
    """The counts: ``mutants`` (generated), ``run`` (their tests executed), then each status's
    (mutmut's names: killed, survived, timeout, suspicious, segfault, no tests, and any other)."""
    counts = dict.fromkeys((*RUN_STATUSES, "no tests"), 0)
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    return {"mutants": len(statuses), "run": sum(counts[s] for s in RUN_STATUSES), **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=None, metavar="GLOB",
                        help=f"files to mutate, globs relative to src/fedbed (default: {' '.join(DEFAULT_MODULES)})")
    parser.add_argument("--tests", nargs=argparse.REMAINDER, default=None,
                        help="the pytest selection, everything after --tests (default: the methods' and the engine's "
                             "test files, without the every-method end-to-end test)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a tiny set: {' '.join(SMOKE_MODULES)} against {' '.join(SMOKE_TESTS)}")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run in parallel (default 2)")
    parser.add_argument("--list-survivors", action="store_true", help="print every surviving mutant's name")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="run in DIR (created, must not exist) and keep it: `python -m mutmut show NAME` there "
                             "prints a mutant's diff")
    args = parser.parse_args(argv)
    if args.smoke and (args.modules or args.tests):
        parser.error("--smoke runs its own modules and tests; give either --smoke or --modules/--tests")
    if importlib.util.find_spec("mutmut") is None:
        print('mutmut is not installed: pip install -e ".[mutation]"', file=sys.stderr)
        return 2
    modules = SMOKE_MODULES if args.smoke else (args.modules or DEFAULT_MODULES)
    tests = SMOKE_TESTS if args.smoke else (args.tests or DEFAULT_TESTS)

    if args.keep is not None:
        args.keep.mkdir(parents=True)
        workspace = args.keep.resolve()
    else:
        workspace = Path(tempfile.mkdtemp(prefix="fedbed-mutation-"))
    try:
        prepare_workspace(workspace, modules, tests)
        log_path = workspace / "mutmut.log"
        began = time.perf_counter()
        with log_path.open("w") as log:
            completed = run_mutmut(workspace, ["run", "--max-children", str(args.max_children)], log)
        seconds = time.perf_counter() - began
        if completed.returncode != 0:
            print(log_path.read_text()[-4000:], file=sys.stderr)
            print(f"mutmut run failed (exit {completed.returncode}); its log: {log_path}", file=sys.stderr)
            args.keep = args.keep or workspace  # keep the evidence
            return 1
        statuses = outcomes(workspace)
        counts = figure(statuses)
        print(f"mutation testing (mutmut) of {' '.join('src/fedbed/' + m for m in modules)}")
        print(f"tests: {shlex.join(tests)}")
        print(", ".join(f"{name}: {count}" for name, count in counts.items()))
        if counts["run"]:
            print(f"killed share of the mutants run: {counts['killed'] / counts['run']:.1%}")
        print(f"wall time: {seconds:.0f} s with {args.max_children} parallel mutants")
        if args.list_survivors:
            for name, status in sorted(statuses.items()):
                if status == "survived":
                    print(f"survived: {name}")
        if args.keep is not None:
            print(f"workspace kept: {workspace} (mutmut log: {log_path})")
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(workspace, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
