"""Byzantine-robust aggregation of client models, with Flower's aggregation functions.

A server option for every method that averages (``robust_aggregation`` in the run's settings):
the round's client models are combined by

- ``median``: the coordinate-wise median (Yin et al., ICML 2018), ``flwr ... aggregate_median``;
- ``trimmed_mean``: the coordinate-wise mean after dropping the ``⌊β K⌋`` largest and smallest
  values (Yin et al. 2018; β = ``trimmed_fraction``), ``aggregate_trimmed_avg``;
- ``krum``: the one client model with the smallest sum of squared distances to its
  ``K − f − 2`` nearest others (Blanchard et al., NeurIPS 2017; f = ``byzantine_clients``),
  ``aggregate_krum(..., to_keep=0)``;
- ``multi_krum``: the n_k-weighted mean of the ``K − f`` models with the best Krum scores
  (Blanchard et al. 2017, Multi-Krum with m = n − f), ``aggregate_krum(..., to_keep=K − f)``.
  Flower returns the mean only; the kept clients that the log names (:func:`multi_krum_kept`)
  are found by the same rule on the same squared distances (Flower's ``_compute_distances``).

Median, trimmed mean and Krum ignore the clients' sizes n_k (as Flower's functions do).

**What the rules read.** Krum and Multi-Krum rank clients by distances over the trainable
floating-point parameters only (``ClientModels.parameter_names``): a buffer is no weight, and
BatchNorm's integer ``num_batches_tracked`` alone puts clients that ran different numbers of
steps 49 to thousands apart in squared distance, against about 1 for honest parameters, so that
distances over the whole state dict rank clients by their step counts. The buffers then follow the
clients that were kept: Krum takes its chosen client's buffers, Multi-Krum the n_k-weighted mean
of its kept clients' buffers (the weights of Flower's mean of their parameters). Median and the
trimmed mean combine each coordinate on its own, so they apply the same coordinate-wise rule to
the buffers as to the parameters (a buffer's coordinates cannot move a parameter's). Results are
cast back to each array's dtype (integer buffers rounded). Flower is imported when the rule runs, not when this module is
imported, so that a run without robust aggregation never imports Flower
(``tests/test_architecture.py``).
"""

from __future__ import annotations

from typing import Any

import numpy
import torch

from fedbed.algorithms.base.model_aggregation import ClientModels, ModelAggregation
from fedbed.federation.devices import HOST
from fedbed.federation.strategy import TooFewReplies

ROBUST_RULES = ("median", "trimmed_mean", "krum", "multi_krum")
"""The robust aggregation rules (see the module docstring)."""

DEFAULT_TRIMMED_FRACTION = 0.2
"""β of ``trimmed_mean`` when the run does not set ``trimmed_fraction``: one client of five cut at each end."""

DEFAULT_BYZANTINE_CLIENTS = 1
"""f of ``krum`` and ``multi_krum`` when the run does not set ``byzantine_clients``."""


def multi_krum_kept(models: list[list[numpy.ndarray]], byzantine_clients: int) -> list[int]:
    """The positions of the ``K − f`` models Multi-Krum averages (Blanchard et al., NeurIPS 2017,
    Sec. 4): each model's score is the sum of its squared distances to its ``max(1, K − f − 2)``
    nearest others, and the ``K − f`` lowest scores are kept (Flower's ``aggregate_krum``, with its
    distances and its order of sorting, so that the positions are those of the mean it returns).

    Args:
        models: K models, each a list of arrays (every model the same shapes).
        byzantine_clients: f.

    Returns:
        The kept positions in ascending order.
    """
    from flwr.server.strategy.aggregate import _compute_distances

    distances = _compute_distances(models)
    nearest = max(1, len(models) - byzantine_clients - 2)
    scores = [numpy.sum(row[numpy.argsort(row)[1:nearest + 1]]) for row in distances]
    keep = len(models) - byzantine_clients
    return sorted(int(index) for index in numpy.argsort(scores)[::-1][len(scores) - keep:])


def check_robust_aggregation(rule: str, clients_per_round: int, trimmed_fraction: float = DEFAULT_TRIMMED_FRACTION,
                             byzantine_clients: int = DEFAULT_BYZANTINE_CLIENTS) -> None:
    """Whether ``rule`` can do its job with ``clients_per_round`` clients a round.

    Raises:
        ValueError: an unknown rule; a median of fewer than 3 clients (it would be their mean);
            a trimmed mean that trims no client (``⌊β K⌋ = 0``) or ``β`` outside ``[0, 0.5)``;
            Krum or Multi-Krum with ``K < 2f + 3`` (Blanchard et al. 2017 need ``n > 2f + 2``).
    """
    if rule not in ROBUST_RULES:
        raise ValueError(f"unknown robust aggregation {rule!r}; choose one of {', '.join(ROBUST_RULES)}")
    if rule == "median" and clients_per_round < 3:
        raise ValueError(f"robust_aggregation: median needs at least 3 clients a round, this run has {clients_per_round}")
    if rule == "trimmed_mean" and not (0 <= trimmed_fraction < 0.5 and int(trimmed_fraction * clients_per_round) >= 1):
        raise ValueError(f"robust_aggregation: trimmed_mean with trimmed_fraction {trimmed_fraction} trims no client of "
                         f"the {clients_per_round} a round; give a trimmed_fraction in [{1 / clients_per_round:.3g}, 0.5)")
    if rule in ("krum", "multi_krum") and clients_per_round < 2 * byzantine_clients + 3:
        raise ValueError(f"robust_aggregation: {rule} tolerates f = {byzantine_clients} byzantine clients only with at "
                         f"least 2f + 3 = {2 * byzantine_clients + 3} clients a round; this run has {clients_per_round}")


