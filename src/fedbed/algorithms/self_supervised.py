"""Federated self-supervised learning: the client machinery shared by FedSimCLR, FedMoCo, FedBYOL,
FedSimSiam, FedEMA (registered here) and FedGaLA (:mod:`fedbed.algorithms.fedgala`).

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

FedEMA (Zhuang, Wen, Zhang 2022, Sec. 4.2): BYOL clients that start each round from
``μ W_k + (1 − μ) W_g`` instead of the global model W_g, where W_k is the client's own model of
its last round and ``μ = min(λ_k ‖W_g − W_k‖, 1)``; the scaler λ_k = τ / ‖W_g − W_k‖ is fixed at
the client's first round with a previous model (its second participation), so μ = τ then
(τ = 0.7, FedEMA's default). The divergence is the L2 norm of the flattened difference of the
online encoder's parameters (the featurizer's: the paper's W is the encoder; BatchNorm buffers
left out), as the Plato reimplementation measures it (the authors' EasyFL code measures the
client's own drift over its last round instead). Unlike FedBYOL here, FedEMA's predictor is part
of the model: it travels, is averaged by the server and mixed by the moving average, as in the
authors' code (EasyFL ``applications/fedssl``: server and client). The moving average covers
every floating-point array that travels (BatchNorm statistics included, as Plato; the authors'
code takes the buffers from the global model). The target network stays on the client.

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

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.fedavg import FedAvgStrategy
from fedbed.algorithms.fedprox import proximal_term
from fedbed.algorithms.local_training import LocalTrainingHyperparameters, augmentation_seed, round_hyperparameters, train_locally
from fedbed.algorithms.registry import Algorithm, AlgorithmContext, register_algorithm
from fedbed.data.augmentation import AUGMENTATIONS, Augmentation
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer, ServerStrategy
from fedbed.gradients import clone_arrays, flatten
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


def nt_xent_loss(first: torch.Tensor, second: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, Eq. 1), mean over the 2B anchors.

    With the 2B projections L2-normalised, ``s_ij = z_i·z_j / τ``, anchor i's positive is the other
    view of its image and ``ℓ_i = −log(exp(s_i,pos) / Σ_{k≠i} exp(s_ik))``.

    Args:
        first: ``[B, d]`` projections of the first views.
        second: ``[B, d]`` projections of the second views (row b is the same image as ``first[b]``).
        temperature: τ > 0.

    Raises:
        ValueError: shapes that differ or are not ``[B, d]``, or τ <= 0.
    """
    if first.dim() != 2 or first.shape != second.shape:
        raise ValueError(f"NT-Xent needs two [B, d] projections of one shape, got {tuple(first.shape)} and {tuple(second.shape)}")
    if temperature <= 0:
        raise ValueError(f"the NT-Xent temperature must be positive, got {temperature}")
    count = first.shape[0]
    z = nn.functional.normalize(torch.cat([first, second]), dim=1)
    logits = (z @ z.T / temperature).masked_fill(torch.eye(2 * count, dtype=torch.bool), float("-inf"))
    positives = torch.cat([torch.arange(count) + count, torch.arange(count)])
    return nn.functional.cross_entropy(logits, positives)


