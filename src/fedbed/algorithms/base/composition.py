"""A client technique under another method's server rule: ``algorithm: CLIENT+SERVER``.

A method's clients (how it trains locally, and what its server sends them) and a server rule (how
the round's client models become the global model) are chosen separately: ``mcgdm+fedomg`` trains
MCGDM's clients, whose server still sends every client the previous heads, and combines their
models by FedOMG's gradient matching; ``fedsr+feddg_ga`` weights FedSR's clients by FedDG-GA's
generalization adjustment. FedOMG's paper composes it this way ("+OMG", FedSR+OMG, FedIIR+OMG,
FedSAM+OMG), as FedDG-GA's does (FedAvg, FedProx, SCAFFOLD + GA).

The server rule is the :class:`~fedbed.algorithms.base.model_aggregation.ModelAggregation` that
the rule's method (:attr:`~fedbed.algorithms.base.registry.Algorithm.server_rule`) creates; it
replaces the averaging seam of the client method's
:class:`~fedbed.algorithms.base.model_aggregation.FedAvgStrategy`. FedAvg on either side changes
nothing: ``mcgdm+fedavg`` is MCGDM and ``fedavg+ppdg`` is PPDG, bit for bit
(``tests/test_composition.py``).

A composed method has one set of hyperparameters, the client method's and the rule's own
(those of the client optimiser come from the client side); a rule's hyperparameter whose name
the client method also uses is named ``server_<name>``. Its paper values per dataset are both
sides' and its run settings per dataset the client method's, else the rule's; its search
distributions are both sides' (each side must declare its own).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import create_model

from fedbed.algorithms.base.local_training import LocalTrainingHyperparameters
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import (
    ALGORITHMS,
    Algorithm,
    AlgorithmContext,
    AlgorithmError,
    Hyperparameters,
    registered_algorithm,
)
from fedbed.algorithms.base.search_space import Distribution
from fedbed.federation.strategy import ClientTrainer, ServerStrategy

SEPARATOR = "+"
"""Joins a composed method's client method and server rule: ``mcgdm+fedomg``."""

SHARED_FIELDS = frozenset(LocalTrainingHyperparameters.model_fields)
"""The client optimiser's hyperparameters: a composed method takes them from its client side."""


def server_rules() -> list[str]:
    """The registered server rules' names, sorted."""
    return sorted(name for name, cls in ALGORITHMS.items() if cls.server_rule)


def composition_refusal(client: Algorithm, server: Algorithm) -> str | None:
    """Why ``client``'s clients cannot train under ``server``'s rule, or ``None`` if they can."""
    pair = f"{client.name}{SEPARATOR}{server.name}"
    if not server.server_rule:
        return f"{pair}: {server.name} is not a server rule; the server rules are {', '.join(server_rules())}"
    if client.server_rule_refusal is not None:
        return f"{pair}: {client.name} {client.server_rule_refusal}"
    if client.server_rule and client.name != "fedavg":
        return (f"{pair}: {client.name} is itself a server rule on FedAvg's clients; write "
                f"fedavg{SEPARATOR}{server.name}, or {client.name} alone")
    if server.needs_supervised_clients and client.evaluation_protocol != "argmax":
        return (f"{pair}: {server.name} weighs each client by the loss of its classifier on its data, and "
                f"{client.name}'s clients train a label-free representation")
    return None


