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

A client with no previous local model (its first round) reports no gap. By default the client
scores its training samples (the paper's ``D̂_k``); when the payload's config carries
:data:`GAP_SAMPLES` ``"holdout"``, it scores its share of the id-validation holdouts
(:attr:`ClientData.holdout`), as the authors' code scores each site's validation split
(``site_evaluation(..., dataloader_dict[site]['val'])`` in ``train_pacs_GA.py``). Those are the
samples that ``train_domain_val`` model selection reads, so under that reading the selection
data also steer the aggregation weights (as in the authors' code, which selects on them too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload

REPORT_GENERALIZATION_GAP = "report_generalization_gap"
"""Payload config key: 1 asks the client for its generalization gap."""

GAP_SAMPLES = "generalization_gap_samples"
"""Payload config key: where the gap is measured, ``"training"`` (absent: the same) or ``"holdout"``."""

GAP_SAMPLE_CHOICES = ("training", "holdout")
"""The values of :data:`GAP_SAMPLES`: the client's training samples, or its id-holdout share."""

GAP_METRICS = {"loss": "generalization_gap_loss", "accuracy": "generalization_gap_accuracy"}
"""Reply metric of the gap measured in each metric."""

_LOCAL_RISK = "generalization_gap_local_risk"
"""Client-state key: the risk (loss, accuracy) of the client's model at the end of its last round."""


def holdout_steering(hparams: Mapping[str, Any]) -> str | None:
    """What a report says of a run whose recorded hyperparameters (a summary's ``hp``) set
    ``gap_samples: holdout``, or ``None``: its id-validation holdouts steered the aggregation
    weights, so its id scores and ``train_domain_val``'s choice of round read samples that shaped
    the model (module docstring). Read from the record, it covers runs recorded before a report
    said so."""
    if hparams.get("gap_samples") != "holdout":
        return None
    return ("the generalization gap was scored on the clients' id-validation holdouts (gap_samples: holdout) and set "
            "the aggregation weights, so the id scores and train_domain_val's choice of round read samples that "
            "steered training")


def gap_requested(payload: Payload) -> bool:
    """Whether the server asked this client for its generalization gap."""
    return bool(payload.config.get(REPORT_GENERALIZATION_GAP, 0))


def gap_samples(payload: Payload, data: ClientData) -> ClientData:
    """The samples this client measures its gap on: ``data`` itself, or ``data.holdout`` when
    the payload's config sets :data:`GAP_SAMPLES` to ``"holdout"``.

    Raises:
        ValueError: an unknown :data:`GAP_SAMPLES` value, or ``"holdout"`` for data given
            without a holdout share (build client data with :meth:`fedbed.build.BuiltRun.client_data`)
            or with an empty one.
    """
    where = payload.config.get(GAP_SAMPLES, "training")
    if where not in GAP_SAMPLE_CHOICES:
        raise ValueError(f"{GAP_SAMPLES} is {where!r}; choose one of {', '.join(GAP_SAMPLE_CHOICES)}")
    if where == "training":
        return data
    if data.holdout is None:
        raise ValueError(f"the server asks for the generalization gap on the client's id-holdout share ({GAP_SAMPLES}: "
                         "holdout), and this client's data came without one; give it ClientData(..., holdout=...) "
                         "as fedbed.build.BuiltRun.client_data does")
    if len(data.holdout) == 0:
        raise ValueError(f"the server asks for the generalization gap on the client's id-holdout share ({GAP_SAMPLES}: "
                         "holdout), and this client's share is empty (its domains' holdouts are split among more "
                         "clients than they have samples); raise holdout_fraction, or use gap_samples: training")
    return data.holdout


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
