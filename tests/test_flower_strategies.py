"""FedBed's server rules as Flower strategies (``fedbed.flower.strategies``): each equals FedBed's own
server on hand-made replies; what no strategy can be is refused in one line; a plain PyTorch Flower
app trains with PPDG and FedDG-GA on Flower's simulation as FedBed's servers would; the README's
app runs; and with FedBed's trainer on the clients, PPDG's run equals FedBed's in-process run bit
for bit."""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.exception import AggregationError, InconsistentMessageReplies
from torch import nn

from fedbed.algorithms import AlgorithmContext, AlgorithmError, TrainingBudget, resolve_hyperparameters
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy, trainable_parameter_names
from fedbed.algorithms.base.registry import registered_algorithm
from fedbed.algorithms.options.robust_aggregation import ROBUST_RULES, RobustAggregation
from fedbed.experiment import ExperimentConfig, build_run, run_experiment
from fedbed.federation.messages import ClientInfo, Payload, Reply
from fedbed.federation.transport import fit_client
from fedbed.flower.common import OFFLINE_ENVIRONMENT
from fedbed.flower.records import arrays_from_record
from fedbed.flower.strategies import PPDG, FedBedStrategy, FedDGGA, rule_names
from fedbed.run_directory import CHECKPOINT_NAME, LOG_NAME
from fedbed.seeding import derive_seed

CLIENTS = 5  # Krum with f = 1 needs 2f + 3
SEED = 4
README = Path(__file__).resolve().parents[1] / "README.md"
# Hyperparameters away from the defaults where a rule has them, so that a dropped one would show.
HYPERPARAMETERS = {"ppdg": {"alignment_lambda": 0.2}, "fedgma": {"mask_threshold": 0.5, "server_learning_rate": 0.8},
                   "fedavg_global_alignment": {"alignment_iterations": 2}, "feddg_ga": {"step_size": 0.3},
                   "fedomg": {"search_radius": 0.4}, "trimmed_mean": {"trimmed_fraction": 0.2},
                   "krum": {"byzantine_clients": 1}, "multi_krum": {"byzantine_clients": 1}}


def tiny_model() -> nn.Module:
    """A linear layer and a BatchNorm (float buffers and an integer one), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def client_arrays(current: dict[str, torch.Tensor], client: int, round_number: int) -> dict[str, torch.Tensor]:
    """A client's trained arrays: the model moved by a random update of its own (so that some
    clients' updates conflict), its BatchNorm statistics and step count changed."""
    generator = torch.Generator().manual_seed(100 * round_number + client)
    arrays = {}
    for name, tensor in current.items():
        if tensor.is_floating_point():
            arrays[name] = tensor + 0.1 * torch.randn(tensor.shape, generator=generator)
        else:
            arrays[name] = tensor + client + 1
    return arrays


def instruction(node: int) -> Message:
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=0, dst_node_id=node, reply_to_message_id="",
                        group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")
    return Message(RecordDict(), metadata=metadata)


