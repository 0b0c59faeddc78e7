"""Federated self-supervised learning: the client machinery shared by FedSimCLR, FedMoCo, FedBYOL,
FedSimSiam (registered in :mod:`fedbed.algorithms.self_supervised_baselines`), FedEMA
(:mod:`fedbed.algorithms.fedema`) and FedGaLA (:mod:`fedbed.algorithms.fedgala`); the objectives are in
:mod:`fedbed.algorithms.base.self_supervised_objectives`, their sources below.

FedGaLA (``fedgala.md``) learns a representation from unlabelled clients and compares it with
federated versions of four self-supervised objectives (Sec. 4 "Baselines", Table 1) and FedEMA
(Zhuang, Wen, Zhang, ICLR 2022). Every client trains on two augmented views of each image of a
batch (App. B.1: SimCLR's views, FedBed's ``simclr`` augmentation with k = 2) and never reads a
label: the trainer hands the batches a copy of the client's data whose labels are all −1, so a
loss that tried to use them would fail, and a run with corrupted labels is bit-identical.

The model stays a :class:`~fedbed.models.DomainClassifier` (featurizer + classifier head, so the
``linear_probe`` evaluation and every tool that expects one work) and gains a projector
(:class:`SelfSupervisedModel`): a two-layer MLP ``Linear → BatchNorm → ReLU → Linear`` on the
featurizer (App. B.2, FedEMA's projector: 4096 hidden, 2048 out). The featurizer and projector
travel in the payload and are averaged; the classifier head receives no gradient and stays as
initialised (the linear probe trains its own). What a method keeps on the client (BYOL's and
SimSiam's predictor and BYOL's target network, MoCo's momentum encoder and queue) lives in the
client's persistent state and never travels: the server averages the online encoder and
projector only (Zhuang et al. 2021, as ``fedgala.md`` Sec. 4 "Baselines" follows for BYOL and
SimSiam).

Objectives (one :class:`Objective` each; the views of a batch pass through a network as one
concatenated batch of 2B images, so BatchNorm sees both views, as in SimCLR's global BN):

- SimCLR (Chen et al. 2020, Eq. 1): NT-Xent over the 2B projections, temperature 0.5 (App.
  B.9's CIFAR-10 choice, the authors' code).
- MoCo (He et al. 2020, Eq. 1 and Algorithm 1): InfoNCE of each query against its key from a
  momentum encoder (featurizer + projector) and a queue of past keys, both in the client state.
  The loss is symmetrised and summed, ``L(q1, k2) + L(q2, k1)``, each term a batch mean (queries
  of each view against the keys of the other view, as MoCo v3's Algorithm 1 and MoCo's CIFAR
  demonstration write it; their mean would halve every step under SGD), so no network sees a
  batch of one. Settings for 32-px
  images: queue 4096, projection 128, momentum 0.99, temperature 0.1 (MoCo's CIFAR-10
  demonstration; the ImageNet queue of 65,536 keys of width 2048 would hold 512 MiB per client).
- BYOL (Grill et al. 2020, Eq. 2): a predictor (same architecture as the projector, App. B.2)
  on the online projection regresses the target network's projection of the other view,
  ``2 − 2 cos``, summed over both directions; the target network is an exponential moving
  average of the online featurizer + projector with decay 0.99 (FedU and FedEMA's value).
- SimSiam (Chen and He 2021, Eq. 1-2): ``−½ (cos(p1, sg(z2)) + cos(p2, sg(z1)))`` with a
  bottleneck predictor (hidden 512); the projector is the shared two-layer MLP of App. B.2
  rather than SimSiam's three-layer one.

FedEMA (Zhuang, Wen, Zhang 2022) is BYOL clients that start from a divergence-aware moving average
of their own and the global model (:mod:`fedbed.algorithms.fedema`).

Optimisers (App. B.3): FedSimCLR (and FedGaLA) Adam with learning rate 3e-3; FedMoCo SGD 0.025,
FedBYOL, FedSimSiam and FedEMA SGD 0.03, all SGD with momentum 0.9 and weight decay 3e-4 (the
FedEMA authors' own runs use 0.032 cosine-decayed and 5e-4; FedGaLA's B.3 values are kept so
that every baseline of its Table 1 shares them). As every FedBed client, each round starts a
fresh optimiser. Batches are FedBed's (the last of an epoch may be smaller; the authors drop it).

Regularisers (FedGaLA App. B.4, Table 7), options of every method here: ``l2_coefficient`` λ adds
λ‖Θ_i‖² over the trained parameters (featurizer and projector, Eq. 53) and
``proximal_coefficient`` μ adds μ‖Θ_i − Θ_g‖² around the model the server sent (Eq. 55, without
FedProx's ½).

Every method here scores its representation with the ``linear_probe`` protocol
(:mod:`fedbed.federation.linear_probe`), the only place that reads labels.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainer,
    LocalTrainingHyperparameters,
    proximal_term,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy
from fedbed.algorithms.base.registry import Algorithm, AlgorithmContext
from fedbed.data.augmentation import AUGMENTATIONS, Augmentation
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.devices import to_device
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import Payload
from fedbed.federation.strategy import ServerStrategy
from fedbed.models import DomainClassifier


def projection_head(in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    """The two-layer MLP of FedGaLA App. B.2 (FedEMA's projector and predictor):
    ``Linear(in, hidden) → BatchNorm1d → ReLU → Linear(hidden, out)``, ``[N, in] -> [N, out]``."""
    return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True),
                         nn.Linear(hidden_dim, out_dim))


class SelfSupervisedModel(DomainClassifier):
    """A :class:`DomainClassifier` with a projector on its featurizer (FedGaLA App. B.2 (iii)).

    ``forward`` is the classifier's (logits ``[B, num_classes]``); :meth:`embed` gives the
    projection ``[B, projection_dim]`` the self-supervised losses use. The featurizer, the
    classifier and the projector are all in the state dict, so all three travel and are averaged;
    so does ``predictor`` when it is built here (FedEMA's shared predictor).

    Args:
        base: the protocol's model (its featurizer and classifier are reused, not copied).
        hidden_dim: the projector's hidden width.
        projection_dim: the projection's width.
        predictor_hidden_dim: build a predictor ``[B, projection_dim] -> [B, projection_dim]``
            of this hidden width into the model (it then travels); ``None``: none (a method's
            predictor, if any, stays on the client).
    """

    def __init__(self, base: DomainClassifier, hidden_dim: int, projection_dim: int,
                 predictor_hidden_dim: int | None = None) -> None:
        super().__init__(base.featurizer, base.classifier, base.feature_dim)
        self.projector = projection_head(base.feature_dim, hidden_dim, projection_dim)
        self.projection_dim = projection_dim
        self.predictor = (projection_head(projection_dim, predictor_hidden_dim, projection_dim)
                          if predictor_hidden_dim is not None else None)

    def online_network(self) -> nn.Sequential:
        """Featurizer then projector, sharing this model's modules: ``[B, C, H, W] -> [B, projection_dim]``."""
        return nn.Sequential(self.featurizer, self.projector)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """The projection ``[B, projection_dim]`` of images ``[B, C, H, W]``."""
        return self.projector(self.featurizer(images))


@dataclasses.dataclass
class Objective(ABC):
    """One self-supervised objective on the two views of a batch.

    Its settings are dataclass fields whose defaults are the source's; :meth:`from_hyperparameters`
    takes a field's value from the method's hyperparameters when they have one of that name.
    Modules it keeps on the client (:meth:`local_modules`) and tensors (:meth:`initial_buffers`)
    live in the client's persistent state.
    """

    name: ClassVar[str]
    trained_modules: ClassVar[tuple[str, ...]] = ()
    """Names of :meth:`local_modules` that the client's optimiser trains (predictors)."""

    @classmethod
    def from_hyperparameters(cls, hparams: Any) -> "Objective":
        """The objective with each field taken from ``hparams`` where it has that name."""
        return cls(**{f.name: getattr(hparams, f.name) for f in dataclasses.fields(cls) if hasattr(hparams, f.name)})

    def local_modules(self, model: SelfSupervisedModel) -> dict[str, nn.Module]:
        """Fresh modules kept on the client, initialised for its first round (none by default)."""
        return {}

    def initial_buffers(self, model: SelfSupervisedModel) -> dict[str, torch.Tensor]:
        """Tensors kept on the client from its first round (none by default)."""
        return {}

    @abstractmethod
    def loss(self, model: SelfSupervisedModel, views: torch.Tensor, modules: dict[str, nn.Module],
             buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one batch.

        Args:
            model: the online model.
            views: ``[2B, C, H, W]``, the first views of the batch then the second views.
            modules: the client's local modules.
            buffers: the client's local tensors (may be updated in place, e.g. MoCo's queue).
        """

    def after_step(self, model: SelfSupervisedModel, modules: dict[str, nn.Module]) -> None:
        """Called after every optimiser step (moving averages); nothing by default."""


def without_labels(data: ClientData) -> ClientData:
    """``data`` with every label replaced by −1: batches for a trainer that must not read labels
    (a loss that used them would fail on −1 or learn nothing from them)."""
    return ClientData(data.images, torch.full_like(data.targets, -1), data.domains, scaling=data.scaling)


class SelfSupervisedHyperparameters(LocalTrainingHyperparameters):
    """What every self-supervised method here shares (module docstring for the sources).

    Attributes:
        augmentation: the view pipeline (App. B.1: SimCLR's), two views per image.
        projection_hidden_dim: the projector's hidden width (App. B.2, FedEMA: 4096).
        projection_dim: the projection's width (App. B.2, FedEMA: 2048).
        l2_coefficient: λ of Eq. 53, ``λ‖Θ_i‖²`` (Table 7: 0.001, 0.01; default off).
        proximal_coefficient: μ of Eq. 55, ``μ‖Θ_i − Θ_g‖²`` (Table 7: 0.001, 0.01; default off).
        client_weight_decay: 0 for Adam (App. B.3 gives none for FedSimCLR and FedGaLA).
    """

    client_lr: float = Field(3e-3, gt=0)
    client_weight_decay: float = Field(0.0, ge=0)
    augmentation: Literal[tuple(AUGMENTATIONS)] = "simclr"
    projection_hidden_dim: int = Field(4096, gt=0)
    projection_dim: int = Field(2048, gt=0)
    l2_coefficient: float = Field(0.0, ge=0)
    proximal_coefficient: float = Field(0.0, ge=0)


class SelfSupervisedTrainer(LocalTrainer):
    """A client that trains featurizer + projector on an :class:`Objective`, never reading labels.

    Each round (hooks of :class:`~fedbed.algorithms.base.local_training.LocalTrainer`): the
    objective's local modules and tensors are restored from the client state, or created at the
    client's first round (a target or key network starts as a copy of the received online
    network) in :meth:`begin_round`; the model and the trained local modules share one
    optimiser; :meth:`end_round` stores the local modules and tensors back (in the round's copy
    of the state, which replaces the state only when the round succeeded). FedGaLA adds a
    :meth:`before_step`; FedEMA changes :meth:`starting_arrays`.

    Raises:
        TypeError: (at construction) a model factory that does not build a :class:`SelfSupervisedModel`.
    """

    hparams: SelfSupervisedHyperparameters
    model: SelfSupervisedModel

    def __init__(self, hparams: SelfSupervisedHyperparameters, context: AlgorithmContext, objective: Objective) -> None:
        super().__init__(hparams, context)
        self.objective = objective
        self.augmentation = Augmentation(hparams.augmentation, views=2)
        self.augment_inputs = False
        if not isinstance(self.model, SelfSupervisedModel):
            raise TypeError("a self-supervised trainer needs a SelfSupervisedModel; build it with the method's wrap_model")
        self.modules: dict[str, nn.Module] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def begin_round(self, model: SelfSupervisedModel, payload: Payload, state: dict[str, Any]) -> None:
        """The objective's client-side networks and tensors of this round, from the state."""
        self.modules = {name: module.to(self.device) for name, module in self.objective.local_modules(model).items()}
        for name, module in self.modules.items():
            if name in state.get("modules", {}):
                module.load_state_dict(state["modules"][name])
            module.train()
        self.buffers = ({name: tensor.clone() for name, tensor in state["buffers"].items()} if "buffers" in state
                        else to_device(self.objective.initial_buffers(model), self.device))

    def local_parameters(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """The parameters of the objective's trained local modules (predictors)."""
        return [p for name in self.objective.trained_modules if name in self.modules for p in self.modules[name].parameters()]

    def training_data(self, data: ClientData) -> ClientData:
        return without_labels(data)

    def batch_loss(self, model: SelfSupervisedModel, batch: Batch, payload: Payload, state: dict[str, Any]) -> torch.Tensor:
        return self.objective.loss(model, torch.cat(batch.views), self.modules, self.buffers) + self.regularisation(model, payload)

    def after_step(self) -> None:
        self.objective.after_step(self.model, self.modules)

    def regularisation(self, model: SelfSupervisedModel, payload: Payload) -> torch.Tensor | float:
        """Table 7's terms: ``λ‖Θ_i‖²`` over the trained parameters (Eq. 53) plus
        ``μ‖Θ_i − Θ_g‖²`` (Eq. 55; :func:`~fedbed.algorithms.base.local_training.proximal_term` is μ/2·‖·‖²)."""
        hparams, total = self.hparams, 0.0
        if hparams.l2_coefficient > 0:
            total = total + hparams.l2_coefficient * sum((p**2).sum() for p in model.online_network().parameters())
        if hparams.proximal_coefficient > 0:
            total = total + proximal_term(model, payload.arrays, 2.0 * hparams.proximal_coefficient)
        return total

    def end_round(self, model: SelfSupervisedModel, state: dict[str, Any]) -> None:
        if self.modules:
            state["modules"] = {name: clone_arrays(module.state_dict()) for name, module in self.modules.items()}
        if self.buffers:
            state["buffers"] = self.buffers


class SelfSupervisedAlgorithm(Algorithm):
    """A federated self-supervised method: FedAvg over featurizer and projector, clients on
    ``objective``, scored by the linear probe, drawing its own two views."""

    objective: ClassVar[type[Objective]]
    trainer_class: ClassVar[type[SelfSupervisedTrainer]] = SelfSupervisedTrainer
    evaluation_protocol = "linear_probe"
    draws_its_own_views = True

    def wrap_model(self, model: DomainClassifier, hparams: SelfSupervisedHyperparameters) -> SelfSupervisedModel:
        return SelfSupervisedModel(model, hparams.projection_hidden_dim, hparams.projection_dim)

    def build_objective(self, hparams: SelfSupervisedHyperparameters) -> Objective:
        """The client objective with the method's settings."""
        return self.objective.from_hyperparameters(hparams)

    def create_strategy(self, hparams: SelfSupervisedHyperparameters, context: AlgorithmContext) -> ServerStrategy:
        return FedAvgStrategy(context.seed)

    def create_trainer(self, hparams: SelfSupervisedHyperparameters, context: AlgorithmContext) -> SelfSupervisedTrainer:
        return self.trainer_class(hparams, context, self.build_objective(hparams))


__all__ = [
    "Objective", "SelfSupervisedAlgorithm", "SelfSupervisedHyperparameters", "SelfSupervisedModel", "SelfSupervisedTrainer", "projection_head", "without_labels",
]
