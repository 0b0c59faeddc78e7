"""FedBed's server rules as Flower strategies, for any Flower app (Flower 1.41's Message API).

A Flower ``ServerApp`` that trains its own model with its own ``ClientApp`` uses one of FedBed's
server rules in place of ``flwr.serverapp.strategy.FedAvg``::

    from fedbed.flower.strategies import PPDG

    strategy = PPDG(alignment_lambda=0.1, min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=10)

Each strategy is a subclass of Flower's ``FedAvg`` (sampling, messages, evaluation and metric
averaging are Flower's) whose :meth:`FedBedStrategy.aggregate_train` hands the round to the
rule's :class:`~fedbed.algorithms.base.model_aggregation.ModelAggregation`, the object FedBed's
own server holds (the method's ``create_aggregation``, or
:class:`~fedbed.algorithms.options.robust_aggregation.RobustAggregation`), so the numbers are
FedBed's: :class:`PPDG`, :class:`PCGrad`, :class:`AgrSum`, :class:`AgrRand`, :class:`FedGMA`,
:class:`GlobalAlignment` (FedGaLA's server), :class:`FedDGGA`, :class:`FedOMG`, and the robust
rules :class:`Median`, :class:`TrimmedMean`, :class:`Krum`, :class:`MultiKrum`;
``FedBedStrategy(rule=NAME, **hyperparameters)`` holds any of them by name (:func:`rule_names`).

What a client must send, as with Flower's FedAvg: one ``ArrayRecord`` holding every array of the
model it received (same names, shapes and dtypes), and one ``MetricRecord`` holding its weight,
``num-examples`` (``weighted_by_key``). Besides:

- **FedDG-GA** reads each client's generalization gap: from its second round on, a client sends
  :data:`~fedbed.algorithms.base.client_reports.GAP_METRICS` ``["loss"]``,
  ``generalization_gap_loss`` = the loss of the global model it received, on its training data,
  minus the loss of its own model at the end of its previous round on the same data (both in
  evaluation mode); with ``gap_metric="accuracy"``, ``generalization_gap_accuracy`` = its previous
  model's accuracy minus the received model's, in percent. The train config carries
  ``report_generalization_gap: 1`` (what FedBed's own clients answer) and
  ``generalization_gap_samples``: ``training``, or ``holdout`` (``gap_samples="holdout"``: both
  losses on the client's id-validation samples instead of its training data). A client that trained in an
  earlier round and sends no gap stops the run with one ``InconsistentMessageReplies`` naming the
  metric and the nodes; in its first round a client sends none.
- The other rules read the arrays and the weight only.

Methods whose clients train in their own way (FedGaLA's local alignment reads the global model's
last change, MCGDM the other clients' heads, FedIIR a mean gradient; hFedF's server generates each
client's weights) are not strategies for any client: asking for one raises one
:class:`~fedbed.algorithms.base.registry.AlgorithmError` saying why and what to use instead
(FedGaLA's server rule alone is ``fedavg_global_alignment``).

Clients are identified by their node id (``message.metadata.src_node_id``), or by a metric the
clients send (``client_id_key``, e.g. ``"partition-id"``); the rules see them in ascending order,
as FedBed's engine does, and a rule's state (FedDG-GA's weights) is kept per client across rounds.
The update rules move the arrays named ``parameter_names`` (default: every floating-point array)
and average the others with the clients' weights; pass the trainable parameters' names
(:func:`~fedbed.algorithms.base.model_aggregation.trainable_parameter_names` of the model) so
that BatchNorm's running statistics are averaged rather than aligned. Random draws (PPDG's and
PCGrad's visiting orders, AgrRand's noise) come from generators seeded from ``seed`` and the
round. A round whose rule cannot work with its replies (a robust rule short of clients) or whose
result is not finite keeps the previous model (``aggregate_train`` returns no arrays, which
Flower's ``start`` loop keeps) and the rule's state, with a warning in Flower's log, as FedBed's
engine does. Each round's telemetry of the rule (weights, masks, coefficients) is in
:attr:`FedBedStrategy.telemetry`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError, InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from fedbed.algorithms import ALGORITHMS, AlgorithmContext, AlgorithmError, TrainingBudget, server_rules
from fedbed.algorithms.base.client_reports import GAP_METRICS, REPORT_GENERALIZATION_GAP
from fedbed.algorithms.base.composition import SEPARATOR, SHARED_FIELDS
from fedbed.algorithms.base.model_aggregation import ClientModels, ModelAggregation
from fedbed.algorithms.base.registry import registered_algorithm, resolve_hyperparameters
from fedbed.algorithms.options.robust_aggregation import (
    DEFAULT_BYZANTINE_CLIENTS,
    DEFAULT_TRIMMED_FRACTION,
    ROBUST_RULES,
    RobustAggregation,
)
from fedbed.federation.messages import Reply
from fedbed.federation.strategy import TooFewReplies
from fedbed.flower.records import arrays_from_record, arrays_to_record
from fedbed.models import DomainClassifier

ROBUST_RULE_OPTIONS = {"median": {}, "trimmed_mean": {"trimmed_fraction": DEFAULT_TRIMMED_FRACTION},
                       "krum": {"byzantine_clients": DEFAULT_BYZANTINE_CLIENTS},
                       "multi_krum": {"byzantine_clients": DEFAULT_BYZANTINE_CLIENTS}}
"""Each robust rule's hyperparameters and their defaults (``fedbed.algorithms.options.robust_aggregation``)."""

