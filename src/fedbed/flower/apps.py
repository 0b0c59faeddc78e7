"""The Flower ServerApp and ClientApp that run any registered FedBed method.

The ServerApp builds the run from its :class:`~fedbed.experiment.ExperimentConfig` (the seed fixes
split, partitions and initial model) and drives the ordinary engine
(:func:`fedbed.experiment.execute_run`) with :class:`FlowerClients` as its transport: each
round, every selected client gets its own message (``dst_node_id``), so methods that send
different arrays to different clients (hFedF, pFedHN) work unchanged. The target domain is
scored on the server; the id holdouts too by default (Flower's centralised evaluation), or, with
``id_evaluation: clients``, by each site on its own holdout share through ``evaluate`` messages
(Flower's federated evaluation; :mod:`fedbed.federation.client_evaluation`).

Each ClientApp is one FedBed client: its id is the ``partition-id`` of its node's
``node_config``; it builds only its own partition's training data from its own data root and
keeps its persistent client state (SCAFFOLD's control variate, FedSR's priors, ...) in
``context.state``, which never leaves the node. Messages carry only parameters and scalar
metrics (:mod:`fedbed.flower.records`).

The experiment config reaches the apps (the module-level ``server_app`` and ``client_app``,
which ``flwr run`` loads on both Flower backends) as the run config keys ``fedbed.<setting>``.
The settings travel already validated: the
process that submits the run validated them once (:func:`fedbed.config.validate`), and they
carry its marker, their digest (:attr:`fedbed.config.ValidatedConfig.digest`; the run config key
:data:`VALIDATED_KEY`). Each app process, on this machine or another, parses them and, when the
digest matches, only looks up what building the run needs (dataset spec, its own data root,
method, hyperparameters: :func:`fedbed.config.validated_settings`), refusing nothing again;
settings without the marker or changed after validation (``flwr run --run-config``) are validated there.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import time
from logging import INFO, WARNING
from typing import Any, Callable

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import LOGGER_NAME
from flwr.common.logger import log as flower_log
from flwr.serverapp import Grid, ServerApp

from fedbed.build import BuiltRun, build_run
from fedbed.config import (
    ConfigError,
    ExperimentConfig,
    config_from_mapping,
    validated_settings,
)
from fedbed.experiment import execute_run
from fedbed.federation import phase_timings
from fedbed.federation.checkpoints import EngineError
from fedbed.federation.devices import HOST
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.run_log import round_line
from fedbed.federation.transport import ClientTransport, TransportError, fit_client, trained_on
from fedbed.flower.common import FlowerError, key_fingerprint
from fedbed.flower.records import (
    payload_from_records,
    payload_to_records,
    reply_device,
    reply_from_records,
    reply_to_records,
)

SETTING_PREFIX = "fedbed."
"""Prefix of the run-config keys holding the experiment's settings, one key per setting
(``fedbed.rounds``, ``fedbed.hp.mu``: nested settings as dotted keys, as Flower flattens TOML
tables), so ``flwr run --run-config "fedbed.rounds=40"`` overrides one of them."""
BACKEND_KEY = "fedbed-backend"
"""Run-config key naming the backend in the run's summary."""
ROUND_TIMEOUT_KEY = "fedbed-round-timeout"
"""Run-config key: seconds to wait for a round's replies before dropping the silent clients."""
DISCOVERY_TIMEOUT_KEY = "fedbed-discovery-timeout"
"""Run-config key: seconds the ServerApp waits for every site to say its client id
(:class:`FlowerClients`) before the run goes on without the missing ones."""
DISCOVERY_TIMEOUT = 600.0
"""Default of :data:`DISCOVERY_TIMEOUT_KEY`, in seconds."""
DISCOVERY_REPORT_SECONDS = 30.0
"""While discovery waits, a line every this many seconds (or four in all when the timeout is shorter)."""
SITE_KEYS_KEY = "fedbed-site-keys"
"""Run-config key: the fingerprints of the sites' registered public keys in partition-id order (a
JSON list, :func:`fedbed.flower.common.key_fingerprint`): client K is only the SuperNode signing
with site K's key (:class:`FlowerClients`)."""
VALIDATED_KEY = "fedbed-validated"
"""Run-config key: the digest of the settings that were validated where the run was submitted
(:attr:`fedbed.config.ValidatedConfig.digest`), so that the apps do not validate them again."""
STATE_RECORD = "fedbed-client-state"
POLL_SECONDS = 0.1
"""How often the server asks the SuperLink for replies."""
PARTITION_ID = "partition-id"