def queue_contrastive_loss(queries: torch.Tensor, keys: torch.Tensor, queue: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo's InfoNCE (He et al. 2020, Eq. 1): each query against its own key (positive) and the
    queue's keys (negatives), cross-entropy with the positive as class 0, batch mean.

    Args:
        queries: ``[N, d]`` (L2-normalised here; gradients flow).
        keys: ``[N, d]`` (L2-normalised here; no gradient flows).
        queue: ``[K, d]`` unit-norm keys of earlier batches.
        temperature: τ > 0.
    """
    q = nn.functional.normalize(queries, dim=1)
    k = nn.functional.normalize(keys.detach(), dim=1)
    logits = torch.cat([(q * k).sum(dim=1, keepdim=True), q @ queue.detach().T], dim=1) / temperature
    return nn.functional.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


def negative_cosine(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``−cos(p, sg(z))`` averaged over rows (SimSiam Eq. 1 with the stop-gradient of Eq. 3);
    BYOL's ``‖p̄ − z̄‖² = 2 − 2 cos`` is ``2 + 2·`` this. ``[N, d], [N, d] -> []``."""
    return -nn.functional.cosine_similarity(predictions, targets.detach(), dim=1).mean()


@torch.no_grad()
def moving_average(average: nn.Module, current: nn.Module, decay: float) -> None:
    """``ξ ← decay·ξ + (1 − decay)·θ`` for each parameter pair of two modules of one architecture
    (BYOL's target, MoCo's momentum encoder); buffers are left to the averaged module's own
    forward passes."""
    for kept, new in zip(average.parameters(), current.parameters()):
        kept.mul_(decay).add_(new.detach(), alpha=1.0 - decay)


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """Rows ``[first half; second half] -> [second half; first half]`` (the other view of each row)."""
    half = tensor.shape[0] // 2
    return torch.cat([tensor[half:], tensor[:half]])


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


@dataclasses.dataclass
class SimCLRObjective(Objective):
    """SimCLR (Chen et al. 2020): :func:`nt_xent_loss` of the two views' projections."""

    name: ClassVar[str] = "simclr"
    temperature: float = 0.5

    def loss(self, model, views, modules, buffers):
        first, second = model.embed(views).chunk(2)
        return nt_xent_loss(first, second, self.temperature)


@dataclasses.dataclass
class MoCoObjective(Objective):
    """MoCo (He et al. 2020), symmetrised, with a momentum encoder and a queue on the client."""

    name: ClassVar[str] = "moco"
    temperature: float = 0.1
    queue_size: int = 4096
    key_momentum: float = 0.99

    def local_modules(self, model):
        return {"key_network": copy.deepcopy(model.online_network())}

    def initial_buffers(self, model):
        queue = nn.functional.normalize(torch.randn(self.queue_size, model.projection_dim), dim=1)
        return {"queue": queue, "queue_position": torch.zeros((), dtype=torch.long)}

    def loss(self, model, views, modules, buffers):
        queries = model.embed(views)
        with torch.no_grad():
            keys = nn.functional.normalize(modules["key_network"](swap_halves(views)), dim=1)
        queue, half = buffers["queue"].clone(), len(views) // 2
        loss = (queue_contrastive_loss(queries[:half], keys[:half], queue, self.temperature)
                + queue_contrastive_loss(queries[half:], keys[half:], queue, self.temperature))
        # Enqueue (replacing the oldest keys) after the loss has read the queue.
        keys = keys[-self.queue_size:]
        position = int(buffers["queue_position"])
        buffers["queue"][(position + torch.arange(len(keys))) % self.queue_size] = keys
        buffers["queue_position"].fill_((position + len(keys)) % self.queue_size)
        return loss

    def after_step(self, model, modules):
        moving_average(modules["key_network"], model.online_network(), self.key_momentum)


@dataclasses.dataclass
class BYOLObjective(Objective):
    """BYOL (Grill et al. 2020): predictor on the online projection, EMA target network."""

    name: ClassVar[str] = "byol"
    trained_modules: ClassVar[tuple[str, ...]] = ("predictor",)
    target_decay: float = 0.99
    predictor_hidden_dim: int = 4096

    def local_modules(self, model):
        modules = {"target_network": copy.deepcopy(model.online_network())}
        if model.predictor is None:  # FedBYOL: the predictor stays on the client; FedEMA's is the model's
            modules["predictor"] = projection_head(model.projection_dim, self.predictor_hidden_dim, model.projection_dim)
        return modules

    def loss(self, model, views, modules, buffers):
        predictions = modules.get("predictor", model.predictor)(model.embed(views))
        with torch.no_grad():
            targets = swap_halves(modules["target_network"](views))
        return 2.0 * (2.0 + 2.0 * negative_cosine(predictions, targets))

    def after_step(self, model, modules):
        moving_average(modules["target_network"], model.online_network(), self.target_decay)


@dataclasses.dataclass
class SimSiamObjective(Objective):
    """SimSiam (Chen and He 2021): predictor, stop-gradient on the other view's projection."""

    name: ClassVar[str] = "simsiam"
    trained_modules: ClassVar[tuple[str, ...]] = ("predictor",)
    predictor_hidden_dim: int = 512

    def local_modules(self, model):
        return {"predictor": projection_head(model.projection_dim, self.predictor_hidden_dim, model.projection_dim)}

    def loss(self, model, views, modules, buffers):
        projections = model.embed(views)
        return negative_cosine(modules["predictor"](projections), swap_halves(projections))


OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (SimCLRObjective, MoCoObjective, BYOLObjective, SimSiamObjective)}
"""Objective name -> class."""


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