REPORTED_METRIC_MEANINGS = {
    GAP_METRICS["loss"]: ("the loss of the global model it received, on its training data (its id-validation samples "
                          "when the train config's 'generalization_gap_samples' is 'holdout'), minus the loss of its "
                          "own model at the end of its previous round on the same data"),
    GAP_METRICS["accuracy"]: ("the accuracy (percent) of its own model at the end of its previous round, on its "
                              "training data (its id-validation samples when the train config's "
                              "'generalization_gap_samples' is 'holdout'), minus that of the global model it received"),
}
"""What a client computes for each metric a rule reads (:meth:`ModelAggregation.reported_metrics`)."""

NOT_A_RULE_HINTS = {"fedgala": "its server's global alignment alone is the rule 'fedavg_global_alignment' (GlobalAlignment)"}
"""For a method that is not a server rule: the rule that holds its server's part, where one does."""


def rule_names() -> list[str]:
    """The rules a :class:`FedBedStrategy` holds: FedBed's server rules, then the robust rules."""
    return [*server_rules(), *ROBUST_RULES]


def _no_model() -> DomainClassifier:
    raise AlgorithmError("a server rule held by a Flower strategy builds no model")


def _not_a_rule(name: str) -> str:
    """Why ``name`` is no rule a Flower strategy can hold, and what to use instead."""
    rules = ", ".join(rule_names())
    if SEPARATOR in name:
        server = name.split(SEPARATOR)[-1]
        return (f"{name!r} is a composed method whose clients are FedBed's; its server rule alone is {server!r} "
                f"(FedBedStrategy(rule={server!r})); the rules are {rules}")
    if name not in ALGORITHMS:
        return f"unknown server rule {name!r}; the rules are {rules}"
    algorithm = ALGORITHMS[name]
    reason = (f"{name} {algorithm.server_rule_refusal}" if algorithm.server_rule_refusal is not None else
              "its server relies on clients that train its own way (its objective, or what its server sends "
              "them), which only FedBed's own clients do")
    hint = f"; {NOT_A_RULE_HINTS[name]}" if name in NOT_A_RULE_HINTS else ""
    return (f"{name} is not a server rule: {reason}{hint}. Run {name} on Flower with FedBed's own apps "
            f"(fedbed run --algorithm {name} --backend flower-sim or flower-deployment); a strategy for any "
            f"client holds one of {rules}")