@functools.lru_cache(maxsize=2)
def cached_run(config_json: str, digest: str | None = None) -> BuiltRun:
    """The run of an experiment config (JSON), built once per process (building loads the
    dataset), the run's identity (its settings and their digest) the key: Flower's simulation
    engine keeps its ClientApp actors alive across the run, and FedBed's deployments run each
    SuperNode's messages in one long-running process (:mod:`fedbed.flower.clientapp_process`), so
    each builds it once, on its first message, and each client's share on that client's first
    message (``_client``, which keeps the last 8 clients a process served: an actor serving more
    builds a client's trainer and data view again, 2 ms for LeNet);
    only under Flower's own per-message ClientApp processes (a SuperNode started with
    ``--isolation subprocess``) is it built again for every message.

    Args:
        config_json: the settings.
        digest: the marker that they were validated where the run was submitted
            (:attr:`fedbed.config.ValidatedConfig.digest`): they are then not validated again
            (:func:`fedbed.config.validated_settings`); ``None``: they are validated here.

    Raises:
        ConfigError: as :func:`fedbed.build.build_run`.
    """
    return build_run(validated_settings(ExperimentConfig.model_validate_json(config_json), digest))


def _checked_run(config_json: str, client: int, digest: str | None) -> BuiltRun:
    built = cached_run(config_json, digest)
    if not 0 <= client < len(built.partitions):
        raise FlowerError(f"partition-id {client} is out of range: this run has {len(built.partitions)} clients (0..{len(built.partitions) - 1})")
    return built


@functools.lru_cache(maxsize=8)
def _client(config_json: str, client: int, digest: str | None) -> tuple[Any, Any]:
    """The method's client half and the training data of one client, built once per process."""
    built = _checked_run(config_json, client, digest)
    return built.trainer(), built.client_data(client)


@functools.lru_cache(maxsize=8)
def _client_evaluation(config_json: str, client: int, digest: str | None) -> tuple[Any, Any]:
    """The client half of id evaluation and one client's holdout share, built once per process."""
    built = _checked_run(config_json, client, digest)
    return built.evaluator(), built.client_holdout(client)


def client_id_of(context: Context) -> int:
    """The FedBed client id of a node: its ``node_config["partition-id"]``.

    Raises:
        FlowerError: the node was started without ``--node-config "partition-id=K"``.
    """
    if PARTITION_ID not in context.node_config:
        raise FlowerError('this SuperNode has no partition-id: start it with --node-config "partition-id=K num-partitions=N"')
    return int(context.node_config[PARTITION_ID])


def _load_state(context: Context) -> dict[str, Any]:
    record = context.state.config_records.get(STATE_RECORD)
    if record is None:
        return {}
    return torch.load(io.BytesIO(record["state"]), map_location=HOST, weights_only=False)