def reply_message(node: int, arrays: dict[str, torch.Tensor], metrics: dict[str, float | int]) -> Message:
    """A client's reply as Flower delivers it: one ArrayRecord, one MetricRecord."""
    content = RecordDict({"arrays": ArrayRecord({k: v.contiguous() for k, v in arrays.items()}),
                          "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=instruction(node))


@pytest.fixture
def server_identity(monkeypatch):
    """The identity Flower's ``Message`` constructor reads, which a running ServerApp sets: these
    tests call the strategies' ``configure_train`` outside one."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


class NodesOnly:
    """The part of a Flower Grid that FedAvg's ``configure_train`` asks: the connected nodes."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def fedbed_server(rule: str, model: nn.Module, rounds: int, clients: list[int]):
    """FedBed's own server for ``rule`` (the method's strategy, or FedAvg's holding the robust rule)."""
    if rule in ROBUST_RULES:
        strategy = FedAvgStrategy(SEED, RobustAggregation(rule, **HYPERPARAMETERS.get(rule, {})))
    else:
        algorithm = registered_algorithm(rule)
        context = AlgorithmContext(model_factory=tiny_model, budget=TrainingBudget(batch_size=1, local_epochs=1),
                                   seed=SEED, rounds=rounds)
        strategy = algorithm.create_strategy(resolve_hyperparameters(algorithm, HYPERPARAMETERS.get(rule, {})), context)
    strategy.initialize(model, [ClientInfo(client, None, ()) for client in clients])
    return strategy


NODES = [11 + 7 * index for index in range(CLIENTS)]
"""The clients' node ids; FedBed's server below calls its clients by the same ids."""


def round_replies(current: dict[str, torch.Tensor], round_number: int) -> dict[int, Reply]:
    """Every client's reply: its trained arrays, weight 10 + its index, a loss, and from round 2
    on its generalization gap (FedDG-GA's)."""
    return {node: Reply(client_arrays(current, node, round_number), 10 + index,
                        {"loss": 1.0, **({"generalization_gap_loss": 0.1 * index - 0.15} if round_number > 1 else {})})
            for index, node in enumerate(NODES)}


@pytest.mark.parametrize("rule", rule_names())
def test_each_strategy_equals_fedbeds_own_server_on_the_same_replies(rule, server_identity):
    rounds = 2
    fedbed_model, flower_model = tiny_model(), tiny_model()
    server = fedbed_server(rule, fedbed_model, rounds, NODES)
    strategy = FedBedStrategy(rule, seed=SEED, num_rounds=rounds, parameter_names=trainable_parameter_names(flower_model),
                              min_available_nodes=CLIENTS, min_train_nodes=CLIENTS, **HYPERPARAMETERS.get(rule, {}))
    arrays = ArrayRecord(flower_model.state_dict())
    for round_number in (1, 2):
        replies = round_replies(fedbed_model.state_dict(), round_number)
        summary = server.aggregate(round_number, replies)
        config = ConfigRecord()
        messages = strategy.configure_train(round_number, arrays, config, NodesOnly(NODES))
        assert sorted(m.metadata.dst_node_id for m in messages) == NODES
        assert ("report_generalization_gap" in config) == (rule == "feddg_ga")  # what FedBed's clients answer
        assert config.get("generalization_gap_samples") == ("training" if rule == "feddg_ga" else None)
        messages = [reply_message(node, reply.arrays, {"num-examples": reply.num_examples, **reply.metrics})
                    for node, reply in reversed(replies.items())]  # in any order
        arrays, metrics = strategy.aggregate_train(round_number, messages)
        received = arrays_from_record(arrays)
        expected = fedbed_model.state_dict()
        assert set(received) == set(expected)
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (rule, round_number, name)
        assert strategy.telemetry[round_number] == summary.telemetry
        assert metrics["loss"] == pytest.approx(1.0)
        # What the rule reads stays out of the averaged metrics (another rule averages it as any metric).
        assert ("generalization_gap_loss" in metrics) == (rule != "feddg_ga" and round_number > 1)
    # The rules differ from FedAvg's average: the test would see an adapter that averaged instead.
    fedavg = fedbed_server("fedavg", tiny_model(), rounds, NODES)
    for round_number in (1, 2):
        fedavg.aggregate(round_number, round_replies(fedavg.model.state_dict(), round_number))
    assert torch.equal(fedavg.model.state_dict()["0.weight"], received["0.weight"]) == (rule == "fedavg")
    if rule == "feddg_ga":  # the weights moved with the gaps, kept across rounds per node
        assert set(strategy.aggregation.state_dict()["weights"]) == set(NODES)
        assert len(set(strategy.telemetry[2]["weights"].values())) == CLIENTS


def test_clients_are_ordered_by_the_id_they_send_and_their_state_is_kept_per_client(server_identity):
    """With ``client_id_key``, the rule sees the clients by the id each reply carries, whatever
    the node ids (a simulation numbers its nodes at random)."""
    model = tiny_model()
    server = fedbed_server("ppdg", model, 2, list(range(CLIENTS)))
    strategy = PPDG(seed=SEED, alignment_lambda=0.2, client_id_key="partition-id",
                    parameter_names=trainable_parameter_names(model))
    current = model.state_dict()
    trained = {client: client_arrays(current, client, 1) for client in range(CLIENTS)}
    server.aggregate(1, {client: Reply(trained[client], 10 + client, {}) for client in range(CLIENTS)})
    strategy.configure_train(1, ArrayRecord(tiny_model().state_dict()), ConfigRecord(), NodesOnly([1, 2]))
    nodes = [9000 - 13 * client for client in range(CLIENTS)]  # node ids in the opposite order
    arrays, metrics = strategy.aggregate_train(1, [reply_message(node, trained[client], {"num-examples": 10 + client,
                                                                                          "partition-id": client})
                                                   for client, node in enumerate(nodes)])
    assert all(torch.equal(arrays_from_record(arrays)[k], v) for k, v in model.state_dict().items())
    assert strategy.telemetry[1]["clients"] == list(range(CLIENTS)) and "partition-id" not in metrics
    # Two replies claiming one client are refused.
    strategy.configure_train(2, arrays, ConfigRecord(), NodesOnly([1, 2]))
    with pytest.raises(InconsistentMessageReplies, match="claim client 0"):
        strategy.aggregate_train(2, [reply_message(node, trained[0], {"num-examples": 1, "partition-id": 0}) for node in (5, 6)])


def test_feddg_ga_stops_with_one_error_naming_the_gap_a_client_did_not_send(server_identity):
    model = tiny_model()
    strategy = FedDGGA(num_rounds=3)
    current = model.state_dict()
    for round_number in (1, 2):
        strategy.configure_train(round_number, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2]))
        replies = [reply_message(node, client_arrays(current, node, round_number), {"num-examples": 5}) for node in (1, 2)]
        if round_number == 1:  # no client has a model of its own yet: no gap expected
            arrays, _ = strategy.aggregate_train(round_number, replies)
            assert arrays is not None
    with pytest.raises(InconsistentMessageReplies, match=r"'generalization_gap_loss'.*client\(s\) 1, 2 in round 2.*"
                                                          r"report_generalization_gap"):
        strategy.aggregate_train(2, replies)
    # A client new in round 2 (partial participation) sends none, beside one that sends it: accepted.
    strategy = FedDGGA(num_rounds=3)
    strategy.configure_train(1, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2]))
    strategy.aggregate_train(1, [reply_message(1, client_arrays(current, 1, 1), {"num-examples": 5})])
    strategy.configure_train(2, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2]))
    arrays, _ = strategy.aggregate_train(2, [reply_message(1, client_arrays(current, 1, 2), {"num-examples": 5,
                                                                                             "generalization_gap_loss": 0.3}),
                                             reply_message(2, client_arrays(current, 2, 2), {"num-examples": 5})])
    assert arrays is not None
    # Its step decays over the run's rounds: without them (neither given nor from start()) it says so.
    with pytest.raises(AggregationError, match="num_rounds"):
        FedDGGA().configure_train(1, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2]))


