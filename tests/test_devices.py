"""Devices and mixed precision (fedbed.federation.devices): the resolver, the refusals, bf16 and
fp16 training on a CPU, where a run's tensors live, what the records say; CUDA runs where a GPU is."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fedbed.algorithms import AlgorithmContext, TrainingBudget, get_algorithm
from fedbed.algorithms.base.local_training import train_locally
from fedbed.cli import app
from fedbed.config import ConfigError, ExperimentConfig, validate
from fedbed.experiment import run_experiment
from fedbed.federation.devices import (
    HOST,
    DeviceError,
    autocast,
    device_description,
    gradient_scaler,
    resolve_device,
    set_deterministic,
    to_host,
)
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from tests.helpers import small_model

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def test_the_resolver_reads_every_value_of_the_setting(monkeypatch):
    assert resolve_device("cpu") == HOST
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == HOST and resolve_device("auto") == HOST
    with pytest.raises(DeviceError, match="no CUDA device.*--device cpu"):
        resolve_device("cuda:1")
    with pytest.raises(DeviceError, match="unknown device 'gpu'; choose auto, cpu, cuda, cuda:N or mps"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_a_device_this_machine_lacks_is_refused_with_one_line(tmp_path):
    result = CliRunner().invoke(app, ["run", "--device", "cuda", "--rounds", "1", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu or auto"]
    assert not (tmp_path / "run").exists()


def test_a_method_refuses_a_precision_it_cannot_train_in():
    assert "fp16" not in get_algorithm("fedadg").precisions
    with pytest.raises(ConfigError, match="fedadg trains in fp32 or bf16 only, not fp16"):
        validate(ExperimentConfig(algorithm="fedadg", device="cpu", precision="fp16"))
    with pytest.raises(ConfigError, match="precision"):
        ExperimentConfig(precision="fp8")


def test_autocast_and_the_scaler_follow_the_precision():
    assert gradient_scaler(HOST, "bf16") is None and gradient_scaler(HOST, None) is None
    assert isinstance(gradient_scaler(HOST, "fp16"), torch.amp.GradScaler)
    layer = nn.Linear(3, 2)
    for precision, dtype in ((None, torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(HOST, precision):
            assert layer(torch.ones(1, 3)).dtype == dtype


def one_client_round(precision: str | None) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = small_model((1, 8, 8), 3)
    images = torch.randint(0, 256, (16, 1, 8, 8), dtype=torch.uint8)
    data = ClientData(images, torch.arange(16) % 3, torch.zeros(16, dtype=torch.long))
    hparams = get_algorithm("fedavg").hyperparameters(client_optimizer="sgd", client_lr=0.05)
    loss = train_locally(model, data, hparams, TrainingBudget(batch_size=8, local_steps=4), torch.Generator().manual_seed(1),
                         lambda batch: nn.functional.cross_entropy(model(batch.inputs), batch.targets), precision=precision)
    return loss, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_in_its_own_arithmetic_on_a_cpu(precision):
    """bf16 and fp16 (with its gradient scaler) train: finite, close to fp32, and not fp32 itself
    (the autocast is really on); the trained weights stay fp32."""
    reference_loss, reference = one_client_round(None)
    loss, trained = one_client_round(precision)
    assert math.isfinite(loss) and loss != reference_loss and abs(loss - reference_loss) < 0.05
    assert all(trained[name].dtype == reference[name].dtype for name in reference)
    assert any(not torch.equal(trained[name], reference[name]) for name in reference)
    assert max(float((trained[name] - reference[name]).abs().max()) for name in reference) < 0.05


@pytest.mark.parametrize("algorithm", ["mcgdm", "fedmoco", "fedadg"])
def test_methods_with_their_own_arithmetic_train_in_bf16(algorithm, tmp_path):
    """MCGDM's second-order head gradients, MoCo's fp32 queue fed bf16 keys, FedADG's own steps."""
    result = run_experiment(ExperimentConfig(algorithm=algorithm, rounds=1, local_steps=2, device="cpu", precision="bf16",
                                             run_dir=tmp_path / algorithm), progress=False, echo=lambda *_: None)
    line = json.loads((tmp_path / algorithm / "rounds.jsonl").read_text().splitlines()[0])
    assert line["dropped"] == {} and math.isfinite(line["metrics"]["train_loss"])
    assert result.summary["precision"] == "bf16"


