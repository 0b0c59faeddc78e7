"""Flower deployments when sites misbehave: a stranger's SuperNode is refused (SuperNode
authentication), a silent site holds discovery up for a bounded time only, and the ServerApp's
progress reaches ``flwr run --stream`` and ``flwr log``."""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from flwr.app import Context, Error, Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

from fedbed.federation.messages import Payload
from fedbed.flower.apps import FlowerClients, _one_line_errors, client_query
from fedbed.flower.common import FlowerError, key_fingerprint
from fedbed.flower.deployment import (
    free_port,
    local_federation,
    refused_supernodes,
    register_site,
    run_flower_deployment,
    write_app,
    write_site_key,
)
from fedbed.run_directory import LOG_NAME
from tests.test_flower import flower_processes_of, no_orphans, tiny  # noqa: F401 (no_orphans is a fixture)

FLWR = str(Path(sys.executable).parent / "flwr")
SUPERNODE = str(Path(sys.executable).parent / "flower-supernode")


@pytest.fixture
def in_a_serverapp(monkeypatch):
    """The identity of a ServerApp's task, which Flower 1.41 stamps on every message it creates."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class FakeGrid:
    """The ServerApp's grid over a SuperLink whose nodes answer a query as told: a node id maps
    to its partition-id, to ``"silent"`` (connected, never answers) or to ``"leaves"`` (its
    query gets the SuperLink's error reply and the node is gone)."""

    def __init__(self, nodes: dict[int, int | str], keys: dict[int, bytes] | None = None) -> None:
        self.nodes, self.keys, self.sent = dict(nodes), keys or {}, {}

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def get_nodes(self) -> list[NodeInfo]:
        return [NodeInfo(node_id=node, public_key=self.keys.get(node, b"")) for node in self.nodes]

    def push_messages(self, messages):
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's grid stamps it
            self.sent[message.object_id] = message
        return [message.metadata.message_id for message in messages]

    def pull_messages(self, message_ids):
        replies = []
        for message_id in message_ids:
            query = self.sent[message_id]
            answer = self.nodes.get(query.metadata.dst_node_id)
            if answer == "leaves":
                del self.nodes[query.metadata.dst_node_id]
                replies.append(Message(Error(code=0, reason="Node Unavailable"), reply_to=query))
            elif isinstance(answer, int):
                context = Context(run_id=1, node_id=query.metadata.dst_node_id, node_config={"partition-id": answer},
                                  state=RecordDict(), run_config={})
                replies.append(client_query(query, context))
        return replies


def test_discovery_waits_a_bounded_time_names_the_missing_sites_and_goes_on_without_them(in_a_serverapp):
    lines = []
    began = time.monotonic()
    clients = FlowerClients(FakeGrid({10: 0, 11: "silent", 12: "leaves", 13: 2}), 4, discovery_timeout=0.6,
                            echo=lines.append)
    assert 0.6 <= time.monotonic() - began < 3
    assert clients.node_of == {0: 10, 2: 13}
    assert any("SuperNode 12 did not say its client id: Node Unavailable" in line for line in lines)
    waiting = [line for line in lines if "waiting for partition-id 1, 3" in line]
    assert waiting and "1 not answering yet" in waiting[0]  # the silent node
    assert lines[-1].startswith("discovery: no SuperNode said it holds partition-id 1, 3 within 0.6 s; the run goes on without them")
    # The missing sites are dropped from each round with that reason, as a lost site is.
    outcomes = clients.fit_round({1: Payload({}, {"round": 1}), 3: Payload({}, {"round": 1})})
    assert all("no SuperNode said it holds partition-id" in outcomes[client] for client in (1, 3))


def test_discovery_ends_with_one_clear_message_when_no_site_or_two_sites_claim_one_partition(in_a_serverapp):
    with pytest.raises(FlowerError, match=r'no SuperNode said its client id within 0.2 s \(1 connected\): start one SuperNode per '
                                          r'site with --node-config "partition-id=K num-partitions=2"'):
        FlowerClients(FakeGrid({10: "silent"}), 2, discovery_timeout=0.2, echo=lambda _: None)
    with pytest.raises(FlowerError, match="SuperNodes 10 and 11 both have partition-id 0"):
        FlowerClients(FakeGrid({10: 0, 11: 0}), 2, discovery_timeout=5, echo=lambda _: None)


def test_with_the_sites_keys_pinned_a_node_holding_another_key_takes_no_part(in_a_serverapp, tmp_path):
    """Flower 1.41's SuperLink registers a key for anybody who reaches its Control API: a
    stranger who registered its own key and claims site 1's partition-id is left out."""
    (_, site_0), (_, site_1), (_, stranger) = (write_site_key(tmp_path, name) for name in ("site-0", "site-1", "stranger"))

    def pem(public):  # as the SuperLink holds a SuperNode's key
        return serialization.load_ssh_public_key(public.read_bytes()).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    assert key_fingerprint(site_0.read_bytes()) == key_fingerprint(pem(site_0)) != key_fingerprint(pem(site_1))
    lines = []
    grid = FakeGrid({10: 0, 11: 1, 12: 1}, keys={10: pem(site_0), 11: pem(stranger), 12: pem(site_1)})
    clients = FlowerClients(grid, 2, discovery_timeout=5, echo=lines.append,
                            site_keys=[key_fingerprint(site_0.read_bytes()), key_fingerprint(site_1.read_bytes())])
    assert clients.node_of == {0: 10, 1: 12}
    assert [line for line in lines if "takes no part" in line] == [
        f"discovery: SuperNode 11 claims partition-id 1 without site 1's registered key (its key: "
        f"{key_fingerprint(stranger.read_bytes())}); it takes no part"]
    with pytest.raises(FlowerError, match="this run has 2 clients, and 1 site keys were given"):
        FlowerClients(grid, 2, discovery_timeout=5, echo=lines.append, site_keys=[key_fingerprint(site_0.read_bytes())])


def test_flower_app_pins_the_sites_keys_and_sets_the_discovery_timeout(tmp_path):
    import tomllib

    from typer.testing import CliRunner

    from fedbed.cli import app

    (_, site_0), (_, site_1) = write_site_key(tmp_path, "site-0"), write_site_key(tmp_path, "site-1")
    config = tmp_path / "run.yaml"
    config.write_text("rounds: 2\n")
    job = ["flower-app", str(tmp_path / "job"), "--config", str(config)]
    result = CliRunner().invoke(app, [*job, "--discovery-timeout", "90", "--site-key", str(site_0), "--site-key", str(site_1)])
    assert result.exit_code == 0, result.output
    run_config = tomllib.loads((tmp_path / "job" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert run_config["fedbed-discovery-timeout"] == 90.0
    assert json.loads(run_config["fedbed-site-keys"]) == [key_fingerprint(site_0.read_bytes()), key_fingerprint(site_1.read_bytes())]
    # A private key given for a public one: one line, exit 2, nothing written.
    refused = CliRunner().invoke(app, ["flower-app", str(tmp_path / "other"), "--config", str(config),
                                       "--site-key", str(tmp_path / "site-0")])
    assert refused.exit_code == 2 and "site key" in refused.output and "not a public key" in refused.output
    assert not (tmp_path / "other").exists()


def test_a_serverapp_stopped_by_a_fedbed_error_logs_its_message_without_a_traceback():
    def record_of(error):
        try:
            raise error
        except Exception:  # noqa: BLE001 (Flower logs whatever ends the ServerApp)
            return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception", ("ServerApp",), sys.exc_info())

    said = record_of(FlowerError("no SuperNode said its client id within 60 s"))
    assert _one_line_errors(said) and said.exc_info is None
    assert said.getMessage() == "ServerApp stopped: no SuperNode said its client id within 60 s"
    bug = record_of(KeyError("w"))  # anything else keeps Flower's traceback
    assert _one_line_errors(bug) and bug.exc_info is not None and bug.getMessage() == "ServerApp raised an exception"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_strangers_supernodes_take_no_part_in_a_tls_deployment_and_the_run_goes_on(tmp_path, no_orphans, monkeypatch):
    """A TLS deployment admits only the sites FedBed registered. Two strangers who trust the CA
    (its certificate is no secret) claim site 1's partition-id: one with a key nobody registered,
    which the SuperLink refuses (the launcher says so); one that registered its own key through
    the SuperLink's Control API, which Flower 1.41 allows anybody who reaches it, and which the
    ServerApp leaves out, as its key is not site 1's (either would otherwise take site 1's
    partition, or stop the run as a second claimant)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work_dir, lines, outcome = tmp_path / "flower", [], {}
    config = tiny("fedavg", tmp_path / "run", rounds=1)

    def deploy():
        try:
            outcome["summary"] = run_flower_deployment(config, tls=True, work_dir=work_dir, echo=lines.append)
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            outcome["error"] = error

    def stranger(name: str, register: bool) -> subprocess.Popen:
        home = tmp_path / name  # the stranger's own FLWR_HOME, knowing the address and the CA
        home.mkdir()
        (home / "config.toml").write_text(connection.read_text())
        environment = {**os.environ, "FLWR_HOME": str(home),
                       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        private, public = write_site_key(home, "key")
        if register:
            register_site(public, environment)
        keys[name] = public
        return subprocess.Popen(
            [SUPERNODE, "--root-certificates", str(work_dir / "certificates" / "ca.crt"), "--superlink", f"127.0.0.1:{port}",
             "--auth-supernode-private-key", str(private), "--node-config", "partition-id=1 num-partitions=2",
             "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(free_port())],
            env=environment, stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    deployment = threading.Thread(target=deploy)
    deployment.start()
    strangers, keys = [], {}
    try:
        connection = work_dir / "flwr-home" / "config.toml"
        deadline = time.monotonic() + 120
        while not connection.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        port = int(connection.read_text().split("127.0.0.1:")[1].split('"')[0])
        while not _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        strangers = [stranger("unregistered", register=False), stranger("self-registered", register=True)]
        assert strangers[0].wait(timeout=120) != 0  # refused: it exits rather than join
        deployment.join(timeout=400)
    finally:
        for process in strangers:  # each with its children (the SuperNode's SuperExec)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        deployment.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    assert "Failed to activate SuperNode" in (tmp_path / "unregistered.log").read_text()
    rounds = [json.loads(line) for line in (tmp_path / "run" / LOG_NAME).read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1] and rounds[0]["dropped"] == {}  # both registered sites trained
    assert outcome["summary"]["backend"] == "flower-deployment"
    said = [line for line in lines if "refused" in line]
    assert len(said) == 1 and "refused 1 SuperNode whose key is not registered" in said[0]
    refused_key = serialization.load_ssh_public_key(keys["unregistered"].read_bytes()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    assert refused_supernodes(tmp_path / "run" / "flower-logs" / "superlink.log") == [refused_key]


def test_a_silent_site_holds_discovery_up_for_a_bounded_time_a_lost_one_is_dropped_and_the_progress_reaches_flwr_log(
        tmp_path, no_orphans, monkeypatch):
    """The manual mode with Flower's own CLI, three sites: site 2's SuperNode connects but no
    ClientApp ever answers (started with --isolation process and no ClientApp process), then
    stops; site 1 trains in round 1 and goes away. The ServerApp says which partition it waits
    for, goes on without it after the discovery timeout, drops site 1 (and its share of the
    id holdouts) from round 2 with the SuperNode's reason, and its rounds show in
    ``flwr run --stream`` and ``flwr log``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = tiny("fedavg", (tmp_path / "run").resolve(), rounds=2, num_clients=3, domains_per_client=2,
                  id_evaluation="clients")
    app = write_app(tmp_path / "app", config, discovery_timeout=25.0, round_timeout=45.0)
    stream, log = tmp_path / "flwr-run.log", tmp_path / "run" / LOG_NAME
    with local_federation(2, tmp_path) as (processes, environment):
        address = (Path(environment["FLWR_HOME"]) / "config.toml").read_text().split('address = "')[1].split('"')[0]
        processes.start("silent-supernode", [SUPERNODE, "--insecure", "--superlink", address, "--node-config",
                                             "partition-id=2 num-partitions=3", "--isolation", "process",
                                             "--host", "127.0.0.1", "--port", str(free_port())])
        job = subprocess.Popen([FLWR, "run", str(app), "fedbed", "--stream"], env=environment, cwd=tmp_path,
                               stdout=stream.open("w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "3 SuperNode(s) connected" not in stream.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)  # the three SuperNodes were asked; site 2 does not answer
            processes.stop("silent-supernode")
            deadline = time.monotonic() + 300
            while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert log.exists() and log.read_text().strip(), "round 1 never finished"
            processes.stop("supernode-1")  # site 1 goes away after round 1
            assert job.wait(timeout=400) == 0
        finally:
            job.kill()
        run_id = next(line.split()[-1] for line in stream.read_text().splitlines() if "Successfully started run" in line)
        shown = subprocess.run([FLWR, "log", run_id, "fedbed", "--show"], env=environment, capture_output=True, text=True,
                               timeout=120).stdout
    streamed = stream.read_text()
    assert any(f"waiting for partition-id {waited} " in streamed for waited in ("2", "1, 2", "0, 2", "0, 1, 2"))
    assert "did not say its client id" in streamed  # the stopped node's query came back as an error, said in one line
    assert "no SuperNode said it holds partition-id 2 within 25 s; the run goes on without it" in streamed
    assert "Traceback" not in streamed
    for shown_log in (streamed, shown):
        assert "round 1/2: train loss" in shown_log and "dropped client 2: no SuperNode said it holds partition-id 2" in shown_log
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert set(rounds[0]["dropped"]) == {"2"} and set(rounds[0]["evaluation_dropped"]) == {"2"}
    assert rounds[0]["evaluation"]["ood_mean"] is not None
    # Site 1 went away: dropped with the SuperNode's reason, and its holdout share with it.
    assert set(rounds[1]["dropped"]) == {"1", "2"} and "SuperNode" in rounds[1]["dropped"]["1"]
    assert set(rounds[1]["evaluation_dropped"]) == {"1", "2"}
    selection = json.loads((tmp_path / "run" / "summary.json").read_text())["selection"]
    assert selection["last"]["round"] == 2
    # No round had every site's id holdout share: no round to select by it, said, and the run still ends.
    assert selection["train_domain_val"]["round"] is None
    assert "selection: no evaluated round has a id_mean score to select by train_domain_val" in streamed