def test_a_round_the_rule_cannot_take_keeps_the_model_and_replies_must_fit_it(caplog, server_identity):
    model = tiny_model()
    current = model.state_dict()
    strategy = FedBedStrategy("krum", byzantine_clients=1)
    strategy.configure_train(1, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2, 3]))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply_message(n, client_arrays(current, n, 1), {"num-examples": 5, "loss": 2.0})
                                                       for n in (1, 2, 3)])
    assert arrays is None and metrics["loss"] == 2.0  # Flower's start() then keeps the previous model
    assert "keeps the previous model" in caplog.text and "2f + 3" in caplog.text
    strategy = PPDG()
    strategy.configure_train(1, ArrayRecord(current), ConfigRecord(), NodesOnly([1, 2]))
    wrong = {**client_arrays(current, 1, 1), "0.weight": torch.zeros(2, 3)}
    with pytest.raises(InconsistentMessageReplies, match=r"node 1 returns array '0.weight' as \(2, 3\)"):
        strategy.aggregate_train(1, [reply_message(1, wrong, {"num-examples": 5}),
                                     reply_message(2, client_arrays(current, 2, 1), {"num-examples": 5})])
    with pytest.raises(AggregationError, match="configure_train must run"):
        PPDG().aggregate_train(1, [reply_message(1, current, {"num-examples": 5})])