def test_a_run_records_its_device_and_keeps_what_it_sends_on_the_host(tmp_path):
    result = run_experiment(ExperimentConfig(rounds=1, local_steps=1, device="cpu", run_dir=tmp_path / "run"),
                            progress=False, echo=lambda *_: None)
    assert result.summary["device"] == device_description(HOST) and result.summary["device"]["device"] == "cpu"
    start = json.loads((tmp_path / "run" / "provenance.jsonl").read_text().splitlines()[-1])
    assert {"device", "device_name", "cuda_version", "cudnn_version"} <= set(start)
    fedsr = get_algorithm("fedsr")
    hparams = fedsr.hyperparameters()
    context = AlgorithmContext(lambda: fedsr.wrap_model(small_model((1, 8, 8), 3), hparams),
                               TrainingBudget(batch_size=8, local_steps=1), seed=0)
    trainer = fedsr.create_trainer(hparams, context)
    sent = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    state: dict = {}
    images = torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8)
    reply = trainer.fit(Payload(sent, {"batch_seed": 3}), ClientData(images, torch.arange(8) % 3, torch.zeros(8, dtype=torch.long)),
                        state)
    assert all(t.device == HOST for t in reply.arrays.values())
    assert all(t.device == HOST for t in state["prior"].values())


def test_to_host_moves_nested_tensors_and_keeps_the_rest():
    value = {"a": [torch.ones(1), (torch.zeros(2), 3)], "b": "text"}
    moved = to_host(value)
    assert moved["b"] == "text" and moved["a"][1][1] == 3 and moved["a"][0] is value["a"][0]


def test_deterministic_mode_is_switched_on_and_off():
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    finally:
        set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


@NEEDS_CUDA
def test_a_cuda_run_sends_host_tensors_and_repeats_itself_when_deterministic(tmp_path):
    def run(name):
        run_experiment(ExperimentConfig(rounds=2, local_steps=2, device="cuda", deterministic=True, run_dir=tmp_path / name),
                       progress=False, echo=lambda *_: None)
        return [json.loads(line)["metrics"]["train_loss"] for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]

    assert run("first") == run("second")
    checkpoint = torch.load(tmp_path / "first" / "checkpoint.pt", weights_only=False)
    assert all(t.device == HOST for t in checkpoint["strategy"]["model"].values())


@NEEDS_CUDA
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_method_trains_on_cuda_in_mixed_precision(precision, tmp_path):
    from fedbed.algorithms import ALGORITHMS

    for name in sorted(ALGORITHMS):
        if precision not in get_algorithm(name).precisions:
            continue
        run_experiment(ExperimentConfig(algorithm=name, rounds=1, local_steps=2, device="cuda", precision=precision,
                                        run_dir=tmp_path / name), progress=False, echo=lambda *_: None)
        line = json.loads((tmp_path / name / "rounds.jsonl").read_text().splitlines()[0])
        assert line["dropped"] == {} and math.isfinite(line["metrics"]["train_loss"]), name


def test_client_resources_reach_the_flower_simulation():
    """flower-sim hands Ray the config's CPUs and GPU share per client actor (a placement setting),
    through ``flwr run``'s federation config, which Flower's simulation reads into Ray's settings."""
    from flwr.simulation.app import _run_simulation_settings
    from flwr.supercore.utils import simulation_config_from_json

    from fedbed.config import PLACEMENT_SETTINGS, validate
    from fedbed.flower.simulation import federation_config

    config = ExperimentConfig(rounds=1, local_steps=1, client_resources={"cpus": 2, "gpus": 0.25})
    entries = federation_config(validate(config), cpus=2)
    # As flwr run --federation-config parses them, and flwr-simulation hands them to Ray.
    nodes, backend, ray_settings, _, _ = _run_simulation_settings(
        simulation_config_from_json({key.replace("-", "_"): value for key, value in entries.items()}))
    assert (nodes, backend) == (validate(config).num_clients, "ray")
    assert ray_settings["client_resources"] == {"num_cpus": 2, "num_gpus": 0.25}
    assert ray_settings["init_args"]["num_cpus"] == 2
    assert ray_settings["init_args"]["num_gpus"] == torch.cuda.device_count()
    with pytest.raises(ConfigError, match="whole number of CPUs"):
        federation_config(validate(ExperimentConfig(client_resources={"cpus": 0.5})))
    assert "client_resources" in PLACEMENT_SETTINGS
    with pytest.raises(ConfigError, match="client_resources"):
        ExperimentConfig(client_resources={"gpus": -1})


def test_a_run_says_which_device_each_client_trained_on(tmp_path):
    """In-process from the trainer; on Flower from a placement record each reply carries."""
    from fedbed.federation.messages import Reply
    from fedbed.flower.records import reply_device, reply_from_records, reply_to_records

    result = run_experiment(ExperimentConfig(rounds=1, local_steps=1, run_dir=tmp_path / "run"), progress=False,
                            echo=lambda *_: None)
    assert result.summary["client_devices"] == {str(client): "cpu" for client in range(len(result.summary["clients"]))}
    reply = Reply({"w": torch.ones(2)}, num_examples=3, metrics={"loss": 0.5})
    content = reply_to_records(reply, "cuda:1")
    assert reply_device(content) == "cuda:1" and reply_device(reply_to_records(reply)) is None
    back = reply_from_records(content)
    assert back.num_examples == 3 and back.metrics == {"loss": 0.5} and torch.equal(back.arrays["w"], torch.ones(2))
