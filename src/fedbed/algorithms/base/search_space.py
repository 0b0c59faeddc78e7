"""Hyperparameter search distributions, declared by each method beside its defaults, and the
draws of a sweep's random search (``hparams: {search: random, trials: N, seed: S}``).

DomainBed's protocol (Gulrajani & Lopez-Paz, ICLR 2021, Sec. 4 and its
``domainbed/hparams_registry.py``): every algorithm gets the same number of trials; trial 0
runs the defaults and every other trial draws each hyperparameter from its declared
distribution; the trial to report is chosen by training-domain validation
(:func:`fedbed.reporting.select_hyperparameters`).

A hyperparameter class declares the distributions of the hyperparameters it adds (or whose
default it changes) in a class attribute, with the source of each range::

    class FedProxHyperparameters(LocalTrainingHyperparameters):
        mu: float = Field(0.01, ge=0)
        search_space = {"mu": LogUniform(1e-3, 1.0, source="...")}

A class's space is its own declaration merged over its bases' (:func:`declared_search_space`);
``search_space = {}`` declares that a class adds nothing to search beyond its bases', and a name
declared ``None`` is not searched (pFedHN: hFedF's EMA decay, which it does not use). A class
that declares nothing cannot be searched: its method settings would stay at their defaults while
the other methods' are tuned, which is not an equal budget.

Each draw comes from its own generator seeded from (search seed, method name, trial, name of
the hyperparameter) (:func:`draw_trial`), so a method's draws do not depend on which other
methods a sweep lists, nor on which other hyperparameters it declares. With common draws
(``hparams: {..., draws: common}``) the method's name is left out of the seed: in each trial every
method draws a hyperparameter they share (the client learning rate, the weight decay) from the
same random number, so where their distributions are the same they get the same value, and a
comparison of tuned methods does not depend on which method drew the luckier rates (common
random numbers; DomainBed draws per method).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from fedbed.seeding import derive_seed, name_seed

SIGNIFICANT_DIGITS = 4
"""Drawn numbers are rounded to this many significant digits: readable in ``config.yaml`` and
the reports, and the same on every machine (a job's identity is a hash of its settings, and the
last bits of ``exp`` may differ between C libraries)."""


def _rounded(value: float, low: float, high: float) -> float:
    """``value`` to :data:`SIGNIFICANT_DIGITS` significant digits, kept inside ``[low, high]``."""
    return min(max(float(f"{value:.{SIGNIFICANT_DIGITS}g}"), low), high)


@dataclass(frozen=True)
class Distribution:
    """A distribution a hyperparameter is drawn from; ``source`` says where its range comes from
    (a paper's table or section, DomainBed's registry, or "FedBed's choice")."""

    source: str = field(kw_only=True)

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError(f"{type(self).__name__} needs a source for its range")

    def sample(self, generator: random.Random) -> Any:
        """One value drawn with ``generator``."""
        raise NotImplementedError

    def contains(self, value: Any) -> bool:
        """Whether ``value`` lies in the distribution's support."""
        raise NotImplementedError


