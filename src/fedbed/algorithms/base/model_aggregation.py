"""How a FedAvg-family server turns the round's client models into the new global model.

Every method whose server averages the clients' models (FedAvg, FedProx, FedSR, FedADG, the
self-supervised methods, Central) calls :meth:`ModelAggregation.aggregate` from
:meth:`FedAvgStrategy.combine` (below): the one seam where the run's server
options plug in. The default is FedAvg's weighted average; robust aggregation
(:mod:`fedbed.algorithms.options.robust_aggregation`) and client-level differential privacy
(:mod:`fedbed.algorithms.options.differential_privacy`) replace it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from fedbed.federation.arrays import clone_arrays, weighted_average
from fedbed.federation.messages import (
    FIT_SECONDS,
    ClientInfo,
    Payload,
    Reply,
    RoundSummary,
    Scalar,
)
from fedbed.federation.strategy import ServerStrategy
from fedbed.seeding import seeded_generator

MODEL_AGGREGATION_PURPOSE = 37
"""Seed component of a model aggregation's random draws (differential privacy's noise)."""


@dataclass(frozen=True)
class ClientModels:
    """What a model aggregation combines in one round.

    Attributes:
        current: the global model's state dict before the round (what every client was sent).
        clients: the K client ids, ascending.
        arrays: their K state dicts (same names, shapes and dtypes as ``current``: the engine
            checked them).
        weights: K positive weights (n_k for FedAvg, 1 for FedADG's uniform mean).
        round_number: the round (from 1).
        generator: seeded from (run seed, round, :data:`MODEL_AGGREGATION_PURPOSE`).
        parameter_names: the names of ``current`` that are trainable floating-point parameters
            (:func:`trainable_parameter_names`); the others are buffers (BatchNorm's running
            statistics, its integer ``num_batches_tracked``), which a rule that ranks or clips
            client models must not read as if they were weights.
        metrics: the K clients' reply metrics (FedDG-GA reads the generalization gap each
            client reports when the rule's :meth:`ModelAggregation.client_config` asks for it).
    """

    current: Mapping[str, torch.Tensor]
    clients: Sequence[int]
    arrays: Sequence[Mapping[str, torch.Tensor]]
    weights: Sequence[float]
    round_number: int
    generator: torch.Generator
    parameter_names: frozenset[str]
    metrics: Sequence[Mapping[str, float]] = ()

    @classmethod
    def of_round(cls, current: Mapping[str, torch.Tensor], replies: Mapping[int, Reply], round_number: int, seed: int,
                 parameter_names: frozenset[str], weights: Sequence[float] | None = None) -> "ClientModels":
        """The round's client models in ascending client order, with the generator seeded from
        ``(seed, round_number, MODEL_AGGREGATION_PURPOSE)``: how every server that holds a
        :class:`ModelAggregation` hands it a round (:meth:`FedAvgStrategy.combine`, and Flower's
        strategies in :mod:`fedbed.flower.strategies`).

        Args:
            current: the global model's state dict before the round.
            replies: the round's replies by client id.
            round_number: the round (from 1).
            seed: the run's seed.
            parameter_names: the trainable floating-point parameters' names among ``current``.
            weights: the clients' weights in ascending client order (default: each reply's
                ``num_examples``).
        """
        order = sorted(replies)
        return cls(current, order, [replies[c].arrays for c in order],
                   list(weights) if weights is not None else [replies[c].num_examples for c in order], round_number,
                   seeded_generator(seed, round_number, MODEL_AGGREGATION_PURPOSE), parameter_names,
                   [replies[c].metrics for c in order])


def trainable_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """The state-dict names of ``model``'s floating-point parameters that require gradients."""
    return frozenset(name for name, parameter in model.named_parameters()
                     if parameter.requires_grad and parameter.is_floating_point())


class ModelAggregation:
    """FedAvg's aggregation (McMahan et al., AISTATS 2017, Algorithm 1): ``θ ← Σ_k w_k θ_k / Σ_k w_k``.

    Subclasses replace :meth:`aggregate` (and may ask the clients for something through
    :meth:`client_config`). Every random draw comes from a generator seeded from the run's seed
    and the round; a rule that keeps something across rounds (FedDG-GA's aggregation weights)
    returns it from :meth:`state_dict`, which the strategy checkpoints with the run, so a resumed
    run continues it exactly.
    """

    def client_config(self) -> dict[str, Scalar]:
        """Scalars every client receives in its payload's config (none for FedAvg)."""
        return {}

    def reported_metrics(self) -> tuple[str, ...]:
        """The reply metrics the rule reads, which :meth:`client_config` asks every client for
        (FedDG-GA's generalization gap; none for FedAvg). A client reports them from its second
        round on: in its first it has no earlier model of its own to compare with."""
        return ()

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The new global state dict and JSON-serialisable telemetry.

        Returns:
            ``(state dict, {"weights": {client: w_k / Σ w}, ...})``.
        """
        total = float(sum(models.weights))
        return weighted_average(models.arrays, models.weights), {
            "weights": {str(c): w / total for c, w in zip(models.clients, models.weights)}}

    def state_dict(self) -> dict[str, Any]:
        """What the rule keeps across rounds (nothing by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class FedAvgStrategy(ServerStrategy):
    """Send every client the global model; replace it by the n_k/n-weighted mean of the replies.

    McMahan et al. 2017, Algorithm 1: ``θ ← Σ_k (n_k / n) θ_k`` over the clients of the round,
    with ``n = Σ_k n_k``. The average is :attr:`aggregation`'s (FedAvg's by default; the run's
    robust aggregation, differential privacy or a composed server rule replace it for every
    method built on this strategy, and the server rules are themselves such averages: PPDG's,
    FedOMG's); subclasses change :meth:`client_weights` (FedADG's uniform mean) or what the
    clients receive (:meth:`configure_round`: MCGDM's heads).

    Attributes:
        aggregation: the seam of the run's server options (:mod:`fedbed.algorithms.base.model_aggregation`).
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
        return self.aggregation.aggregate(ClientModels.of_round(
            self.model.state_dict(), replies, round_number, self.seed, trainable_parameter_names(self.model),
            self.client_weights(replies, sorted(replies))))

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        new_state, telemetry = self.combine(round_number, replies)
        self.model.load_state_dict(new_state)
        return RoundSummary(metrics=self.round_metrics(replies), telemetry=telemetry)

    metric_prefix: ClassVar[str] = "mean_"
    """How the round's log names the clients' mean of a reply metric: ``mean_<name>``."""

    def round_metrics(self, replies: dict[int, Reply]) -> dict[str, float]:
        """The clients' mean of every reply metric: ``train_loss`` for ``loss`` and
        :attr:`metric_prefix` + name for the others (MCGDM's ``mean_intra``, the schedule's
        ``mean_lr``), each over the replies that carry it, in the order the replies first name
        them; the transport's ``fit_seconds`` is the engine's and is left out."""
        names = list(dict.fromkeys(name for c in sorted(replies) for name in replies[c].metrics if name != FIT_SECONDS))
        metrics = {}
        for name in names:
            values = [reply.metrics[name] for reply in replies.values() if name in reply.metrics]
            metrics["train_loss" if name == "loss" else self.metric_prefix + name] = sum(values) / len(values)
        return metrics

    def global_model(self) -> nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return {"model": copy.deepcopy(self.model.state_dict()), "aggregation": copy.deepcopy(self.aggregation.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.aggregation.load_state_dict(copy.deepcopy(state.get("aggregation", {})))