class SimCLRHyperparameters(SelfSupervisedHyperparameters):
    """FedSimCLR: Adam 3e-3 (App. B.3); NT-Xent temperature 0.5 (Chen et al. 2020, App. B.9)."""

    temperature: float = Field(0.5, gt=0)


class MomentumSGDHyperparameters(SelfSupervisedHyperparameters):
    """The baselines' optimiser (App. B.3): SGD, learning rate 0.03, momentum 0.9, weight decay 3e-4."""

    client_optimizer: Literal["adam", "sgd"] = "sgd"
    client_lr: float = Field(0.03, gt=0)
    client_momentum: float = Field(0.9, ge=0, lt=1)
    client_weight_decay: float = Field(3e-4, ge=0)


class MoCoHyperparameters(MomentumSGDHyperparameters):
    """FedMoCo: learning rate 0.025 (App. B.3); queue 4096, projection 128, key momentum 0.99,
    temperature 0.1 (MoCo's CIFAR-10 setting, module docstring)."""

    client_lr: float = Field(0.025, gt=0)
    projection_dim: int = Field(128, gt=0)
    temperature: float = Field(0.1, gt=0)
    queue_size: int = Field(4096, gt=0)
    key_momentum: float = Field(0.99, ge=0, lt=1)


class BYOLHyperparameters(MomentumSGDHyperparameters):
    """FedBYOL: target decay 0.99 (FedU, FedEMA), predictor hidden width 4096 (App. B.2)."""

    target_decay: float = Field(0.99, ge=0, lt=1)
    predictor_hidden_dim: int = Field(4096, gt=0)


class SimSiamHyperparameters(MomentumSGDHyperparameters):
    """FedSimSiam: predictor hidden width 512 (Chen and He 2021, Sec. 3)."""

    predictor_hidden_dim: int = Field(512, gt=0)


class FedEMAHyperparameters(BYOLHyperparameters):
    """FedEMA: BYOL's plus τ, the expected EMA weight μ at the client's first moving average
    (Zhuang, Wen, Zhang 2022: 0.7)."""

    expected_ema_weight: float = Field(0.7, ge=0, le=1)


StepHook = Callable[[torch.optim.Optimizer], None]


class SelfSupervisedTrainer(ClientTrainer):
    """A client that trains featurizer + projector on an :class:`Objective`, never reading labels.

    Each round: load the payload (or :meth:`starting_arrays`), restore the objective's local
    modules and tensors from the client state (or create them at the client's first round: a
    target or key network starts as a copy of the received online network), train with one
    optimiser over the model and the trained local modules, and store the local modules and
    tensors back in the state only when the round succeeded. Subclasses add a hook between
    backward and the optimiser step (:meth:`step_hook`, FedGaLA) or change the starting model
    (:meth:`starting_arrays`, FedEMA).

    Raises:
        TypeError: (at construction) a model factory that does not build a :class:`SelfSupervisedModel`.
    """

    def __init__(self, hparams: SelfSupervisedHyperparameters, context: AlgorithmContext, objective: Objective) -> None:
        self.hparams = hparams
        self.budget = context.budget
        self.objective = objective
        self.augmentation = Augmentation(hparams.augmentation, views=2)
        self.model = context.model_factory()
        if not isinstance(self.model, SelfSupervisedModel):
            raise TypeError("a self-supervised trainer needs a SelfSupervisedModel; build it with the method's wrap_model")

    def starting_arrays(self, payload: Payload, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The arrays the round starts from: the payload's (FedEMA mixes in the client's own)."""
        return payload.arrays

    def step_hook(self, payload: Payload, model: SelfSupervisedModel) -> tuple[StepHook | None, Callable[[], dict[str, float]]]:
        """A hook between backward and the optimiser step, and a function giving its metrics
        after the round; none by default."""
        return None, dict

    def regularisation(self, model: SelfSupervisedModel, payload: Payload) -> torch.Tensor | float:
        """Table 7's terms: ``λ‖Θ_i‖²`` over the trained parameters (Eq. 53) plus
        ``μ‖Θ_i − Θ_g‖²`` (Eq. 55; :func:`~fedbed.algorithms.fedprox.proximal_term` is μ/2·‖·‖²)."""
        hparams, total = self.hparams, 0.0
        if hparams.l2_coefficient > 0:
            total = total + hparams.l2_coefficient * sum((p**2).sum() for p in model.online_network().parameters())
        if hparams.proximal_coefficient > 0:
            total = total + proximal_term(model, payload.arrays, 2.0 * hparams.proximal_coefficient)
        return total

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        model, objective = self.model, self.objective
        model.load_state_dict(self.starting_arrays(payload, state))
        modules = objective.local_modules(model)
        for name, module in modules.items():
            if name in state.get("modules", {}):
                module.load_state_dict(state["modules"][name])
            module.train()
        buffers = ({name: tensor.clone() for name, tensor in state["buffers"].items()} if "buffers" in state
                   else objective.initial_buffers(model))
        trained = [p for name in objective.trained_modules if name in modules for p in modules[name].parameters()]
        hook, hook_metrics = self.step_hook(payload, model)

        def batch_loss(batch: Batch) -> torch.Tensor:
            return objective.loss(model, torch.cat(batch.views), modules, buffers) + self.regularisation(model, payload)

        generator = torch.Generator().manual_seed(int(payload.config["batch_seed"]))
        loss = train_locally(model, without_labels(data), round_hyperparameters(self.hparams, payload), self.budget, generator,
                             batch_loss, trained,
                             before_step=hook, after_step=lambda: objective.after_step(model, modules),
                             augmentation=self.augmentation, augmentation_seed=augmentation_seed(payload))
        self.remember(state, model)
        if modules:
            state["modules"] = {name: clone_arrays(module.state_dict()) for name, module in modules.items()}
        if buffers:
            state["buffers"] = buffers
        return Reply(arrays=clone_arrays(model.state_dict()), num_examples=len(data), metrics={"loss": loss, **hook_metrics()})

    def remember(self, state: dict[str, Any], model: SelfSupervisedModel) -> None:
        """Keep what the next round needs of this round's trained model (nothing by default)."""


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

    def remember(self, state: dict[str, Any], model: SelfSupervisedModel) -> None:
        state["own_model"] = clone_arrays(model.state_dict())

    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        working = dict(state)  # the state changes only when the round succeeds
        reply = super().fit(payload, data, working)
        reply.metrics["ema_weight"] = float(working.get("ema_weight", 0.0))
        state.clear()
        state.update(working)
        return reply


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


