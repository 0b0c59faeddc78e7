"""Federated domain adaptation by knowledge vote: any averaging method, plus a target model
trained on pseudo-labels of the server's unlabelled target images (MCGDM's extension, Eq. 10,
``mcgdm.md``; the vote of KD3A, Feng et al. 2021, Sec. 3.2).

Under ``protocol: domain_adaptation`` with ``target_adaptation: knowledge_vote``, each round:

1. the method's own strategy aggregates the source clients' models (``aggregate``);
2. every source model of the round predicts every image of the unlabelled adaptation share;
3. **knowledge vote**: a source model is *confident* on an image when its largest class
   probability exceeds ``confidence_gate`` (KD3A's 0.9); the image's pseudo-label is the class
   most confident models vote for (ties: the larger sum of those models' top probabilities, then
   the lower class index); an image no model is confident on gets no pseudo-label this round;
4. a target model, starting from the aggregated global model, is trained on the pseudo-labelled
   images with cross-entropy against the hard pseudo-labels (Eq. 10) for the run's local budget
   with the method's client optimiser at its base learning rate (a per-round schedule of the
   method's clients, ``client_lr_schedule`` such as MCGDM's cosine decay, is not applied to it)
   and a new optimiser every round (``client_optimizer_state: kept`` keeps the source clients'
   optimiser states, not the target model's);
5. the global model becomes the sample-weighted average of the source models' average (weight
   Σ n_k) and the target model (weight: the number of pseudo-labelled images), i.e. Eq. 9 with
   the target model as one more client.

The strategy sees the target images only as :class:`~fedbed.federation.local_data.UnlabeledImages`
(no labels exist on that type). It reports the pseudo-labels in its telemetry; the engine turns
them into the pseudo-labelled fraction and, for the log only, their accuracy against the
adaptation share's labels (:func:`fedbed.federation.engine.adaptation_log`), labelled as reading
target labels and never used by training or model selection.

It applies to methods whose next round starts from the strategy's ``global_model()`` (FedAvg and
its descendants: FedProx, FedSR, MCGDM, the update aggregators); hFedF and pFedHN generate each
client's model from a hypernetwork and are refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    train_locally,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import TrainingBudget
from fedbed.federation.arrays import weighted_average
from fedbed.federation.devices import HOST, to_host
from fedbed.federation.local_data import ClientData, UnlabeledImages
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.federation.strategy import ServerStrategy
from fedbed.seeding import derive_seed, seeded_generator

ADAPTATION_PURPOSE = 0xADA
"""Mixed into the target model's seeds (batch order) so they differ from every other draw."""


def knowledge_vote(probabilities: torch.Tensor, confidence_gate: float = 0.9) -> torch.Tensor:
    """KD3A's knowledge vote over K models' class probabilities for N images.

    Args:
        probabilities: ``[K, N, C]`` softmax outputs of the K source models.
        confidence_gate: a model votes on an image when its top probability exceeds this.

    Returns:
        ``int64 [N]`` pseudo-labels, ``-1`` where no model is confident.
    """
    top, predicted = probabilities.max(dim=2)  # [K, N]
    confident = top > confidence_gate
    classes = probabilities.shape[2]
    one_hot = nn.functional.one_hot(predicted, classes).to(torch.float64) * confident.unsqueeze(2)  # [K, N, C]
    votes = one_hot.sum(dim=0)
    strength = (one_hot * top.to(torch.float64).unsqueeze(2)).sum(dim=0)
    # Most votes first (strength / (K + 1) < 1 never outweighs one vote), then the larger summed
    # confidence; argmax takes the lowest index on a remaining tie.
    score = votes + strength / (probabilities.shape[0] + 1.0)
    labels = score.argmax(dim=1)
    return torch.where(confident.any(dim=0), labels, torch.full_like(labels, -1))