@pytest.mark.parametrize("rule, options, message", [
    ("fedgala", {}, "fedgala is not a server rule: .*'fedavg_global_alignment'"),
    ("hfedf", {}, "hfedf is not a server rule: hfedf generates each client's weights"),
    ("mcgdm+fedomg", {}, "composed method .* 'fedomg'"),
    ("fedsr", {}, "fedsr is not a server rule: .*only FedBed's own clients"),
    ("krumm", {}, "unknown server rule 'krumm'; the rules are .*multi_krum"),
    ("ppdg", {"client_lr": 0.1}, "'client_lr' is a client optimiser's hyperparameter"),
    ("fedgma", {"alignment_lambda": 0.1}, "'alignment_lambda' is not one of its hyperparameters; .*mask_threshold"),
    ("median", {"trimmed_fraction": 0.1}, "median has no hyperparameter 'trimmed_fraction'"),
    ("trimmed_mean", {"trimmed_fraction": 0.5}, r"trimmed_fraction must lie in \(0, 0.5\)"),
    ("fedomg", {"search_radius": -1}, "search_radius"),
    ("feddg_ga", {"gap_samples": "test"}, "gap_samples"),
])
def test_what_no_strategy_can_be_is_refused_in_one_line(rule, options, message):
    with pytest.raises(AlgorithmError, match=message) as error:
        FedBedStrategy(rule, **options)
    assert "\n" not in str(error.value)


# ---- A plain PyTorch Flower app (no FedBed on the clients) with PPDG, then FedDG-GA, on Flower's simulation ----

FEATURES, CLASSES, SAMPLES, PLAIN_CLIENTS = 6, 3, 24, 3


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))


def partition_data(partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A partition's random data, whose labels follow a rule of its own (the class of the largest
    of the first features, shifted by the partition): the clients' updates conflict."""
    generator = torch.Generator().manual_seed(7 + partition)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    return inputs, (inputs[:, :CLASSES].argmax(dim=1) + partition) % CLASSES


def loss_on(arrays: dict[str, torch.Tensor], partition: int) -> float:
    """The loss of a model on a partition's data."""
    model = plain_model()
    model.load_state_dict(arrays)
    inputs, labels = partition_data(partition)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(inputs), labels))


def local_training(arrays: dict[str, torch.Tensor], partition: int) -> tuple[dict[str, torch.Tensor], float]:
    """Two SGD steps on the partition's data: the trained arrays and their loss there."""
    model = plain_model()
    model.load_state_dict(arrays)
    inputs, labels = partition_data(partition)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    trained = {k: v.detach() for k, v in model.state_dict().items()}
    return trained, loss_on(trained, partition)


plain_client = ClientApp()


@plain_client.train()
def plain_train(message: Message, context: Context) -> Message:
    """A plain Flower client: trains, sends its arrays, weight and loss, and, when the server asks
    (FedDG-GA), its generalization gap: the received model's loss on its data minus that of its
    own model after its previous round (kept in the node's state)."""
    partition = int(context.node_config["partition-id"])
    received = message.content["arrays"].to_torch_state_dict()
    metrics = {"num-examples": SAMPLES, "partition-id": partition}
    if message.content["config"].get("report_generalization_gap") and "previous" in context.state.metric_records:
        metrics["generalization_gap_loss"] = loss_on(received, partition) - context.state["previous"]["loss"]
    trained, loss = local_training(received, partition)
    context.state["previous"] = MetricRecord({"loss": loss})
    return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({**metrics, "loss": loss})}),
                   reply_to=message)


def fedbed_rounds(rule: str, hyperparameters: dict, start: dict[str, torch.Tensor], rounds: int,
                  previous_losses: dict[int, float]) -> tuple[dict[str, torch.Tensor], dict[int, dict]]:
    """The plain clients' rounds recomputed here, combined by FedBed's own server for ``rule``:
    the final model and each round's telemetry."""
    algorithm = registered_algorithm(rule)
    server = algorithm.create_strategy(resolve_hyperparameters(algorithm, hyperparameters),
                                       AlgorithmContext(model_factory=plain_model, seed=SEED, rounds=rounds,
                                                        budget=TrainingBudget(batch_size=SAMPLES, local_steps=2)))
    model = plain_model()
    model.load_state_dict(start)
    server.initialize(model, [ClientInfo(client, SAMPLES, (client,)) for client in range(PLAIN_CLIENTS)])
    telemetry = {}
    for round_number in range(1, rounds + 1):
        payloads, replies = server.configure_round(round_number, list(range(PLAIN_CLIENTS))), {}
        for client, payload in payloads.items():
            metrics = ({"generalization_gap_loss": loss_on(payload.arrays, client) - previous_losses[client]}
                       if payload.config.get("report_generalization_gap") else {})
            trained, previous_losses[client] = local_training(payload.arrays, client)
            replies[client] = Reply(trained, SAMPLES, metrics)
        telemetry[round_number] = server.aggregate(round_number, replies).telemetry
    return model.state_dict(), telemetry