class ComposedAlgorithm(Algorithm):
    """``client``'s clients and what its server sends them, with ``server``'s rule combining them.

    Args:
        client: the client method (any method whose server averages through FedAvgStrategy).
        server: a server rule (:attr:`Algorithm.server_rule`).

    Raises:
        AlgorithmError: a pair that cannot work together (:func:`composition_refusal`), or
            hyperparameters of both that cannot be told apart.
    """

    hyperparameters: ClassVar[type[Hyperparameters]]

    def __init__(self, client: Algorithm, server: Algorithm) -> None:
        refusal = composition_refusal(client, server)
        if refusal is not None:
            raise AlgorithmError(refusal)
        self.client, self.server = client, server
        self.name = f"{client.name}{SEPARATOR}{server.name}"
        self.summary = f"{client.name}'s clients under {server.name}'s server rule. {server.summary}"
        client_fields = client.hyperparameters.model_fields
        self.server_names = {name: f"server_{name}" if name in client_fields else name
                             for name in server.hyperparameters.model_fields if name not in SHARED_FIELDS}
        clashes = [name for name in self.server_names.values() if name in client_fields]
        if clashes:
            raise AlgorithmError(f"{self.name}: both sides have a hyperparameter {clashes[0]!r}")
        fields = {new: (server.hyperparameters.model_fields[old].annotation, server.hyperparameters.model_fields[old])
                  for old, new in self.server_names.items()}
        self.hyperparameters = create_model(f"{type(client).__name__}With{type(server).__name__}Rule",
                                            __base__=client.hyperparameters, **fields)
        self.dataset_defaults = {
            dataset: {**{self.server_names[k]: v for k, v in server.dataset_defaults.get(dataset, {}).items()
                         if k in self.server_names},
                      **client.dataset_defaults.get(dataset, {})}
            for dataset in {*client.dataset_defaults, *server.dataset_defaults}}
        self.dataset_run_settings = {dataset: {**server.dataset_run_settings.get(dataset, {}),
                                               **client.dataset_run_settings.get(dataset, {})}
                                     for dataset in {*client.dataset_run_settings, *server.dataset_run_settings}}
        self.measured_failures = {  # each side's, named (the composition itself was not measured)
            dataset: " ".join(f"{side.name}: {side.measured_failures[dataset]}" for side in (client, server)
                              if dataset in side.measured_failures)
            for dataset in {*client.measured_failures, *server.measured_failures}}
        self.evaluation_protocol = client.evaluation_protocol
        self.draws_its_own_views = client.draws_its_own_views
        self.precisions = client.precisions
        self.secure_aggregation_compatible = (client.secure_aggregation_compatible if server.name == "fedavg"
                                              else server.secure_aggregation_compatible)
        self.server_rule = False
        self.server_rule_refusal = "is already a composed method"

    def search_space(self) -> dict[str, Distribution]:
        """Both sides' search distributions: the client method's (with the shared client
        optimiser's), and the rule's own under their names here (``server_<name>`` on a clash).

        Raises:
            AlgorithmError: either side declares none.
        """
        server = self.server.search_space()
        return {**{self.server_names[name]: distribution for name, distribution in server.items()
                   if name in self.server_names}, **self.client.search_space()}

    def sides(self, hparams: Any) -> tuple[Hyperparameters, Hyperparameters]:
        """The client method's and the rule's hyperparameters out of the composed ones."""
        values = hparams.model_dump()
        client = self.client.hyperparameters(**{k: values[k] for k in self.client.hyperparameters.model_fields})
        server = self.server.hyperparameters(**{k: values[k] for k in SHARED_FIELDS},
                                             **{old: values[new] for old, new in self.server_names.items()})
        return client, server

    def wrap_model(self, model, hparams: Any):
        return self.client.wrap_model(model, self.sides(hparams)[0])

    def create_trainer(self, hparams: Any, context: AlgorithmContext) -> ClientTrainer:
        return self.client.create_trainer(self.sides(hparams)[0], context)

    def create_strategy(self, hparams: Any, context: AlgorithmContext) -> ServerStrategy:
        client, server = self.sides(hparams)
        strategy = self.client.create_strategy(client, context)
        if not isinstance(strategy, FedAvgStrategy):  # no server_rule_refusal promised the seam
            raise AlgorithmError(f"{self.client.name}'s server has no averaging seam for {self.server.name}'s rule")
        strategy.aggregation = self.server.create_aggregation(server, context)
        return strategy


def get_algorithm(name: str) -> Algorithm:
    """The method named ``name`` (case-insensitive): a registered one, or ``CLIENT+SERVER``
    (:class:`ComposedAlgorithm`).

    Raises:
        AlgorithmError: an unknown name, or a pair that cannot work together (one line, why).
    """
    if SEPARATOR not in name:
        return registered_algorithm(name)
    parts = name.split(SEPARATOR)
    if len(parts) != 2 or not all(parts):
        raise AlgorithmError(f"{name!r}: a composed method is CLIENT{SEPARATOR}SERVER, two names "
                             f"(e.g. mcgdm{SEPARATOR}fedomg); the server rules are {', '.join(server_rules())}")
    return ComposedAlgorithm(registered_algorithm(parts[0]), registered_algorithm(parts[1]))