class KnowledgeVoteAdaptation(ServerStrategy):
    """Wraps a method's strategy with the knowledge-vote target model (see the module docstring).

    Args:
        inner: the method's strategy (its ``global_model()`` must be what the next round sends).
        model_factory: builds the method's model (for the source models' predictions).
        hparams: the method's client optimiser settings (the target model's optimiser).
        budget: the local budget (the target model's epochs or steps, and its batch size).
        seed: the run's seed.
        confidence_gate: the vote's gate (KD3A: 0.9).
        device: where the source models predict and the target model trains (the run's device;
            the global model stays on the CPU).

    Raises:
        ValueError: (at ``initialize``) an inner strategy that is not FedAvg's family.
    """

    def __init__(self, inner: ServerStrategy, model_factory, hparams: LocalTrainingHyperparameters, budget: TrainingBudget,
                 seed: int, confidence_gate: float = 0.9, device: torch.device = HOST) -> None:
        self.inner, self.model_factory, self.hparams, self.budget = inner, model_factory, hparams, budget
        self.device = device
        self.seed, self.confidence_gate = seed, confidence_gate
        self.requires_every_client = inner.requires_every_client
        self.auxiliary_array_prefixes = inner.auxiliary_array_prefixes
        self.target: UnlabeledImages | None = None

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        if not isinstance(self.inner, FedAvgStrategy):
            raise ValueError(f"knowledge-vote adaptation needs a method whose next round starts from the global model "
                             f"(FedAvg's family); {type(self.inner).__name__} generates its clients' models")
        self.inner.initialize(model, clients)
        with torch.random.fork_rng():  # building the helper model must not move the run's draws
            self._model = self.model_factory().to(self.device)

    def receive_adaptation_target(self, images: UnlabeledImages) -> None:
        self.target = images

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        return self.inner.configure_round(round_number, selected)

    def _probabilities(self, replies: dict[int, Reply]) -> torch.Tensor:
        """``[K, N, C]`` class probabilities of each source model of the round on the target images."""
        outputs = []
        for client in sorted(replies):
            self._model.load_state_dict(replies[client].arrays)
            outputs.append(torch.softmax(self.target.outputs_of(self._model), dim=1))
        return torch.stack(outputs)

    def _train_target_model(self, start: nn.Module, pseudo_labelled: ClientData, round_number: int) -> nn.Module:
        """Eq. 10: the global model fine-tuned on the pseudo-labelled images (cross-entropy
        against their pseudo-labels) with the method's client optimiser and local budget."""
        model = copy.deepcopy(start).to(self.device)
        train_locally(model, pseudo_labelled, self.hparams, self.budget, seeded_generator(self.seed, ADAPTATION_PURPOSE, round_number),
                      lambda batch: nn.functional.cross_entropy(model(batch.inputs), batch.targets), device=self.device)
        return model

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        if self.target is None:
            raise RuntimeError("knowledge-vote adaptation runs under protocol: domain_adaptation only (no target images were given)")
        pseudo_labels = knowledge_vote(self._probabilities(replies), self.confidence_gate)
        summary = self.inner.aggregate(round_number, replies)
        kept = pseudo_labels >= 0
        count = int(kept.sum())
        if count:
            global_model = self.inner.global_model()
            pseudo_labelled = ClientData(self.target.images[kept], pseudo_labels[kept], torch.zeros(count, dtype=torch.long),
                                         scaling=self.target.scaling)
            with torch.random.fork_rng():  # dropout draws of the target model, seeded per round
                torch.manual_seed(derive_seed(self.seed, ADAPTATION_PURPOSE, round_number, 1))
                target_model = self._train_target_model(global_model, pseudo_labelled, round_number)
            sources = sum(reply.num_examples for reply in replies.values())
            global_model.load_state_dict(weighted_average([global_model.state_dict(), to_host(target_model.state_dict())],
                                                          [sources, count]))
        summary.telemetry["pseudo_labels"] = pseudo_labels.tolist()
        return summary

    def global_model(self) -> nn.Module:
        return self.inner.global_model()

    def evaluation_models(self):
        return self.inner.evaluation_models()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])


__all__ = ["KnowledgeVoteAdaptation", "knowledge_vote"]