@register_algorithm
class FedSimCLR(SelfSupervisedAlgorithm):
    """FedSimCLR (``fedgala.md`` Sec. 4 "Baselines"): SimCLR clients, FedAvg."""

    name = "fedsimclr"
    summary = ("FedSimCLR (FedGaLA's baseline): SimCLR (Chen et al. 2020), NT-Xent on two views per client, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimCLRHyperparameters
    objective = SimCLRObjective


@register_algorithm
class FedMoCo(SelfSupervisedAlgorithm):
    """FedMoCo (``fedgala.md`` Sec. 4): MoCo clients (momentum encoder and queue stay local), FedAvg."""

    name = "fedmoco"
    summary = ("FedMoCo (FedGaLA's baseline): MoCo (He et al. 2020) with a local momentum encoder and queue, "
               "FedAvg of encoder + projector.")
    hyperparameters = MoCoHyperparameters
    objective = MoCoObjective


@register_algorithm
class FedBYOL(SelfSupervisedAlgorithm):
    """FedBYOL (``fedgala.md`` Sec. 4; Zhuang et al. 2021): predictor and target stay local."""

    name = "fedbyol"
    summary = ("FedBYOL (FedGaLA's baseline): BYOL (Grill et al. 2020) with a local predictor and target, "
               "FedAvg of online encoder + projector.")
    hyperparameters = BYOLHyperparameters
    objective = BYOLObjective


@register_algorithm
class FedSimSiam(SelfSupervisedAlgorithm):
    """FedSimSiam (``fedgala.md`` Sec. 4; Zhuang et al. 2021): the predictor stays local."""

    name = "fedsimsiam"
    summary = ("FedSimSiam (FedGaLA's baseline): SimSiam (Chen and He 2021) with a local predictor, "
               "FedAvg of encoder + projector.")
    hyperparameters = SimSiamHyperparameters
    objective = SimSiamObjective


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


__all__ = [
    "OBJECTIVES", "BYOLObjective", "FedBYOL", "FedEMA", "FedMoCo", "FedSimCLR", "FedSimSiam", "MoCoObjective", "Objective",
    "SelfSupervisedAlgorithm", "SelfSupervisedHyperparameters", "SelfSupervisedModel", "SelfSupervisedTrainer",
    "SimCLRHyperparameters", "SimCLRObjective", "SimSiamObjective", "ema_weight", "negative_cosine", "nt_xent_loss",
    "projection_head", "queue_contrastive_loss", "without_labels",
]