class RobustAggregation(ModelAggregation):
    """One of :data:`ROBUST_RULES` in place of FedAvg's weighted average.

    Args:
        rule: the rule's name.
        trimmed_fraction: β of ``trimmed_mean``, in ``[0, 0.5)``.
        byzantine_clients: f of ``krum`` and ``multi_krum``.

    Raises:
        ValueError: an unknown rule, ``trimmed_fraction`` outside ``(0, 0.5)`` or
            ``byzantine_clients`` below 1.
    """

    def __init__(self, rule: str, trimmed_fraction: float = DEFAULT_TRIMMED_FRACTION,
                 byzantine_clients: int = DEFAULT_BYZANTINE_CLIENTS) -> None:
        if rule not in ROBUST_RULES:
            raise ValueError(f"unknown robust aggregation {rule!r}; choose one of {', '.join(ROBUST_RULES)}")
        if not 0 < trimmed_fraction < 0.5:
            raise ValueError(f"trimmed_fraction must lie in (0, 0.5): the share of clients cut at each end, got {trimmed_fraction}")
        if int(byzantine_clients) != byzantine_clients or byzantine_clients < 1:
            raise ValueError(f"byzantine_clients must be a whole number >= 1, got {byzantine_clients}")
        self.rule, self.trimmed_fraction, self.byzantine_clients = rule, trimmed_fraction, byzantine_clients

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The rule's model of the round (see :meth:`ModelAggregation.aggregate`).

        Returns:
            ``(state dict, {"robust_aggregation": rule, "selected": [client]})``; ``selected``
            names Krum's chosen client, or Multi-Krum's ``K − f`` kept clients in the order of
            ``models.clients`` (``None`` for the rules that mix coordinates).

        Raises:
            fedbed.federation.strategy.TooFewReplies: fewer replies than the rule needs
                (:func:`check_robust_aggregation`); the engine keeps the previous model.
        """
        # Imported here, not at the top: an in-process run without robust aggregation must not
        # import Flower (docs/architecture.md; tests/test_architecture.py).
        from flwr.server.strategy.aggregate import (
            aggregate_krum,
            aggregate_median,
            aggregate_trimmed_avg,
        )

        current, clients = models.current, models.clients
        try:
            check_robust_aggregation(self.rule, len(models.arrays), self.trimmed_fraction, self.byzantine_clients)
        except ValueError as error:  # fewer replies than the rule needs (clients dropped this round)
            raise TooFewReplies(f"{len(models.arrays)} replies: {error}") from None
        ranked = self.rule in ("krum", "multi_krum")
        # Krum ranks by the parameters alone; the coordinate-wise rules take every array.
        names = [name for name in current if name in models.parameter_names] if ranked else list(current)
        if not names:
            raise ValueError(f"robust_aggregation: {self.rule} has no trainable floating-point parameter to rank clients by")
        sizes = [max(1, round(weight)) for weight in models.weights]
        results = [([array[name].detach().to(HOST).numpy() for name in names], size)
                   for array, size in zip(models.arrays, sizes)]
        selected = None
        if self.rule == "median":
            combined = aggregate_median(results)
        elif self.rule == "trimmed_mean":
            combined = aggregate_trimmed_avg(results, self.trimmed_fraction)
        elif self.rule == "krum":
            combined = aggregate_krum(results, self.byzantine_clients, 0)
            kept = [next(i for i, (model, _) in enumerate(results) if model is combined)]
        else:
            combined = aggregate_krum(results, self.byzantine_clients, len(results) - self.byzantine_clients)
            kept = multi_krum_kept([model for model, _ in results], self.byzantine_clients)
        values = dict(zip(names, combined))
        if ranked:
            selected = [clients[index] for index in kept]
            total = sum(sizes[index] for index in kept)
            for name in current:  # the buffers of the kept clients, n_k-weighted as Flower's mean
                if name not in values:
                    values[name] = sum(models.arrays[index][name].detach().to(HOST).double().numpy() * (sizes[index] / total)
                                       for index in kept)
        state = {}
        for name in current:
            tensor = torch.as_tensor(values[name], dtype=torch.float64 if not current[name].is_floating_point() else None)
            state[name] = (tensor if current[name].is_floating_point() else tensor.round()).to(current[name].dtype).reshape(current[name].shape)
        return state, {"robust_aggregation": self.rule, "selected": selected}
