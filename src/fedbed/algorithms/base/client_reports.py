"""What a server rule asks every client to report beside its model: the generalization gap.

FedDG-GA (Zhang et al., CVPR 2023, Sec. 4, "Generalization Adjustment") weights client ``k`` by
the gap between the risk of the global model and the risk of the client's own model on the
client's data, ``G_k(θ^r) = Ê_k(θ^r) − Ê_k(θ_k^r)``: the global model ``θ^r`` the client
receives at the start of a round, against the local model ``θ_k^r`` it trained in the round
before. The client computes both (the server never sees a sample): when the payload's config
carries :data:`REPORT_GENERALIZATION_GAP`, :class:`~fedbed.algorithms.base.local_training.LocalTrainer`
scores the received model on the client's training samples before training, scores the trained
model after it and keeps that risk in the client's state for the next round, and reports

- ``generalization_gap_loss``: cross-entropy of the global model − that of the previous local
  model (the paper's risk; mean squared error for a regression task);
- ``generalization_gap_accuracy``: accuracy of the previous local model − that of the global
  model, in percent (the authors' script's ``--fair acc``, sign turned so that a larger gap
  means a global model worse on this client, as with the loss).

A client with no previous local model (its first round) reports no gap. The authors' code scores
each site's held-out validation split; FedBed's clients score their training samples (the
paper's ``D̂_k``), since a client's holdout is the id evaluation's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload

REPORT_GENERALIZATION_GAP = "report_generalization_gap"
"""Payload config key: 1 asks the client for its generalization gap."""

GAP_METRICS = {"loss": "generalization_gap_loss", "accuracy": "generalization_gap_accuracy"}
"""Reply metric of the gap measured in each metric."""

_LOCAL_RISK = "generalization_gap_local_risk"
"""Client-state key: the risk (loss, accuracy) of the client's model at the end of its last round."""


def gap_requested(payload: Payload) -> bool:
    """Whether the server asked this client for its generalization gap."""
    return bool(payload.config.get(REPORT_GENERALIZATION_GAP, 0))


def empirical_risk(model: nn.Module, data: ClientData, task: str) -> tuple[float, float]:
    """``(mean loss, accuracy in percent)`` of ``model`` on every sample of ``data``, in eval mode.

    The loss is the cross-entropy of the logits ``[n, C]`` (the mean squared error of outputs
    ``[n, 1]`` for ``task="regression"``, whose accuracy is ``nan``).
    """
    outputs = data.outputs_of(model).float()
    if task == "regression":
        return float(nn.functional.mse_loss(outputs.squeeze(1), data.targets.float())), float("nan")
    loss = float(nn.functional.cross_entropy(outputs, data.targets))
    return loss, 100.0 * float((outputs.argmax(dim=1) == data.targets).double().mean())


def gap_of_received_model(model: nn.Module, data: ClientData, task: str, state: dict[str, Any]) -> dict[str, float]:
    """The reply metrics of the gap (module docstring) of the received ``model``, before training;
    empty when the client has no previous local model."""
    if _LOCAL_RISK not in state or len(data) == 0:
        return {}
    global_loss, global_accuracy = empirical_risk(model, data, task)
    local_loss, local_accuracy = state[_LOCAL_RISK]
    gaps = {GAP_METRICS["loss"]: global_loss - local_loss}
    if task != "regression":
        gaps[GAP_METRICS["accuracy"]] = local_accuracy - global_accuracy
    return gaps


def remember_local_risk(model: nn.Module, data: ClientData, task: str, state: dict[str, Any]) -> None:
    """Keep the trained ``model``'s risk in the client's ``state`` for the next round's gap."""
    if len(data):
        state[_LOCAL_RISK] = empirical_risk(model, data, task)
