"""FedBed on Flower: records, what leaves a site, equal results on every backend, lost nodes."""

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import Context, Message, Metadata, RecordDict

from fedbed.experiment import ExperimentConfig, build_run, run_experiment
from fedbed.run_directory import LOG_NAME
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.client_evaluation import evaluation_payloads
from fedbed.flower.apps import STATE_RECORD, client_evaluate, client_train
from fedbed.flower.deployment import run_flower_deployment
from fedbed.flower.records import payload_from_records, payload_to_records, reply_from_records, reply_to_records

def flower_processes_of(folder) -> list[int]:
    """PIDs of live processes whose ``FLWR_HOME`` lies under ``folder``: every process of a
    deployment started there (SuperLink, SuperNodes and the app processes they spawn inherit it),
    and no process of anybody else's."""
    marker = f"FLWR_HOME={folder}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return found


@pytest.fixture
def no_orphans(tmp_path):
    """Every Flower process a test starts under ``tmp_path`` is gone when the test ends."""
    yield
    deadline = time.monotonic() + 15
    while flower_processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not flower_processes_of(tmp_path), "a Flower process outlived its test"


def tiny(algorithm: str, run_dir, **changes) -> ExperimentConfig:
    """Two clients (three of RotatedMNIST's five source domains each) on the embedded MNIST sample."""
    values = dict(dataset="RotatedMNIST", model="lenet", target="0", algorithm=algorithm, rounds=2, local_steps=2, batch_size=16,
                  partition="domains_per_client", num_clients=2, domains_per_client=3, seed=3, run_dir=run_dir)
    values.update(changes)
    return ExperimentConfig(**values)


def instruction(content: RecordDict, node: int) -> Message:
    metadata = Metadata(run_id=1, message_id="m1", src_node_id=0, dst_node_id=node, reply_to_message_id="",
                        group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")
    return Message(content, metadata=metadata)


def test_records_carry_payloads_and_replies_bit_for_bit():
    payload = Payload({"w": torch.randn(3, 2), "steps": torch.tensor(7)}, {"round": 2, "batch_seed": 11, "mu": 0.5, "mode": "x"},
                      read_only_arrays={"head/1": torch.randn(2, 5, dtype=torch.float64)})
    back = payload_from_records(payload_to_records(payload))
    assert back.config == payload.config
    for sent, received in ((payload.arrays, back.arrays), (payload.read_only_arrays, back.read_only_arrays)):
        assert set(sent) == set(received)
        for name, tensor in sent.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    reply = Reply({"w": torch.randn(4, dtype=torch.float64)}, num_examples=13, metrics={"loss": 0.25})
    again = reply_from_records(reply_to_records(reply))
    assert again.num_examples == 13 and again.metrics == {"loss": 0.25} and torch.equal(again.arrays["w"], reply.arrays["w"])


def test_a_site_sends_only_parameters_and_metrics(tmp_path):
    config = tiny("fedsr", tmp_path)  # FedSR keeps class priors as persistent client state
    built = build_run(config)
    sent = built.initial_model.state_dict()
    context = Context(run_id=1, node_id=9, node_config={"partition-id": 1}, state=RecordDict(), run_config={})
    message = instruction(payload_to_records(Payload(dict(sent), {"round": 1, "batch_seed": 5})), node=9)
    reply = client_train(message, context, config.model_dump_json())
    content = reply.content
    assert set(content.array_records) == {"arrays"} and set(content.metric_records) == {"metrics"}
    # Besides: the name of the device it trained on (the summary's client_devices), nothing of its data.
    assert set(content.config_records) == {"placement"} and dict(content.config_records["placement"]) == {"device": "cpu"}
    assert set(content.array_records["arrays"]) == set(sent)  # the model's parameters, nothing else
    assert all(tuple(content.array_records["arrays"][k].shape) == tuple(v.shape) for k, v in sent.items())
    assert set(content.metric_records["metrics"]) == {"loss", "fit_seconds", "num_examples"}  # fit_seconds: the client time limit
    assert content.metric_records["metrics"]["num_examples"] == len(built.partitions[1].indices)
    assert STATE_RECORD in context.state.config_records  # the client state stayed on the node
    # Evaluating on its id-holdout share, it sends back counts per model and domain, nothing else:
    # samples, correct ones, and samples predicted as each of the ten classes (no prediction of a sample).
    payload = evaluation_payloads([(built.initial_model, None)], [p.domains for p in built.partitions])[1]
    scored = client_evaluate(instruction(payload_to_records(payload), node=9), context, config.model_dump_json()).content
    assert not scored.config_records and not scored.array_records["arrays"]
    counts = ("n", "correct", *(f"predicted_{c}" for c in range(10)))
    expected = {f"model0/domain{d}/{s}" for d in built.partitions[1].domains for s in counts}
    assert set(scored.metric_records["metrics"]) == expected | {"num_examples"}


def final_metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / LOG_NAME).read_text().splitlines()]
    return [r["metrics"]["train_loss"] for r in records], [r["evaluation"] for r in records]


