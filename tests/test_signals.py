"""SIGINT, SIGTERM and SIGHUP stop FedBed cleanly: no process it started survives, an in-process
run keeps the checkpoint of its last complete round and resumes from it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedbed.federation.run_log import signals_deferred
from fedbed.run_directory import CHECKPOINT_NAME, LOG_NAME, SUMMARY_NAME


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def rounds_logged(run_dir: Path) -> int:
    log = run_dir / LOG_NAME
    return len(log.read_text().splitlines()) if log.exists() else 0


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's children lists)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            found += kids
            queue += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_stop_signal_while_a_round_is_written_takes_effect_once_it_is_written():
    """The window the end-to-end test below can only hit by chance: a signal between a round's
    log line and its checkpoint."""
    written = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                signal.raise_signal(signal.SIGINT)
                written.append("log line")
                signal.raise_signal(signal.SIGINT)
                written.append("checkpoint")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert written == ["log line", "checkpoint"]


def test_an_ignored_signal_stays_ignored_while_a_round_is_written():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_deferred():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_an_in_process_run_which_resumes_from_its_checkpoint(tmp_path, signal_number):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "fedbed", "run", "--model", "lenet", "--rounds", "40", "--local-steps", "3",
               "--run-dir", str(run_dir), "--no-progress"]
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT (as
    # it should); the run under test gets the default disposition, as from a terminal.
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: rounds_logged(run_dir) >= 2, 120, "two rounds")
        job.send_signal(signal_number)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 130 and "stopped: interrupted" in output and "Traceback" not in output
    assert not (run_dir / SUMMARY_NAME).exists()
    checkpoint = torch.load(run_dir / CHECKPOINT_NAME, weights_only=False)
    done = rounds_logged(run_dir)
    assert done >= 2 and checkpoint["round"] == done
    if signal_number != signal.SIGTERM:  # the same handler wrote the same checkpoint: resumed once, below
        return
    resumed = subprocess.run([*command[:6], "--rounds", str(done + 1), *command[8:], "--resume"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert rounds_logged(run_dir) == done + 1


def test_sigterm_stops_a_sweep_and_its_workers(tmp_path):
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("name: s\nbase: {rounds: 40, local_steps: 3, model: lenet}\nalgorithms: [fedavg, fedprox]\n"
                          "targets: ['0']\n")
    job = subprocess.Popen([sys.executable, "-m", "fedbed", "sweep", str(sweep_file), "--out", str(tmp_path / "out"),
                            "--workers", "2", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: sum(rounds_logged(d) > 0 for d in (tmp_path / "out").glob("*/")) == 2, 180, "both jobs to start")
        workers = children_of(job.pid)
        assert workers
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 130, output
    wait_for(lambda: not any(alive(pid) for pid in workers), 30, "the workers to stop")
