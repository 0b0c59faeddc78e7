"""FedEMA (Zhuang, Wen, Zhang, ICLR 2022, Sec. 4.2): BYOL clients that start each round from a
divergence-aware moving average of their own last model and the global model.

Each client starts from ``μ W_k + (1 − μ) W_g`` instead of the global model W_g, where W_k is the
client's own model of its last round and ``μ = min(λ_k ‖W_g − W_k‖, 1)``; the scaler
λ_k = τ / ‖W_g − W_k‖ is fixed at the client's first round with a previous model (its second
participation), so μ = τ then (τ = 0.7, FedEMA's default). The divergence is the L2 norm of the
flattened difference of the online encoder's parameters (the featurizer's: the paper's W is the
encoder; BatchNorm buffers left out), as the Plato reimplementation measures it (the authors'
EasyFL code measures the client's own drift over its last round instead). Unlike FedBYOL, FedEMA's
predictor is part of the model: it travels, is averaged by the server and mixed by the moving
average, as in the authors' code (EasyFL ``applications/fedssl``: server and client). The moving
average covers every floating-point array that travels (BatchNorm statistics included, as Plato;
the authors' code takes the buffers from the global model). The target network stays on the
client.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from fedbed.algorithms.base.registry import register_algorithm
from fedbed.algorithms.base.self_supervised import (
    SelfSupervisedAlgorithm,
    SelfSupervisedModel,
    SelfSupervisedTrainer,
)
from fedbed.algorithms.base.self_supervised_objectives import (
    BYOLHyperparameters,
    BYOLObjective,
)
from fedbed.federation.arrays import clone_arrays, flatten
from fedbed.federation.messages import Payload
from fedbed.models import DomainClassifier


class FedEMAHyperparameters(BYOLHyperparameters):
    """FedEMA: BYOL's plus τ, the expected EMA weight μ at the client's first moving average
    (Zhuang, Wen, Zhang 2022: 0.7)."""

    expected_ema_weight: float = Field(0.7, ge=0, le=1)


def ema_weight(global_arrays: dict[str, torch.Tensor], own_arrays: dict[str, torch.Tensor], parameter_names: list[str],
               scaler: float | None, expected_weight: float) -> tuple[float, float]:
    """FedEMA's divergence-aware weight (Zhuang, Wen, Zhang 2022, Sec. 4.2).

    ``μ = min(λ ‖W_g − W_k‖, 1)`` with the divergence over the named parameters; at the client's
    first moving average ``λ = τ / ‖W_g − W_k‖`` (so μ = τ); a zero divergence gives μ = 0 then
    (nothing to average) and λ is fixed at the next non-zero divergence.

    Args:
        global_arrays: the global model W_g (state dict).
        own_arrays: the client's model of its last round W_k.
        parameter_names: the names whose flattened difference is the divergence.
        scaler: λ_k, or ``None`` before it is fixed.
        expected_weight: τ in [0, 1].

    Returns:
        ``(μ, λ)`` (λ possibly still ``nan`` when no divergence was seen yet).
    """
    divergence = float((flatten(global_arrays, parameter_names) - flatten(own_arrays, parameter_names)).norm())
    if scaler is None or scaler != scaler:
        scaler = expected_weight / divergence if divergence > 0 else float("nan")
    weight = min(scaler * divergence, 1.0) if divergence > 0 else 0.0
    return weight, scaler


def blend(own: dict[str, torch.Tensor], global_arrays: dict[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
    """``μ·own + (1 − μ)·global`` for floating-point arrays; others (counters) are the global's."""
    return {name: (weight * own[name] + (1.0 - weight) * tensor).to(tensor.dtype) if tensor.is_floating_point() else tensor
            for name, tensor in global_arrays.items()}


class FedEMATrainer(SelfSupervisedTrainer):
    """A BYOL client that starts from the divergence-aware moving average of FedEMA."""

    hparams: FedEMAHyperparameters

    def starting_arrays(self, payload: Payload, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        if "own_model" not in state:
            state.pop("ema_weight", None)
            return payload.arrays
        names = [name for name, _ in self.model.featurizer.named_parameters(prefix="featurizer")]
        weight, scaler = ema_weight(payload.arrays, state["own_model"], names, state.get("ema_scaler"),
                                    self.hparams.expected_ema_weight)
        state["ema_scaler"], state["ema_weight"] = scaler, weight
        return blend(state["own_model"], payload.arrays, weight)

    def end_round(self, model: SelfSupervisedModel, state: dict[str, Any]) -> None:
        super().end_round(model, state)
        state["own_model"] = clone_arrays(model.state_dict())

    def round_metrics(self, state: dict[str, Any]) -> dict[str, float]:
        """μ of this round (0 at the client's first round)."""
        return {"ema_weight": float(state.get("ema_weight", 0.0))}


@register_algorithm
class FedEMA(SelfSupervisedAlgorithm):
    """FedEMA (Zhuang, Wen, Zhang, ICLR 2022): BYOL clients starting from a divergence-aware EMA."""

    name = "fedema"
    summary = "FedEMA (Zhuang et al. 2022): BYOL clients start from mu*own + (1-mu)*global, mu = min(lambda*divergence, 1)."
    hyperparameters = FedEMAHyperparameters
    objective = BYOLObjective
    trainer_class = FedEMATrainer

    def wrap_model(self, model: DomainClassifier, hparams: FedEMAHyperparameters) -> SelfSupervisedModel:
        """The SSL model with the predictor built in, so that it travels (the authors' code averages it)."""
        return SelfSupervisedModel(model, hparams.projection_hidden_dim, hparams.projection_dim,
                                   predictor_hidden_dim=hparams.predictor_hidden_dim)
