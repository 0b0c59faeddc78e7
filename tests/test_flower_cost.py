"""What a Flower run costs: a site builds its run once per process, the timing records that say
where a run's time goes, and the long-running ClientApp process beside each SuperNode."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedbed.federation import phase_timings
from fedbed.federation.messages import Payload
from fedbed.flower import apps
from fedbed.flower.clientapp_process import serve
from fedbed.flower.common import FlowerError
from fedbed.flower.deployment import Processes, free_port
from fedbed.flower.records import payload_to_records, reply_from_records
from tests.test_flower import instruction, tiny


def test_a_second_message_to_a_client_builds_nothing_again(tmp_path, monkeypatch):
    """As in a simulation's Ray actor or a deployment's ClientApp process, which serve many
    messages: the run's data is built on the first message only, each client's share once."""
    timings = tmp_path / "timings.jsonl"
    monkeypatch.setenv(phase_timings.TIMINGS_VARIABLE, str(timings))
    apps.cached_run.cache_clear()
    apps._client.cache_clear()
    config_json = tiny("fedavg", tmp_path / "run").model_dump_json()
    initial = apps.cached_run(config_json, None).initial_model.state_dict()  # the process's build, before any message
    losses = []
    for client, round_number in ((1, 1), (1, 2), (0, 1)):
        context = Context(run_id=1, node_id=9 + client, node_config={"partition-id": client}, state=RecordDict(),
                          run_config={})
        payload = Payload(dict(initial), {"round": round_number, "client": client, "batch_seed": 5 + round_number})
        reply = apps.client_train(instruction(payload_to_records(payload), node=9 + client), context, config_json)
        losses.append(reply_from_records(reply.content).metrics["loss"])
    records = phase_timings.read_timings(timings)
    builds = [(r["phase"], r.get("what"), r.get("client")) for r in records if r["phase"] in ("data", "model")]
    assert builds.count(("data", "run", None)) == 1  # the run's data: once in this process, for all three messages
    assert sorted(b for b in builds if b[1] == "client data") == [("data", "client data", 0), ("data", "client data", 1)]
    assert [r["client"] for r in records if r["phase"] == "training"] == [1, 1, 0]
    assert [r["client"] for r in records if r["phase"] == "handling"] == [1, 1, 0]
    assert all(loss > 0 for loss in losses)
    apps.cached_run.cache_clear()
    apps._client.cache_clear()


def test_timing_records_are_written_only_when_asked(tmp_path, monkeypatch):
    timings = tmp_path / "timings.jsonl"
    monkeypatch.delenv(phase_timings.TIMINGS_VARIABLE, raising=False)
    with phase_timings.timed("data", "client"):
        pass
    phase_timings.record("training", 1.0)
    assert not timings.exists() and phase_timings.read_timings(timings) == []
    monkeypatch.setenv(phase_timings.TIMINGS_VARIABLE, str(timings))
    with pytest.raises(ValueError), phase_timings.timed("model", "server", what="initial model"):
        time.sleep(0.01)
        raise ValueError("a failing build is timed too")
    monkeypatch.setattr(phase_timings, "_process_start_recorded", False)
    phase_timings.record_process_start("client")
    phase_timings.record_process_start("client")  # once per process
    records = phase_timings.read_timings(timings)
    assert [r["phase"] for r in records] == ["model", "process_start"]
    assert records[0]["what"] == "initial model" and records[0]["seconds"] >= 0.01 and records[0]["pid"] == os.getpid()
    started = records[1]
    # This process began before the test did, and has spent some processor time by now.
    assert started["began"] < time.time() - started["seconds"] + 1 and 0 < started["cpu_seconds"]
    assert json.loads(timings.read_text().splitlines()[1])["role"] == "client"


def test_a_clientapp_process_without_its_supernode_says_so(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    began = time.monotonic()
    with pytest.raises(FlowerError, match=f"Runtime API at {address} did not answer within 0.3 s; start it with "
                                          "--isolation process"):
        serve(address, echo=lambda *_: None, poll_seconds=0.05, connect_timeout=0.3)
    assert time.monotonic() - began < 10


def test_a_process_started_beside_a_supernode_stops_with_it(tmp_path):
    processes = Processes(tmp_path, dict(os.environ))
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    node = processes.start("supernode-0", sleep)
    beside = processes.start("clientapp-0", sleep, beside="supernode-0")
    other = processes.start("supernode-1", sleep)
    assert set(processes.pids()) == {node.pid, beside.pid, other.pid}
    processes.stop("supernode-0")
    assert node.poll() is not None and beside.poll() is not None and other.poll() is None
    processes.stop_all()
    assert other.poll() is not None
    assert Path(tmp_path / "clientapp-0.log").exists()


def test_a_clientapp_process_reports_a_task_whose_result_was_lost_and_serves_the_next(monkeypatch):
    """Reporting a task's result can fail: the site's long-running process loses that task only,
    as Flower's per-message processes would; a signal still stops it."""
    import httpx

    from fedbed.flower import clientapp_process

    class Acquired:
        token = "token"

        def HasField(self, name):  # noqa: N802 (protobuf's name)
            return name == "task"

    class Control:
        answers = 3

        def AcquireTask(self, request):  # noqa: N802
            if self.answers:
                self.answers -= 1
                return Acquired()
            raise httpx.ConnectError("the SuperNode stopped")

        def close(self):
            pass

    outcomes = [ConnectionError("reply lost"), RuntimeError("reply refused"), None]
    ran = []

    def run_task(address, token, client_app):
        ran.append(token)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(clientapp_process, "_runtime_client", lambda *args: Control())
    monkeypatch.setattr(clientapp_process, "run_task", run_task)
    lines = []
    serve("127.0.0.1:1", echo=lines.append, poll_seconds=0.01, lost_after=0.05)
    assert len(ran) == 3 and not outcomes
    assert [line.split("(")[1].split(":")[0] for line in lines[:2]] == ["ConnectionError", "RuntimeError"]
    assert lines[-1].endswith("stopping after 3 task(s)")
    # SIGTERM (FedBed's handler raises KeyboardInterrupt) stops the process even during a task.
    outcomes[:] = [KeyboardInterrupt("stopped by signal SIGTERM")]
    with pytest.raises(KeyboardInterrupt):
        serve("127.0.0.1:1", echo=lines.append, poll_seconds=0.01, lost_after=0.05)


def test_flower_processes_run_in_the_launchers_working_directory(tmp_path, monkeypatch):
    """So a relative path a run is given (a dataset folder, a tracker's file store) names the same
    files on the Flower backends as in-process; the logs still go to the log folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    processes = Processes(tmp_path / "logs", dict(os.environ))
    started = processes.start("where", [sys.executable, "-c", "import os; print(os.getcwd())"])
    started.wait(timeout=60)
    assert (tmp_path / "logs" / "where.log").read_text().strip() == str(tmp_path.resolve())
    processes.stop_all()