def assert_same_run(expected_dir, actual_dir, eval_size: int):
    losses, evaluations = final_metrics(expected_dir)
    other_losses, other_evaluations = final_metrics(actual_dir)
    assert other_losses == pytest.approx(losses, rel=1e-5)
    assert [e is None for e in other_evaluations] == [e is None for e in evaluations]
    for mine, theirs in zip(filter(None, evaluations), filter(None, other_evaluations)):
        # Accuracies agree to float tolerance: at most one sample may sit on a decision boundary.
        assert theirs["ood_mean"] == pytest.approx(mine["ood_mean"], abs=100.0 / eval_size + 1e-9)
        assert theirs["id_mean"] == pytest.approx(mine["id_mean"], abs=100.0 / 50 + 1e-9)


# MCGDM's clients under FedOMG's server rule (a composed method, whose strategy is MCGDM's with
# FedOMG's aggregation in its seam: FedAvg's server that also sends each client, as read-only
# arrays, the other clients' heads of the previous round, its own left out, so payloads differ per
# client) on a deployment here and on the simulation through the CLI, with a faulty site (below).
# hFedF, which sends each client its own weights, on a deployment. FedADG's clients, whose
# discriminator and random projection live in the client state (the node's context.state on
# Flower), under FedDG-GA's server rule (whose clients keep their last local risk there) on a
# deployment whose sites each hold one domain in tests/test_spread_data.py.
MCGDM_HP = {"include_own_head": False, "client_lr": 0.01}


def assert_heads_were_sent(run_dir, client: str = "0"):
    """Round 2 of an MCGDM run carried the other clients' heads to ``client`` as read-only arrays."""
    second = json.loads((run_dir / LOG_NAME).read_text().splitlines()[1])
    assert second["communication"]["sent_bytes"][client] > second["communication"]["received_bytes"][client]


@pytest.mark.parametrize("algorithm", ["mcgdm+fedomg", "hfedf"])
def test_same_results_in_process_and_on_a_flower_deployment(tmp_path, algorithm, no_orphans, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Evaluated after round 2 only: one evaluate message per site instead of two, and still
    # rounds of training on each side of it.
    hp = MCGDM_HP if algorithm.startswith("mcgdm") else {}
    # hFedF's sites score their own id holdouts, each with its own personalised model
    # (@app.evaluate); MCGDM's global model is scored on the server, as in-process: one message
    # round fewer.
    sites = "clients" if algorithm == "hfedf" else "server"
    run = functools.partial(tiny, algorithm, eval_every=2, hp=hp)
    try:
        run_experiment(run(tmp_path / "in-process"), progress=False, echo=lambda *_: None)
        summary = run_flower_deployment(run(tmp_path / "flower-deployment", id_evaluation=sites),
                                        echo=lambda *_: None, work_dir=tmp_path / "flower")
    finally:
        torch.set_num_threads(threads)
    assert summary["backend"] == "flower-deployment"
    assert_same_run(tmp_path / "in-process", tmp_path / "flower-deployment", len(build_run(run(tmp_path / "x")).split.target))
    assert final_metrics(tmp_path / "flower-deployment")[1][0] is None  # round 1 was not evaluated
    if algorithm.startswith("mcgdm"):
        for backend in ("in-process", "flower-deployment"):
            assert_heads_were_sent(tmp_path / backend)


def test_the_script_by_its_full_path_without_the_environment_on_path_and_sigterm_leaves_nothing(tmp_path, no_orphans):
    """cron, systemd and pipx run the script by its path without activating the environment: the
    Flower processes still find their sibling executables. SIGTERM mid-run stops every one of them."""
    import os
    import signal

    run_dir = tmp_path / "run"
    script = Path(sys.executable).parent / "fedbed"
    environment = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "TMPDIR": str(tmp_path),
                   "OMP_NUM_THREADS": "1"}
    settings = tmp_path / "run.yaml"  # two sites (two SuperNodes), as tiny()
    settings.write_text("partition: domains_per_client\nnum_clients: 2\ndomains_per_client: 3\nbatch_size: 16\n")
    job = subprocess.Popen([str(script), "run", "--config", str(settings), "--backend", "flower-deployment", "--model", "lenet",
                            "--rounds", "30", "--local-steps", "2", "--run-dir", str(run_dir), "--no-progress"],
                           env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        log = run_dir / LOG_NAME
        while not (log.exists() and log.read_text().strip()) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.poll() is None and log.exists() and log.read_text().strip(), "no round finished on Flower"
        assert flower_processes_of(tmp_path)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=90)
    finally:
        job.kill()
    assert job.returncode == 130 and "stopped: interrupted" in output
    # Gone when the launcher exits, also those Flower starts in sessions of their own (the
    # SuperLink's SuperExec and the ServerApp's process it started).
    assert not flower_processes_of(tmp_path)