class FedBedStrategy(FedAvg):
    """One of FedBed's server rules as a Flower 1.41 Message-API strategy (module docstring).

    Args:
        rule: the rule's name, one of :func:`rule_names` (case-insensitive).
        seed: seeds the rule's random draws with the round (FedBed's run seed).
        num_rounds: the run's number of rounds, for a rule whose schedule spans the run
            (FedDG-GA's decaying step); unset, :meth:`start`'s ``num_rounds``.
        parameter_names: the arrays the update rules treat as trainable parameters (default:
            every floating-point array); the others are averaged with the clients' weights.
        client_id_key: a reply metric holding each client's stable id (e.g. ``"partition-id"``);
            unset, the node id. Left out of the aggregated metrics.
        fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
        min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: as for Flower's ``FedAvg``.
        **hyperparameters: the rule's own (``fedbed algorithms NAME`` lists them with their
            defaults and sources, besides the client optimiser's, which a Flower client sets
            itself); a robust rule's: ``trimmed_fraction`` (β, ``trimmed_mean``) or
            ``byzantine_clients`` (f, ``krum`` and ``multi_krum``).

    Attributes:
        aggregation: the rule (its ``state_dict()`` is what it keeps across rounds); ``None``
            until :meth:`start` for a rule whose schedule needs ``num_rounds`` when none was given.
        hyperparameters: the rule's, with their defaults.
        telemetry: per round, the rule's telemetry (weights, masks, coefficients, ``clients``).

    Raises:
        AlgorithmError: an unknown rule; a method that is not a server rule (one line saying
            why and what to use instead); a hyperparameter the rule does not have (a client
            optimiser's among them) or a bad value; ``num_rounds`` below 1.
    """

    def __init__(self, rule: str, *, seed: int = 0, num_rounds: int | None = None,
                 parameter_names: Iterable[str] | None = None, client_id_key: str | None = None,
                 fraction_train: float = 1.0, fraction_evaluate: float = 1.0, min_train_nodes: int = 2,
                 min_evaluate_nodes: int = 2, min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config",
                 train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
                 evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
                 **hyperparameters: Any) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn, evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        if num_rounds is not None and num_rounds < 1:
            raise AlgorithmError(f"num_rounds must be at least 1, got {num_rounds}")
        self.rule, self.seed, self.client_id_key = rule.lower(), seed, client_id_key
        self.parameter_names = None if parameter_names is None else frozenset(parameter_names)
        self.current_arrays: dict[str, torch.Tensor] | None = None
        self.telemetry: dict[int, dict[str, Any]] = {}
        self.trained_clients: set[int] = set()
        self.aggregation: ModelAggregation | None = None
        self._create, self.hyperparameters = self._rule_factory(hyperparameters)
        try:
            self.aggregation = self._create(num_rounds)
        except ValueError:  # a schedule over the run's rounds (FedDG-GA's step), which start() will give
            if num_rounds is not None:
                raise

    def _rule_factory(self, hyperparameters: dict[str, Any]) -> tuple[Callable[[int | None], ModelAggregation], dict[str, Any]]:
        """How to create the rule for a number of rounds, and its hyperparameters with their
        defaults, checked now (:class:`FedBedStrategy`'s errors)."""
        if self.rule in ROBUST_RULES:
            allowed = ROBUST_RULE_OPTIONS[self.rule]
            unknown = sorted(set(hyperparameters) - set(allowed))
            if unknown:
                raise AlgorithmError(f"{self.rule} has no hyperparameter {unknown[0]!r}; its hyperparameters are "
                                     f"{', '.join(allowed) or 'none'}")
            options = {**allowed, **hyperparameters}
            try:
                RobustAggregation(self.rule, **options)
            except ValueError as error:
                raise AlgorithmError(f"{self.rule}: {error}") from None
            return (lambda rounds: RobustAggregation(self.rule, **options)), options
        if self.rule not in server_rules():
            raise AlgorithmError(_not_a_rule(self.rule))
        algorithm = registered_algorithm(self.rule)
        own = [name for name in algorithm.hyperparameters.model_fields if name not in SHARED_FIELDS]
        for name in hyperparameters:
            if name not in own:
                kind = "a client optimiser's hyperparameter, which a Flower client sets itself" if name in SHARED_FIELDS else "not one of its hyperparameters"
                raise AlgorithmError(f"{self.rule}: {name!r} is {kind}; the rule's hyperparameters are {', '.join(own) or 'none'}")
        hparams = resolve_hyperparameters(algorithm, hyperparameters)

        def create(rounds: int | None) -> ModelAggregation:
            context = AlgorithmContext(model_factory=_no_model, budget=TrainingBudget(batch_size=1, local_epochs=1),
                                       seed=self.seed, rounds=rounds)
            return algorithm.create_aggregation(hparams, context)
        return create, hparams.model_dump(include=set(own))

    def _rule(self) -> ModelAggregation:
        if self.aggregation is None:
            raise AggregationError(reason=f"{self.rule}'s schedule spans the run's rounds: give the strategy "
                                          "num_rounds=R, or run it with strategy.start(..., num_rounds=R)")
        return self.aggregation

    def summary(self) -> None:
        """Log the rule and its hyperparameters, then Flower's FedAvg settings."""
        log(INFO, "\t├──> FedBed server rule: %s %s", self.rule, self.hyperparameters)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start``; a rule whose schedule spans the run (FedDG-GA) takes
        ``num_rounds`` from here unless the strategy was given its own."""
        if self.aggregation is None:
            self.aggregation = self._create(num_rounds)
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Flower's FedAvg sampling, with the global model kept (the updates' origin) and what
        the rule asks every client for in the config (FedDG-GA: ``report_generalization_gap: 1`` and
        ``generalization_gap_samples``)."""
        self.current_arrays = arrays_from_record(arrays)
        for key, value in self._rule().client_config().items():
            config[key] = value
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The rule's model of the round from the replies without error, and the clients'
        metrics aggregated as Flower's FedAvg does (without ``client_id_key`` and the metrics
        the rule reads).

        Returns:
            ``(arrays, metrics)``; ``arrays`` is ``None`` (the previous model stays) when no
            reply came, the rule cannot work with the replies, or its result is not finite.

        Raises:
            flwr.serverapp.exception.AggregationError: ``configure_train`` did not run first.
            flwr.serverapp.exception.InconsistentMessageReplies: a reply lacks the weight, an
                array or a metric the rule reads, returns an array of another shape or dtype,
                or two replies claim one client.
        """
        rule = self._rule()
        if self.current_arrays is None:
            raise AggregationError(reason="configure_train must run before aggregate_train: the rule needs the model "
                                          "the clients started from")
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        contents = [self._without_client_reports(message.content, rule) for message in valid]
        validate_message_reply_consistency(replies=contents, weighted_by_key=self.weighted_by_key, check_arrayrecord=True)
        models = ClientModels.of_round(self.current_arrays, self._replies(server_round, valid, rule), server_round,
                                       self.seed, self._parameter_names())
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        self.trained_clients.update(models.clients)
        before = copy.deepcopy(rule.state_dict())
        try:
            new_state, telemetry = rule.aggregate(models)
        except TooFewReplies as error:
            return self._keep_previous_model(server_round, rule, before, str(error)), metrics
        if not all(bool(torch.isfinite(t).all()) for t in new_state.values() if t.is_floating_point()):
            return self._keep_previous_model(server_round, rule, before, "the rule's result is not finite"), metrics
        self.telemetry[server_round] = telemetry
        return arrays_to_record(new_state), metrics

    def _keep_previous_model(self, server_round: int, rule: ModelAggregation, state: dict[str, Any], reason: str) -> None:
        """Restore the rule's state from before the round and say why the round keeps the model."""
        rule.load_state_dict(state)
        log(WARNING, "round %s keeps the previous model: %s", server_round, reason)

    def _parameter_names(self) -> frozenset[str]:
        assert self.current_arrays is not None
        if self.parameter_names is None:
            return frozenset(name for name, tensor in self.current_arrays.items() if tensor.is_floating_point())
        unknown = sorted(self.parameter_names - set(self.current_arrays))
        if unknown:
            raise AggregationError(reason=f"parameter_names names arrays the model does not have: {', '.join(unknown)}")
        return self.parameter_names

    def _without_client_reports(self, content: RecordDict, rule: ModelAggregation) -> RecordDict:
        """``content`` with its metric record stripped of the client id and the metrics the rule
        reads (so that a client's first round, without them, is consistent with the others)."""
        dropped = {self.client_id_key, *rule.reported_metrics()}
        records: dict[str, Any] = {**content.array_records, **content.config_records}
        records.update({key: MetricRecord({k: v for k, v in record.items() if k not in dropped})
                        for key, record in content.metric_records.items()})
        return RecordDict(records)

    def _replies(self, server_round: int, messages: list[Message], rule: ModelAggregation) -> dict[int, Reply]:
        """FedBed's replies by client id, checked against the model the clients received."""
        assert self.current_arrays is not None
        replies: dict[int, Reply] = {}
        silent: dict[str, list[int]] = {}
        for message in messages:
            node = message.metadata.src_node_id
            metrics = dict(next(iter(message.content.metric_records.values())))
            if self.client_id_key is not None and self.client_id_key not in metrics:
                raise InconsistentMessageReplies(reason=f"the reply of node {node} has no metric {self.client_id_key!r} "
                                                        "(client_id_key) naming its client")
            client = int(metrics.pop(self.client_id_key)) if self.client_id_key is not None else node
            if client in replies:
                raise InconsistentMessageReplies(reason=f"two replies of round {server_round} claim client {client}")
            arrays = arrays_from_record(next(iter(message.content.array_records.values())))
            self._check_arrays(node, arrays)
            weight = metrics.pop(self.weighted_by_key)
            for name in rule.reported_metrics():
                if name not in metrics and client in self.trained_clients:
                    silent.setdefault(name, []).append(client)
            replies[client] = Reply(arrays, num_examples=weight,
                                    metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        if silent:
            name, clients = next(iter(silent.items()))
            meaning = REPORTED_METRIC_MEANINGS.get(name, "what the rule reads")
            raise InconsistentMessageReplies(
                reason=f"{self.rule} reads each client's {name!r} from its second round on, and the replies of "
                       f"client(s) {', '.join(map(str, sorted(clients)))} in round {server_round} lack it: send it in the "
                       f"reply's MetricRecord, {meaning} (the train config asks with '{REPORT_GENERALIZATION_GAP}': 1; "
                       f"FedBed's own clients send it)")
        return replies

    def _check_arrays(self, node: int, arrays: Mapping[str, torch.Tensor]) -> None:
        assert self.current_arrays is not None
        if set(arrays) != set(self.current_arrays):
            missing = sorted(set(self.current_arrays) - set(arrays)) or sorted(set(arrays) - set(self.current_arrays))
            raise InconsistentMessageReplies(reason=f"the reply of node {node} does not hold the arrays of the model it "
                                                    f"received (first difference: {missing[0]!r})")
        for name, tensor in arrays.items():
            sent = self.current_arrays[name]
            if tensor.shape != sent.shape or tensor.dtype != sent.dtype:
                raise InconsistentMessageReplies(
                    reason=f"the reply of node {node} returns array {name!r} as {tuple(tensor.shape)} {tensor.dtype}; "
                           f"it was sent as {tuple(sent.shape)} {sent.dtype}")


class PPDG(FedBedStrategy):
    """PPDG's server (``fedbed.algorithms.ppdg``): conflicting client updates aligned pairwise,
    ``ĝ_i ← ĝ_i − 2λ(ĝ_i − ĝ_j)``, then their mean. Hyperparameters ``alignment_lambda`` (λ,
    default 0.1), ``always_align``, ``weighting`` (``uniform`` or ``num_examples``); the other
    arguments are :class:`FedBedStrategy`'s."""

    def __init__(self, **options: Any) -> None:
        super().__init__("ppdg", **options)


class PCGrad(FedBedStrategy):
    """PCGrad (Yu et al., NeurIPS 2020) on the server (``fedbed.algorithms.gradient_agreement``):
    each conflicting update projected onto the other's normal plane, then the weighted mean."""

    def __init__(self, **options: Any) -> None:
        super().__init__("pcgrad", **options)


class AgrSum(FedBedStrategy):
    """AgrSum (Mansilla et al., ICCV 2021): the weighted mean update on the coordinates whose sign
    every client agrees on, zero elsewhere."""

    def __init__(self, **options: Any) -> None:
        super().__init__("agrsum", **options)


class AgrRand(FedBedStrategy):
    """AgrRand (Mansilla et al., ICCV 2021): as AgrSum, the conflicting coordinates filled with
    ``s·N(0, 1)`` (``s`` the mean absolute agreeing value)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("agrrand", **options)


class FedGMA(FedBedStrategy):
    """FedGMA (Tenison et al. 2022): the mean update times the soft sign-agreement mask, with a
    server step size. Hyperparameters ``mask_threshold`` (τ, 0.7), ``server_learning_rate`` (η, 1.0)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("fedgma", **options)


class GlobalAlignment(FedBedStrategy):
    """FedGaLA's global gradient alignment (``fedbed.algorithms.fedgala``, Algorithm 1 lines 5-10):
    client updates reweighted by ``(cos(g_k, ĝ) + 1)/2`` with the consensus ``ĝ``,
    ``alignment_iterations`` times (3). The rule ``fedavg_global_alignment``; FedGaLA's local
    alignment is its clients' and not part of it."""

    def __init__(self, **options: Any) -> None:
        super().__init__("fedavg_global_alignment", **options)


class FedDGGA(FedBedStrategy):
    """FedDG-GA (Zhang et al., CVPR 2023): aggregation weights moved towards the clients with the
    largest generalization gap, by a step decaying over the run's rounds. Every client sends its
    gap from its second round on (module docstring). Hyperparameters ``step_size`` (d, 0.2),
    ``gap_metric`` (``loss`` or ``accuracy``), ``gap_samples`` (``training`` or ``holdout``),
    ``reading`` (``paper`` or ``authors_code``)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("feddg_ga", **options)


class FedOMG(FedBedStrategy):
    """FedOMG (Nguyen et al., ICLR 2025): on-server gradient matching of the client updates.
    Hyperparameters ``search_radius`` (κ, 0.5), ``server_learning_rate`` (η_g, 0.5), the solver's
    ``solver_steps``, ``solver_learning_rate``, ``solver_momentum``, and ``reading``."""

    def __init__(self, **options: Any) -> None:
        super().__init__("fedomg", **options)


class Median(FedBedStrategy):
    """Coordinate-wise median (Yin et al., ICML 2018) with Flower's ``aggregate_median``, every
    array cast back to its dtype (integer buffers rounded)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("median", **options)


class TrimmedMean(FedBedStrategy):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018), ``trimmed_fraction`` (β, 0.2) of the
    clients cut at each end."""

    def __init__(self, **options: Any) -> None:
        super().__init__("trimmed_mean", **options)


class Krum(FedBedStrategy):
    """Krum (Blanchard et al., NeurIPS 2017), tolerating ``byzantine_clients`` (f, 1): unlike
    Flower's ``Krum`` it ranks clients by the ``parameter_names`` arrays only and takes the
    chosen client's buffers."""

    def __init__(self, **options: Any) -> None:
        super().__init__("krum", **options)


class MultiKrum(FedBedStrategy):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the weighted mean of the ``K − f`` clients with
    the best Krum scores, ranked by the ``parameter_names`` arrays only."""

    def __init__(self, **options: Any) -> None:
        super().__init__("multi_krum", **options)
