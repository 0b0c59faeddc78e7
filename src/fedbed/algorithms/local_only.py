"""Local-only: every client trains its own model and never communicates."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
)
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.fedavg import FedAvg
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.federation.strategy import ServerStrategy


class LocalOnlyStrategy(ServerStrategy):
    """Keeps one model per client and never mixes them.

    The per-client models live on the simulated server only so that evaluation can reach
    them; each client only ever receives its own model back. Evaluation reports, per source
    domain, the mean id accuracy of the models of the clients that hold that domain, and as ood
    accuracy the mean over all client models (hFedF Sec. 5.1, "Local-Only").
    """

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        self.clients = {c.client_id: c for c in clients}
        self.models = {c.client_id: copy.deepcopy(model) for c in clients}

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        return {c: Payload(arrays=clone_arrays(self.models[c].state_dict())) for c in selected}

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        for client, reply in replies.items():
            self.models[client].load_state_dict(reply.arrays)
        losses = [r.metrics["loss"] for r in replies.values()]
        return RoundSummary(metrics={"train_loss": sum(losses) / len(losses)})

    def global_model(self) -> nn.Module:
        """The first client's model (Local-only has no global model; see :meth:`evaluation_models`)."""
        return self.models[min(self.models)]

    def evaluation_models(self) -> list[tuple[nn.Module, tuple[int, ...] | None]]:
        return [(self.models[c], self.clients[c].domains) for c in sorted(self.models)]

    def state_dict(self) -> dict[str, Any]:
        return {"models": {c: copy.deepcopy(m.state_dict()) for c, m in self.models.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for client, model_state in state["models"].items():
            self.models[int(client)].load_state_dict(model_state)


@register_algorithm
class LocalOnly(SupervisedAlgorithm):
    """Local-only training (hFedF Sec. 5.1): the no-communication lower reference."""

    name = "local"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    server_rule_refusal = "has no global model to combine"
    summary = "Local-only: each client trains alone; reports the mean over the client models."
    hyperparameters = LocalTrainingHyperparameters
    dataset_defaults = FedAvg.dataset_defaults  # hfedf.txt App. C.8.2: Local takes FedAvg's values

    def create_strategy(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> ServerStrategy:
        return LocalOnlyStrategy()