def _save_state(context: Context, state: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    context.state[STATE_RECORD] = ConfigRecord({"state": buffer.getvalue()})


def client_train(message: Message, context: Context, config_json: str, digest: str | None = None) -> Message:
    """One round of local training on this node (Flower's ``train`` message); ``digest`` as
    :func:`cached_run`'s.

    The reply carries the trained arrays and the metrics (``num_examples`` among them) and
    nothing else; the client's persistent state stays in ``context.state``.
    """
    phase_timings.record_process_start("client")
    client = client_id_of(context)
    with phase_timings.timed("handling", "client", client=client, message_id=message.metadata.message_id,
                             message_type="train"):
        trainer, data = _client(config_json, client, digest)
        state = _load_state(context)
        reply = fit_client(trainer, payload_from_records(message.content), data, state)
        _save_state(context, state)
        return Message(reply_to_records(reply, trained_on(trainer)), reply_to=message)


def client_evaluate(message: Message, context: Context, config_json: str, digest: str | None = None) -> Message:
    """Score the received models on this node's id-holdout share (Flower's ``evaluate`` message;
    ``digest`` as :func:`cached_run`'s).

    The reply carries sums only (sample, correct and per-class prediction counts per model and
    domain; see :func:`fedbed.federation.evaluation.metric_statistics`), never a sample or its
    prediction.
    """
    phase_timings.record_process_start("client")
    client = client_id_of(context)
    with phase_timings.timed("handling", "client", client=client, message_id=message.metadata.message_id,
                             message_type="evaluate"):
        evaluator, holdout = _client_evaluation(config_json, client, digest)
        return Message(reply_to_records(evaluator.evaluate(payload_from_records(message.content), holdout)),
                       reply_to=message)


def client_query(message: Message, context: Context) -> Message:
    """Tell the server which FedBed client this node is (Flower's ``query`` message)."""
    phase_timings.record_process_start("client")
    return Message(RecordDict({"node": ConfigRecord({PARTITION_ID: client_id_of(context)})}), reply_to=message)


class FlowerClients(ClientTransport):
    """The engine's transport over a Flower Grid: one message per selected client.

    Discovery: every SuperNode that connects is asked which FedBed client it is (its
    ``partition-id``), until each of the run's clients has answered or ``discovery_timeout``
    seconds have passed. While it waits, a line names the partitions still missing (every
    :data:`DISCOVERY_REPORT_SECONDS`); a SuperNode that leaves or fails before answering is
    named and the wait goes on (another may take its place). Past the timeout the run goes on
    without the missing clients: like a site lost mid-run, each is dropped from every round with
    its reason in ``rounds.jsonl`` (a method that needs every client then stops at round 1 with one
    message naming them).

    With ``site_keys``, a SuperNode is taken as client K only if it signs with site K's
    registered key (Flower's SuperNode authentication; its public key as the SuperLink holds it):
    any other node claiming that partition-id is named and takes no part, also one whose key was
    registered by somebody else (Flower 1.41's open-source SuperLink registers keys for anybody
    who reaches its Control API).

    Args:
        grid: the ServerApp's grid.
        num_clients: clients of the run (partition-ids ``0 .. num_clients - 1``).
        round_timeout: seconds to wait for a round's replies; a client without a reply by then
            (its node was lost) is dropped from the round with that reason.
        discovery_timeout: seconds to wait for every client's SuperNode to connect and answer.
        echo: where discovery's lines go.
        site_keys: per client (partition-id order), the fingerprint of its site's registered
            public key (:func:`fedbed.flower.common.key_fingerprint`); ``None``: any node may
            claim any partition-id.

    Raises:
        FlowerError: no client answered within ``discovery_timeout``, two connected SuperNodes
            claim one partition-id, or ``site_keys`` does not hold one key per client.
    """

    def __init__(self, grid: Grid, num_clients: int, round_timeout: float = 3600.0,
                 discovery_timeout: float = DISCOVERY_TIMEOUT, echo: Callable[..., Any] = print,
                 site_keys: list[str] | None = None) -> None:
        self.grid, self._num_clients, self.round_timeout = grid, num_clients, round_timeout
        self.round_number = 0
        self.client_devices = {}
        self.discovery_timeout = discovery_timeout
        if site_keys is not None and len(site_keys) != num_clients:
            raise FlowerError(f"this run has {num_clients} clients, and {len(site_keys)} site keys were given: give one "
                              "registered public key per site, in partition-id order")
        self.site_keys = site_keys
        self.node_of = self._discover(discovery_timeout, echo)

    @property
    def num_clients(self) -> int:
        return self._num_clients

    def _discover(self, timeout: float, echo: Callable[..., Any]) -> dict[int, int]:
        """Ask each connecting SuperNode its partition-id until all answered or ``timeout``
        passed (see the class); return client -> node id of those that answered."""
        began = time.monotonic()
        report_every = min(DISCOVERY_REPORT_SECONDS, timeout / 4)
        next_report = began + report_every
        node_of: dict[int, int] = {}
        asked: dict[str, int] = {}  # query message id -> node, not answered yet
        queried: set[int] = set()
        while True:
            connected = set(self.grid.get_node_ids())
            new = sorted(connected - queried)
            if new:
                queries = [Message(RecordDict(), dst_node_id=node, message_type="query", group_id="discover") for node in new]
                self.grid.push_messages(queries)  # stamps each query with its message id
                asked.update({query.metadata.message_id: node for query, node in zip(queries, new)})
                queried.update(new)
            for reply in self.grid.pull_messages(list(asked)) if asked else ():
                node = asked.pop(reply.metadata.reply_to_message_id, None)
                if node is None:
                    continue
                if reply.has_error():  # the node left (an error reply from the SuperLink), or its ClientApp failed
                    echo(f"discovery: SuperNode {node} did not say its client id: {reply.error.reason}")
                    if node not in connected:
                        queried.discard(node)  # asked again should it come back
                    continue
                client = int(reply.content.config_records["node"][PARTITION_ID])
                held_by = node_of.get(client)
                if not 0 <= client < self._num_clients:
                    echo(f"discovery: SuperNode {node} has partition-id {client}, outside this run's 0..{self._num_clients - 1}; "
                         "it takes no part")
                elif self.site_keys is not None and self._key_of(node) != self.site_keys[client]:
                    echo(f"discovery: SuperNode {node} claims partition-id {client} without site {client}'s registered key "
                         f"(its key: {self._key_of(node) or 'none'}); it takes no part")
                elif held_by is not None and held_by in connected:
                    raise FlowerError(f"SuperNodes {held_by} and {node} both have partition-id {client}: start each site's "
                                      f'SuperNode with its own --node-config "partition-id=K num-partitions={self._num_clients}"')
                else:
                    node_of[client] = node
            missing = [client for client in range(self._num_clients) if client not in node_of]
            now = time.monotonic()
            if not missing or now >= began + timeout:
                break
            if now >= next_report:
                echo(f"discovery: {len(node_of)} of {self._num_clients} sites said their client id; waiting for partition-id "
                     f"{', '.join(map(str, missing))} ({len(connected)} SuperNode(s) connected, {len(asked)} not answering yet); "
                     f"{began + timeout - now:.0f} s left")
                next_report += report_every
            time.sleep(POLL_SECONDS)
        if len(missing) == self._num_clients:
            raise FlowerError(f"no SuperNode said its client id within {timeout:g} s ({len(connected)} connected): start "
                              f'one SuperNode per site with --node-config "partition-id=K num-partitions={self._num_clients}" '
                              "running FedBed's ClientApp")
        if missing:
            echo(f"discovery: no SuperNode said it holds partition-id {', '.join(map(str, missing))} within {timeout:g} s; "
                 f"the run goes on without {'it' if len(missing) == 1 else 'them'} (dropped from every round, rounds.jsonl 'dropped')")
        elif time.monotonic() >= began + report_every:
            echo(f"discovery: all {self._num_clients} sites said their client id after {time.monotonic() - began:.0f} s")
        return node_of

    def _key_of(self, node: int) -> str | None:
        """The fingerprint of the public key ``node`` signs with, as the SuperLink holds it (``None``: none)."""
        public_key = next((info.public_key for info in self.grid.get_nodes() if info.node_id == node), b"")
        try:
            return key_fingerprint(public_key) if public_key else None
        except ValueError:
            return None

    def fit_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        self.round_number = next((int(p.config["round"]) for p in payloads.values() if "round" in p.config),
                                 self.round_number + 1)
        return self._send(payloads, "train", str(self.round_number))

    def evaluate_round(self, payloads: dict[int, Payload]) -> dict[int, Reply | str]:
        return self._send(payloads, "evaluate", f"{self.round_number}-evaluate")

    def _send(self, payloads: dict[int, Payload], message_type: str, group_id: str) -> dict[int, Reply | str]:
        """One message of ``message_type`` per client; per client its reply or why there is none."""
        connected = set(self.grid.get_node_ids())
        outcomes: dict[int, Reply | str] = {
            client: f"no SuperNode said it holds partition-id {client} within the discovery's {self.discovery_timeout:g} s"
            if client not in self.node_of else "its SuperNode left the federation" if self.node_of[client] not in connected
            else f"no reply from its SuperNode within {self.round_timeout:.0f} s (lost or too slow)"
            for client in payloads
        }
        reachable = {client: payload for client, payload in payloads.items() if self.node_of.get(client) in connected}
        sent = {
            client: Message(payload_to_records(payload), dst_node_id=self.node_of[client], message_type=message_type,
                            group_id=group_id)
            for client, payload in reachable.items()
        }
        if not sent:
            return outcomes
        # Pushed and pulled here rather than with the grid's send_and_receive, which polls every
        # 3 s: a round trip costs Flower's latency only once. The grid stamps each sent message
        # with its id; a reply names the message it answers (an error reply for a lost node comes
        # from the SuperLink, not from the node).
        pushed_at = time.time()
        self.grid.push_messages(list(sent.values()))
        client_of = {message.metadata.message_id: client for client, message in sent.items()}
        pending, deadline = set(client_of), time.monotonic() + self.round_timeout
        while pending and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(pending)):
                client = client_of.get(reply.metadata.reply_to_message_id)
                if client is None:
                    continue
                pending.discard(reply.metadata.reply_to_message_id)
                phase_timings.record("exchange", time.time() - pushed_at, pushed_at, "server", client=client,
                                     message_id=reply.metadata.reply_to_message_id, message_type=message_type)
                outcomes[client] = (f"its SuperNode returned an error: {reply.error.reason}" if reply.has_error()
                                    else reply_from_records(reply.content))
                if not reply.has_error() and message_type == "train" and reply_device(reply.content) is not None:
                    self.client_devices[client] = reply_device(reply.content)
            if pending:
                time.sleep(POLL_SECONDS)
        return outcomes


