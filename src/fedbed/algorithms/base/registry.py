"""The algorithm registry: every method registers itself here by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from fedbed.algorithms.base.search_space import Distribution, SearchSpaceError, declared_search_space
from fedbed.data.augmentation import Augmentation
from fedbed.federation.devices import HOST, PRECISIONS
from fedbed.federation.strategy import ClientTrainer, ServerStrategy
from fedbed.models import DomainClassifier

if TYPE_CHECKING:
    from fedbed.algorithms.base.model_aggregation import ModelAggregation


class AlgorithmError(ValueError):
    """Raised for an unknown algorithm name or hyperparameters it does not accept."""


class Hyperparameters(BaseModel):
    """Base of every method's hyperparameters: unknown names are rejected, values validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class TrainingBudget:
    """How much each client trains per round: ``local_epochs`` passes or ``local_steps`` batches.

    Exactly one of the two is set; ``batch_size`` is in samples.
    """

    batch_size: int
    local_epochs: int | None = None
    local_steps: int | None = None

    def scaled(self, factor: int) -> "TrainingBudget":
        """This budget ``factor`` times over (``factor`` x the epochs or x the steps; 0 trains
        nothing): a method whose phases count in units of the run's budget (FedADG's E0 and E1).

        Raises:
            ValueError: a negative ``factor``.
        """
        if factor < 0:
            raise ValueError(f"a budget cannot be scaled by a negative factor, got {factor}")
        return TrainingBudget(self.batch_size,
                              None if self.local_epochs is None else self.local_epochs * factor,
                              None if self.local_steps is None else self.local_steps * factor)


@dataclass(frozen=True)
class AlgorithmContext:
    """What a method needs to build its server and client halves.

    Attributes:
        model_factory: returns a fresh model (same architecture every call).
        budget: the local training budget.
        seed: the run's seed.
        task: ``"classification"`` (cross-entropy) or ``"regression"`` (mean squared error).
        augmentation: the run's ``augmentation`` setting (``None``: train on the images as stored).
        device: where the clients train (:func:`fedbed.federation.devices.resolve_device`).
        precision: ``fp32`` (``None``), ``bf16`` or ``fp16``: the clients' mixed precision.
        rounds: the run's number of rounds (a server rule's schedule: FedDG-GA's decaying step);
            ``None`` outside a run.
    """

    model_factory: Callable[[], DomainClassifier]
    budget: TrainingBudget
    seed: int
    task: str = "classification"
    augmentation: Augmentation | None = None
    device: torch.device = HOST
    precision: str | None = None
    rounds: int | None = None