@dataclass(frozen=True)
class LogUniform(Distribution):
    """``exp(U(log low, log high))``: DomainBed's ``10**r.uniform(a, b)`` is
    ``LogUniform(10**a, 10**b)``. Values in ``[low, high]``.

    Raises:
        ValueError: unless ``0 < low < high``.
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.low < self.high:
            raise ValueError(f"LogUniform needs 0 < low < high, got {self.low} and {self.high}")

    def sample(self, generator: random.Random) -> float:
        exponent = math.log(self.low) + generator.random() * (math.log(self.high) - math.log(self.low))
        return _rounded(math.exp(exponent), self.low, self.high)

    def contains(self, value: Any) -> bool:
        return isinstance(value, float) and self.low <= value <= self.high

    def __str__(self) -> str:
        return f"LogUniform({self.low:.3g}, {self.high:.3g})"


@dataclass(frozen=True)
class Uniform(Distribution):
    """``U(low, high)``; values in ``[low, high]``.

    Raises:
        ValueError: unless ``low < high``.
    """

    low: float
    high: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.low < self.high:
            raise ValueError(f"Uniform needs low < high, got {self.low} and {self.high}")

    def sample(self, generator: random.Random) -> float:
        return _rounded(self.low + generator.random() * (self.high - self.low), self.low, self.high)

    def contains(self, value: Any) -> bool:
        return isinstance(value, float) and self.low <= value <= self.high

    def __str__(self) -> str:
        return f"Uniform({self.low:.3g}, {self.high:.3g})"


@dataclass(frozen=True)
class Choice(Distribution):
    """One of ``values``, each with probability 1/len(values) (DomainBed's ``r.choice``).

    Raises:
        ValueError: no value.
    """

    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise ValueError("Choice needs at least one value")

    def sample(self, generator: random.Random) -> Any:
        return self.values[min(int(generator.random() * len(self.values)), len(self.values) - 1)]

    def contains(self, value: Any) -> bool:
        return value in self.values

    def __str__(self) -> str:
        return f"Choice({', '.join(str(value) for value in self.values)})"


SearchSpace = Mapping[str, Distribution]
"""Hyperparameter name -> the distribution its random-search trials draw it from."""

SearchSpaceDeclaration = Mapping[str, Distribution | None]
"""What a hyperparameter class declares in ``search_space``: a distribution per name, or
``None`` to leave a name its base declares out of the search."""

DRAWS = ("per_method", "common")
"""Whose random numbers a random search's trial draws from: each method its own (``per_method``,
DomainBed's), or one per hyperparameter name for every method (``common``, :func:`draw_trial`)."""

SEARCHES = ("grid", "random")
"""How a sweep chooses hyperparameter values: ``grid`` (the values its ``hp`` lists) or
``random`` (trials drawn from the methods' declared distributions)."""


class SearchSpaceError(ValueError):
    """A method that declares no search distributions was searched randomly, or a declaration
    names a hyperparameter its class does not have."""


def declared_search_space(hyperparameters: type[BaseModel], method: str) -> dict[str, Distribution]:
    """The search space of a hyperparameter class: the ``search_space`` class attributes of the
    class and its bases, the class's own over its bases', without the names declared ``None``.

    Args:
        hyperparameters: a method's hyperparameter class.
        method: the method's name, for the error.

    Raises:
        SearchSpaceError: the class itself declares no ``search_space`` (one line naming the
            method and the class), or a declaration names a hyperparameter the class lacks.
    """
    if "search_space" not in vars(hyperparameters):
        raise SearchSpaceError(
            f"{method} declares no hyperparameter search distributions ({hyperparameters.__name__}.search_space), so "
            f"hparams.search: random cannot tune it; declare them beside its defaults (docs/architecture.md, "
            f"'Adding a method'), or leave {method} out of this sweep")
    declared: dict[str, Distribution | None] = {}
    for cls in reversed(hyperparameters.__mro__):
        declared.update(vars(cls).get("search_space") or {})
    space = {name: distribution for name, distribution in declared.items() if distribution is not None}
    unknown = sorted(set(space) - set(hyperparameters.model_fields))
    if unknown:
        raise SearchSpaceError(f"{hyperparameters.__name__}.search_space names {', '.join(unknown)}, which "
                               f"{method} does not have")
    return space


class HyperparameterTrial(BaseModel):
    """Which trial of a random search a run is (a sweep job's ``hparams_trial`` setting, recorded
    in its ``config.yaml`` and summary). Its hyperparameter values are in the run's ``hp``; this
    record names where they came from. The number of trials is not part of it, so a search
    extended to more trials keeps its first jobs.

    Attributes:
        search: ``random``.
        seed: the search seed S of the draws (:func:`draw_trial`).
        trial: the trial index; 0 runs the method's defaults.
        draws: ``common`` for a trial drawn with common draws (:func:`draw_trial`); unset for
            DomainBed's per-method draws and for trial 0, which draws nothing (so the jobs of a
            search without common draws keep their identity, and trial 0 is the same job either way).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    search: Literal["random"] = "random"
    seed: int = Field(ge=0)
    trial: int = Field(ge=0)
    draws: Literal["common"] | None = None

    @model_validator(mode="after")
    def _trial_zero_draws_nothing(self) -> "HyperparameterTrial":
        if self.trial == 0 and self.draws is not None:
            raise ValueError("trial 0 runs the defaults and draws nothing: leave draws unset for it")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_draws(self, handler: Any) -> dict[str, Any]:
        # Every record (config.yaml, summary.json, the job's hash) of a per-method trial stays as
        # it was before common draws existed, so a search's jobs keep their identity and resume.
        dumped = handler(self)
        if dumped.get("draws") is None:
            dumped.pop("draws", None)
        return dumped


def draw_trial(space: SearchSpace, search_seed: int, method: str, trial: int,
               fixed: frozenset[str] | set[str] = frozenset(), draws: str = "per_method") -> dict[str, Any]:
    """The hyperparameter values of one random-search trial of ``method``: none for trial 0 (the
    method's defaults, DomainBed's ``hparams_seed`` 0), else one draw from each distribution of
    ``space`` but those named in ``fixed`` (held at the value a sweep sets), each from a
    ``random.Random`` seeded from (``search_seed``, ``method``, ``trial``, the name)
    (DomainBed seeds each name's draw likewise, ``misc.seed_hash(random_seed, name)``); with
    ``draws="common"``, from (``search_seed``, ``trial``, the name): the same random number for
    every method that declares the name, hence the same value where the distributions are equal.

    Returns:
        ``{name: value}``, sorted by name; floats rounded to :data:`SIGNIFICANT_DIGITS`
        significant digits inside the distribution's range.

    Raises:
        ValueError: a negative ``search_seed`` or ``trial``, or ``draws`` not in :data:`DRAWS`.
    """
    if search_seed < 0 or trial < 0:
        raise ValueError(f"the search seed and the trial index are non-negative, got {search_seed} and {trial}")
    if draws not in DRAWS:
        raise ValueError(f"draws must be one of {', '.join(DRAWS)}, got {draws!r}")
    if trial == 0:
        return {}
    owner = () if draws == "common" else (name_seed(method),)
    return {name: space[name].sample(random.Random(derive_seed(search_seed, *owner, trial, name_seed(name))))
            for name in sorted(space) if name not in fixed}