def server_main(grid: Grid, config_json: str, backend: str, progress: bool = False, echo: Callable[..., Any] = print,
                round_timeout: float = 3600.0, digest: str | None = None, discovery_timeout: float = DISCOVERY_TIMEOUT,
                round_lines: bool = False, site_keys: list[str] | None = None) -> dict[str, Any]:
    """The ServerApp's body: build the run (``digest`` as :func:`cached_run`'s), reach its clients
    through ``grid`` (:class:`FlowerClients`, with ``round_timeout`` and ``discovery_timeout``
    in seconds and the sites' registered keys ``site_keys``), run the rounds, write the run
    directory; return the summary (as :func:`fedbed.experiment.run_experiment`). With
    ``round_lines``, each round is also said in one line through ``echo``
    (:func:`fedbed.federation.run_log.round_line`): for logs that show no progress bar."""
    phase_timings.record_process_start("server")
    built = cached_run(config_json, digest)
    clients = FlowerClients(grid, len(built.partitions), round_timeout=round_timeout, discovery_timeout=discovery_timeout,
                            echo=echo, site_keys=site_keys)
    on_round = (lambda record: echo(round_line(record, built.config.rounds))) if round_lines else None
    return execute_run(built, built.federation(clients), progress=progress, echo=echo, backend=backend, on_round=on_round)