def simulate(server_app: ServerApp, client_app: ClientApp, nodes: int) -> None:
    """Flower's simulation engine as ``fedbed.flower.simulation`` runs it (offline, one CPU per client actor)."""
    import os

    from flwr.simulation import run_simulation

    os.environ.update(OFFLINE_ENVIRONMENT)
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0},
                                   "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False,
                                                 "log_to_driver": False}})


def test_a_plain_pytorch_flower_app_trains_with_ppdg_and_feddg_ga_on_the_simulation():
    """One round of each strategy (every round of Flower's simulation costs several seconds on a
    busy machine); the hand-made replies of the tests above cover the later rounds' arithmetic."""
    rounds = 1
    outcome = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes = {"client_id_key": "partition-id", "min_available_nodes": PLAIN_CLIENTS, "min_train_nodes": PLAIN_CLIENTS,
                 "fraction_evaluate": 0.0}
        outcome["ppdg"] = PPDG(alignment_lambda=0.2, seed=SEED, **nodes)
        outcome["ppdg result"] = outcome["ppdg"].start(grid=grid, initial_arrays=ArrayRecord(plain_model().state_dict()),
                                                       num_rounds=rounds)
        # Its rounds come from start(); its first round's gaps already read the local risks the
        # clients kept in their node state during PPDG's rounds.
        outcome["feddg_ga"] = FedDGGA(seed=SEED, **nodes)
        outcome["feddg_ga result"] = outcome["feddg_ga"].start(grid=grid, initial_arrays=outcome["ppdg result"].arrays,
                                                               num_rounds=rounds)

    simulate(server, plain_client, nodes=PLAIN_CLIENTS)
    metrics = outcome["ppdg result"].train_metrics_clientapp
    assert sorted(metrics) == list(range(1, rounds + 1)) and set(metrics[1]) == {"loss"}  # the client id is no metric to average
    # The same rounds recomputed here with FedBed's own servers: the same models and telemetry, bit for bit.
    previous_losses = {}
    expected, telemetry = fedbed_rounds("ppdg", {"alignment_lambda": 0.2}, plain_model().state_dict(), rounds, previous_losses)
    assert outcome["ppdg"].telemetry == telemetry
    assert any(any(telemetry[r]["aligned_clients"]) for r in telemetry)  # PPDG aligned conflicting updates
    final = arrays_from_record(outcome["ppdg result"].arrays)
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())
    expected, telemetry = fedbed_rounds("feddg_ga", {}, expected, rounds, previous_losses)
    assert outcome["feddg_ga"].telemetry == telemetry
    assert all(len(set(telemetry[r]["weights"].values())) == PLAIN_CLIENTS for r in telemetry)  # the gaps moved the weights
    final = arrays_from_record(outcome["feddg_ga result"].arrays)
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())


# ---- The README's example app, its messages carried in this process ----

class InProcessGrid:
    """The part of a Flower Grid that ``Strategy.start`` calls, answering each message with a
    ClientApp in this process (one node per partition, each with its own state)."""

    def __init__(self, client_app: ClientApp, nodes: int) -> None:
        self.client_app = client_app
        self.contexts = {100 + partition: Context(run_id=1, node_id=100 + partition, state=RecordDict(), run_config={},
                                                  node_config={"partition-id": partition, "num-partitions": nodes})
                         for partition in range(nodes)}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        return [self.client_app(message, self.contexts[message.metadata.dst_node_id]) for message in messages]