class Algorithm(ABC):
    """A federated method: its name, its source, its hyperparameters and its two halves.

    Class attributes:
        name: registry key (lower case, e.g. ``"fedavg"``).
        summary: one line with the source paper.
        hyperparameters: the pydantic model of its hyperparameters, defaults cited from the paper.
        pooled: True for Central / DeepAll (one client holding every source domain).
        dataset_defaults: per dataset name, hyperparameter values the paper uses there; they
            replace the general defaults and are themselves replaced by the user's values.
        dataset_run_settings: per dataset name, the run settings the paper trains with there
            (fields of :class:`fedbed.config.ExperimentConfig`: ``rounds``, ``local_epochs``,
            ``batch_size``, ``mixstyle``, ``holdout_fraction``, ``image_size``,
            ``participation_fraction``); they replace the general defaults of the settings a
            run leaves unset (a run that gives ``local_steps`` keeps its budget), so ``fedbed
            run --algorithm NAME --dataset D`` trains with the paper's budget on the paper's
            datasets. On other datasets the general defaults apply.
        evaluation_protocol: how the method's representation is scored unless the config says
            otherwise (``argmax``, or ``linear_probe`` for self-supervised methods).
        draws_its_own_views: the method augments its batches itself (its own hyperparameter
            names the augmentation), so the run's ``augmentation`` setting is refused for it.
        secure_aggregation_compatible: the server needs only the (weighted) sum of the clients'
            models, as FedAvg's, so it could run under secure aggregation; its strategy averages
            through :class:`fedbed.algorithms.base.model_aggregation.ModelAggregation`, where the run's
            ``robust_aggregation`` and ``differential_privacy`` plug in. ``False`` for a method
            whose server needs each client's own update or model (PPDG, AgrSum, PCGrad, FedGMA,
            FedGaLA's global alignment, hFedF's GradAlign, MCGDM's heads, Local-only): both
            settings are refused for it.
        precisions: the ``precision`` settings its clients can train in (every one by default;
            the others are refused at validation).
        server_rule: the method is a rule for combining FedAvg's clients on the server (FedAvg's
            average itself, PPDG, PCGrad, FedGMA, FedDG-GA, FedOMG): :meth:`create_aggregation`
            returns it, and a run may name it as its ``server`` beside another method's clients.
        server_rule_refusal: ``None`` when the method's server averages through
            :class:`~fedbed.algorithms.base.model_aggregation.FedAvgStrategy`'s seam, which a
            run's ``server`` rule replaces while the method's clients, and what its server sends
            them, stay its own; otherwise why it cannot (hFedF and pFedHN: their server
            generates each client's weights; Local-only: no global model; Central: one pooled
            client), completing "<method> ...".
        needs_supervised_clients: the method's server rule reads the loss of each client's
            classifier on its data (FedDG-GA's generalization gap), so clients that train a
            label-free representation are refused beside it.
        measured_failures: per dataset name, where the method's defaults were measured to fail
            on it (a model that collapses to one class, or stays below FedAvg by far) and the
            results doc that shows it; ``fedbed algorithms`` prints each, so a user meets the
            known defect before the run does.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    hyperparameters: ClassVar[type[Hyperparameters]]
    pooled: ClassVar[bool] = False
    dataset_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    dataset_run_settings: ClassVar[dict[str, dict[str, Any]]] = {}
    evaluation_protocol: ClassVar[str] = "argmax"
    draws_its_own_views: ClassVar[bool] = False
    secure_aggregation_compatible: ClassVar[bool] = True
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    server_rule: ClassVar[bool] = False
    server_rule_refusal: ClassVar[str | None] = None
    needs_supervised_clients: ClassVar[bool] = False
    measured_failures: ClassVar[dict[str, str]] = {}

    def wrap_model(self, model: DomainClassifier, hparams: Any) -> DomainClassifier:
        """The model the method trains, built around the protocol's model (unchanged by default;
        FedSR replaces the representation by a distribution)."""
        return model

    @abstractmethod
    def create_strategy(self, hparams: Any, context: AlgorithmContext) -> ServerStrategy:
        """The server half."""

    @abstractmethod
    def create_trainer(self, hparams: Any, context: AlgorithmContext) -> ClientTrainer:
        """The client half."""

    def search_space(self) -> dict[str, Distribution]:
        """The distributions a random hyperparameter search draws this method's hyperparameters
        from, declared beside its defaults (:func:`fedbed.algorithms.base.search_space.declared_search_space`).

        Raises:
            AlgorithmError: the method's hyperparameter class declares none (one line naming it).
        """
        try:
            return declared_search_space(self.hyperparameters, self.name)
        except SearchSpaceError as error:
            raise AlgorithmError(str(error)) from None

    def create_aggregation(self, hparams: Any, context: AlgorithmContext) -> "ModelAggregation":
        """The server rule of a method with :attr:`server_rule`: how the round's client models
        become the global model (:class:`~fedbed.algorithms.base.model_aggregation.ModelAggregation`).

        Raises:
            AlgorithmError: the method is not a server rule.
        """
        raise AlgorithmError(f"{self.name} is not a server rule; the server rules are "
                             f"{', '.join(sorted(n for n, c in ALGORITHMS.items() if c.server_rule))}")


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: add ``cls`` to :data:`ALGORITHMS` under ``cls.name``.

    Raises:
        AlgorithmError: if the name is taken.
    """
    if cls.name in ALGORITHMS:
        raise AlgorithmError(f"algorithm {cls.name!r} is registered twice")
    ALGORITHMS[cls.name] = cls
    return cls


def registered_algorithm(name: str) -> Algorithm:
    """An instance of the algorithm registered as ``name`` (case-insensitive); a composed
    ``CLIENT+SERVER`` method is :func:`fedbed.algorithms.base.composition.get_algorithm`'s.

    Raises:
        AlgorithmError: if no algorithm has that name.
    """
    key = name.lower()
    if key not in ALGORITHMS:
        raise AlgorithmError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[key]()


def resolve_hyperparameters(
    algorithm: Algorithm, overrides: dict[str, Any], dataset: str | None = None
) -> Hyperparameters:
    """The algorithm's defaults, its paper's values for ``dataset``, then ``overrides``, validated.

    Raises:
        AlgorithmError: one line naming the unknown key or the bad value and what is accepted.
    """
    try:
        return algorithm.hyperparameters(**{**algorithm.dataset_defaults.get(dataset or "", {}), **overrides})
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "?"
        known = ", ".join(algorithm.hyperparameters.model_fields)
        if first["type"] == "extra_forbidden":
            raise AlgorithmError(f"{algorithm.name} has no hyperparameter {key!r}; its hyperparameters are {known}") from None
        raise AlgorithmError(f"{algorithm.name} hyperparameter {key}: {first['msg']} (got {first.get('input')!r})") from None