SAID_IN_ONE_LINE = (TransportError, EngineError, ConfigError)
"""FedBed's errors whose message says what went wrong and what to do: a deployed ServerApp
stopped by one of them logs that message alone (:func:`_one_line_errors`)."""


def _one_line_errors(record: logging.LogRecord) -> bool:
    """A filter on Flower's logger in the ServerApp process: Flower logs an exception that ends a
    ServerApp with its traceback (``flwr run --stream``, ``flwr log``); one of
    :data:`SAID_IN_ONE_LINE` is logged as its message instead."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, SAID_IN_ONE_LINE):
        record.msg, record.args, record.exc_info, record.exc_text = f"ServerApp stopped: {error}", (), None, None
    return True


def _server_log(line: str) -> None:
    """One line of the deployed ServerApp through Flower's logger, which Flower forwards to
    ``flwr run --stream`` and ``flwr log`` (lines starting ``warning:`` at WARNING, others at INFO)."""
    flower_log(WARNING if line.startswith("warning:") else INFO, line)


server_app = ServerApp()
"""The ServerApp for ``flwr run`` (the experiment's settings in the run config's ``fedbed.*`` keys)."""
client_app = ClientApp()
"""The ClientApp for ``flwr run`` (each SuperNode with ``--node-config "partition-id=K"``)."""


def settings_as_run_config(config: ExperimentConfig) -> dict[str, Any]:
    """The settings of ``config`` as flat run-config entries ``fedbed.<setting>`` (nested mappings
    as dotted keys, lists as their JSON text, unset settings left out: TOML has no null)."""
    flat: dict[str, Any] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}", inner)
        elif isinstance(value, list):  # TOML's run config holds no lists: their JSON text
            flat[prefix] = json.dumps(value)
        elif value is not None:
            flat[prefix] = value

    for key, value in config.model_dump(mode="json").items():
        add(f"{SETTING_PREFIX}{key}", value)
    return flat


def config_json_from_run_config(run_config: dict[str, Any]) -> str:
    """The experiment config (as JSON, the key of :func:`cached_run`) rebuilt from the run
    config's ``fedbed.*`` entries (:func:`settings_as_run_config`, with any ``--run-config``
    override applied), parsed (:class:`~fedbed.config.ExperimentConfig`'s own checks of each
    setting; :func:`fedbed.config.validate` is :func:`cached_run`'s, when the digest does not match).

    Raises:
        fedbed.config.ConfigError: an invalid setting.
    """
    settings: dict[str, Any] = {}
    for key, value in run_config.items():
        if not key.startswith(SETTING_PREFIX):
            continue
        *parents, leaf = key.removeprefix(SETTING_PREFIX).split(".")
        target = settings
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return config_from_mapping(settings).model_dump_json()


def digest_of_run_config(run_config: dict[str, Any]) -> str | None:
    """The digest of the validated settings the run config carries (:data:`VALIDATED_KEY`), if any."""
    digest = run_config.get(VALIDATED_KEY)
    return None if digest is None else str(digest)


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    logging.getLogger(LOGGER_NAME).addFilter(_one_line_errors)
    run_config = dict(context.run_config)
    server_main(grid, config_json_from_run_config(run_config), str(run_config.get(BACKEND_KEY, "flower-deployment")),
                echo=_server_log, round_timeout=float(run_config.get(ROUND_TIMEOUT_KEY, 3600.0)),
                digest=digest_of_run_config(run_config),
                discovery_timeout=float(run_config.get(DISCOVERY_TIMEOUT_KEY, DISCOVERY_TIMEOUT)), round_lines=True,
                site_keys=json.loads(str(run_config[SITE_KEYS_KEY])) if SITE_KEYS_KEY in run_config else None)


@client_app.train()
def _deployed_train(message: Message, context: Context) -> Message:
    run_config = dict(context.run_config)
    return client_train(message, context, config_json_from_run_config(run_config), digest_of_run_config(run_config))


@client_app.evaluate()
def _deployed_evaluate(message: Message, context: Context) -> Message:
    run_config = dict(context.run_config)
    return client_evaluate(message, context, config_json_from_run_config(run_config), digest_of_run_config(run_config))


client_app.query()(client_query)