def test_the_readmes_flower_app_runs_with_its_messages_carried_in_this_process(server_identity, tmp_path, monkeypatch, capsys):
    text = README.read_text()
    block = re.search(r"## Using FedBed's methods in your Flower app\n.*?```python\n(.*?)```", text, flags=re.S).group(1)
    namespace = {"__name__": "readme_app"}  # not "__main__": the simulation is not started
    exec(compile(block, "README.md", "exec"), namespace)
    monkeypatch.chdir(tmp_path)
    namespace["main"](InProcessGrid(namespace["client_app"], nodes=3), Context(run_id=1, node_id=0, node_config={},
                                                                               state=RecordDict(), run_config={}))
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("{1: [") and "True" in printed  # PPDG aligned the conflicting updates
    saved = torch.load(tmp_path / "ppdg_model.pt")
    assert set(saved) == set(namespace["make_model"]().state_dict())
    # Its pyproject.toml names these two apps of app.py (what `flwr run .` loads).
    project = tomllib.loads(re.search(r"beside it the App's `pyproject.toml`:\n\n```toml\n(.*?)```", text, flags=re.S).group(1))
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "app:server_app", "clientapp": "app:client_app"}
    assert isinstance(namespace["server_app"], ServerApp) and isinstance(namespace["client_app"], ClientApp)


# ---- FedBed's own trainer on the clients: the same numbers as FedBed's in-process run ----

def fedbed_config(run_dir) -> ExperimentConfig:
    """Two clients of RotatedMNIST (embedded sample, LeNet), two rounds of two steps."""
    return ExperimentConfig(dataset="RotatedMNIST", model="lenet", target="0", algorithm="ppdg", rounds=2, local_steps=2,
                            batch_size=16, partition="domains_per_client", num_clients=2, domains_per_client=3, seed=3,
                            run_dir=run_dir, hp={"alignment_lambda": 0.3})


@functools.lru_cache(maxsize=1)
def fedbed_client_side(config_json: str):
    """The built run and FedBed's trainer, once per process serving clients (building loads the data)."""
    built = build_run(ExperimentConfig.model_validate_json(config_json))
    return built, built.trainer()


def fedbed_client_app(config_json: str) -> ClientApp:
    """A Flower ClientApp training with FedBed's own trainer on FedBed's partition: the payload
    the engine would send (its batch seed from the run's seed, the round and the client) out of
    a plain Flower message. PPDG's clients (FedAvg's) keep no state between rounds."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        built, trainer = fedbed_client_side(config_json)
        client, round_number = int(context.node_config["partition-id"]), int(message.content["config"]["server-round"])
        config = {**dict(message.content["config"]), "round": round_number, "rounds": built.config.rounds,
                  "client": client, "batch_seed": derive_seed(built.config.seed, round_number, client)}
        reply = fit_client(trainer, Payload(arrays_from_record(message.content["arrays"]), config),
                           built.client_data(client), {})
        metrics = MetricRecord({"loss": reply.metrics["loss"], "num-examples": reply.num_examples, "partition-id": client})
        return Message(RecordDict({"arrays": ArrayRecord(reply.arrays), "metrics": metrics}), reply_to=message)

    return app


def test_with_fedbeds_trainer_on_the_clients_ppdg_equals_the_in_process_run_bit_for_bit(tmp_path, monkeypatch,
                                                                                       server_identity):
    """Flower's strategy loop (``PPDG.start``) with FedBed's trainer in a Flower ClientApp, the
    messages carried in this process (Flower's simulation carries them in the plain app's test
    above): the final model and each round's telemetry equal the in-process run's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(fedbed_config(tmp_path / "in-process"), progress=False, echo=lambda *_: None)
        config = fedbed_config(tmp_path / "flower")
        built = build_run(config)
        strategy = PPDG(alignment_lambda=built.hparams.alignment_lambda, seed=config.seed, client_id_key="partition-id",
                        parameter_names=trainable_parameter_names(built.initial_model), fraction_evaluate=0.0)
        result = strategy.start(grid=InProcessGrid(fedbed_client_app(config.model_dump_json()), nodes=2),
                                initial_arrays=ArrayRecord(built.initial_model.state_dict()), num_rounds=config.rounds)
        outcome = {"result": result, "strategy": strategy}
    finally:
        torch.set_num_threads(threads)
    expected = torch.load(tmp_path / "in-process" / CHECKPOINT_NAME, weights_only=False)["strategy"]["model"]
    final = arrays_from_record(outcome["result"].arrays)
    assert set(final) == set(expected)
    assert all(final[name].dtype == tensor.dtype and torch.equal(final[name], tensor) for name, tensor in expected.items())
    records = [json.loads(line) for line in (tmp_path / "in-process" / LOG_NAME).read_text().splitlines()]
    assert [outcome["strategy"].telemetry[r["round"]] for r in records] == [r["telemetry"] for r in records]
