"""FedAvg (McMahan et al., AISTATS 2017) and Central / DeepAll."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from fedbed.algorithms.local_training import LocalTrainingHyperparameters, SupervisedAlgorithm
from fedbed.algorithms.model_aggregation import (
    MODEL_AGGREGATION_PURPOSE,
    ClientModels,
    ModelAggregation,
    trainable_parameter_names,
)
from fedbed.algorithms.registry import AlgorithmContext, register_algorithm
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.federation.strategy import ServerStrategy
from fedbed.gradients import clone_arrays
from fedbed.seeding import seeded_generator


class FedAvgStrategy(ServerStrategy):
    """Send every client the global model; replace it by the n_k/n-weighted mean of the replies.

    McMahan et al. 2017, Algorithm 1: ``θ ← Σ_k (n_k / n) θ_k`` over the clients of the round,
    with ``n = Σ_k n_k``. The average is :attr:`aggregation`'s (FedAvg's by default; the run's
    robust aggregation or differential privacy replace it for every method built on this
    strategy); subclasses change :meth:`client_weights` (FedADG's uniform mean) or
    :meth:`combine` (the update aggregators).

    Attributes:
        aggregation: the seam of the run's server options (:mod:`fedbed.algorithms.model_aggregation`).
    """

    def __init__(self, seed: int = 0, aggregation: ModelAggregation | None = None) -> None:
        self.seed = seed
        self.aggregation = aggregation or ModelAggregation()

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        self.model = model
        self.clients = {c.client_id: c for c in clients}

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        arrays = clone_arrays(self.model.state_dict())
        return {client: Payload(arrays=arrays, config=self.aggregation.client_config()) for client in selected}

    def client_weights(self, replies: dict[int, Reply], order: list[int]) -> list[float]:
        """The averaging weight of each client of ``order``: its ``num_examples`` n_k."""
        return [replies[c].num_examples for c in order]

    def combine(self, round_number: int, replies: dict[int, Reply]) -> tuple[dict, dict[str, Any]]:
        """The new global state dict and the telemetry of the combination (weights n_k/n)."""
        order = sorted(replies)
        generator = seeded_generator(self.seed, round_number, MODEL_AGGREGATION_PURPOSE)
        return self.aggregation.aggregate(ClientModels(self.model.state_dict(), order, [replies[c].arrays for c in order],
                                                       self.client_weights(replies, order), round_number, generator,
                                                       trainable_parameter_names(self.model)))

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        new_state, telemetry = self.combine(round_number, replies)
        self.model.load_state_dict(new_state)
        losses = [r.metrics["loss"] for r in replies.values() if "loss" in r.metrics]
        metrics = {"train_loss": sum(losses) / len(losses)} if losses else {}
        return RoundSummary(metrics=metrics, telemetry=telemetry)

    def global_model(self) -> nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return {"model": copy.deepcopy(self.model.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])


@register_algorithm
class FedAvg(SupervisedAlgorithm):
    """Federated averaging (McMahan et al., AISTATS 2017), aggregation weights n_k/n."""

    name = "fedavg"
    summary = "FedAvg (McMahan et al. 2017): local training, n_k/n-weighted parameter average."
    hyperparameters = LocalTrainingHyperparameters
    dataset_defaults = {  # hfedf.txt Table 10 (also Central's and Local's, App. C.8.2)
        "OfficeHome": {"client_weight_decay": 1e-5},
        "VLCS": {"client_lr": 1e-4},
    }

    def create_strategy(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> ServerStrategy:
        return FedAvgStrategy(context.seed)


@register_algorithm
class Central(FedAvg):
    """Central / DeepAll: every source domain pooled on one client; each round is plain training.

    The non-federated reference (hFedF Sec. 5.1 "Central"; PPDG Table 4 "DeepAll"). Its
    hyperparameters are FedAvg's, as in hFedF App. C.8.2.
    """

    name = "central"
    summary = "Central / DeepAll: all source data pooled, the non-federated reference."
    pooled = True