def test_a_failed_deployment_keeps_its_logs_in_the_run_directory(tmp_path, monkeypatch):
    from fedbed.flower import deployment
    from fedbed.flower.common import FlowerError

    def failing(config, app, num_clients, work_dir, *rest):
        (work_dir / "superlink.log").write_text("starting\nFileNotFoundError: flower-superexec\n")
        raise FlowerError(f"flower-superlink exited with code 3; its log: {work_dir / 'superlink.log'}; last lines: "
                          f"{deployment.last_lines(work_dir / 'superlink.log')}")

    monkeypatch.setattr(deployment, "_deploy", failing)
    config = tiny("fedavg", tmp_path / "run")
    with pytest.raises(FlowerError) as raised:
        run_flower_deployment(config)
    kept = tmp_path / "run" / "flower-logs" / "superlink.log"
    assert f"its log: {kept}" in str(raised.value) and "last lines: starting | FileNotFoundError: flower-superexec" in str(raised.value)
    assert kept.read_text().endswith("flower-superexec\n")


def test_a_run_on_the_simulation_validates_its_settings_once_drops_a_faulty_reply_and_equals_the_in_process_run(
        tmp_path, monkeypatch, no_orphans, capfd):
    """``fedbed run --backend flower-sim``: the settings are validated once, in this process;
    the ServerApp (in this process) and the client actors receive them validated
    (tests/test_architecture.py checks that the apps' parsing of them validates nothing). The
    method is MCGDM's clients under FedOMG's server rule, three sites that score their own id
    holdouts, site 0 replying with a wrong dtype: its reply is dropped each round with its reason
    by the same engine code as in-process, the run equals the in-process one, and round 2 carried
    the other honest client's head. No warning the user cannot act on is printed (Flower's
    run_simulation deprecation notice, Ray's FutureWarning)."""
    from typer.testing import CliRunner

    from fedbed.cli import app
    from tests.test_architecture import count_validations

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = functools.partial(tiny, "mcgdm+fedomg", eval_every=2, hp=MCGDM_HP, num_clients=3, domains_per_client=2,
                            attack="wrong_dtype", id_evaluation="clients")  # evaluated after round 2 only
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(run(tmp_path / "in-process"), progress=False, echo=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    settings = tmp_path / "run.yaml"
    settings.write_text(yaml.safe_dump(run(None).model_dump(exclude_defaults=True, mode="json")))
    calls = count_validations(monkeypatch)
    result = CliRunner().invoke(app, ["run", "--config", str(settings), "--backend", "flower-sim",
                                      "--run-dir", str(tmp_path / "flower-sim"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    printed = "".join(capfd.readouterr()) + result.output
    assert "DEPRECATED FEATURE" not in printed and "FutureWarning" not in printed
    summary = json.loads((tmp_path / "flower-sim" / "summary.json").read_text())
    assert summary["backend"] == "flower-sim" and summary["faults"]["dropped_by_client"] == {"0": 2}
    for record in (json.loads(line) for line in (tmp_path / "flower-sim" / LOG_NAME).read_text().splitlines()):
        assert list(record["dropped"]) == ["0"] and "is torch.float64" in record["dropped"]["0"]
        assert record["telemetry"]["clients"] == [1, 2]
    assert_same_run(tmp_path / "in-process", tmp_path / "flower-sim", len(build_run(run(tmp_path / "x")).split.target))
    for backend in ("in-process", "flower-sim"):
        assert_heads_were_sent(tmp_path / backend, client="1")
