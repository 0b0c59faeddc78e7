"""id / ood accuracy per domain and model selection over a run's rounds.

Evaluation protocols (:data:`EVALUATION_PROTOCOLS`): ``argmax`` scores the model's own
predictions (arg-max of its logits, or Pearson's r for regression); ``linear_probe`` freezes the
featurizer and scores a linear classifier trained on a seeded labelled share of each evaluated
domain (:mod:`fedbed.federation.linear_probe`; on the target it reads target labels).

Model selection (DomainBed, Gulrajani & Lopez-Paz 2021, Sec. 3): ``last`` takes the final
evaluated round; ``train_domain_val`` the round with the best mean id-validation accuracy over
the source domains (ties: the earliest); ``oracle`` the round with the best target accuracy —
it looks at the target domain, so it is always labelled "oracle" and is never a default.

Reports (not runs) add ``last_five_mean``: the mean of the last five evaluations, per domain
(:func:`mean_of_last_evaluations`). With one seed, ood accuracy moves by several points between
two evaluations of a run (``docs/results/pacs32-reproduction.md``); the mean of the final
evaluations is what a single final round estimates, with less noise. It reads no more than
``last`` does.
"""

from __future__ import annotations

import contextlib
import math
from statistics import fmean, stdev
from typing import Any

import torch
from torch import nn

from fedbed.federation.devices import HOST, on_device
from fedbed.federation.linear_probe import LinearProbe
from fedbed.federation.local_data import ClientData

SELECTION_RULES = ("last", "train_domain_val", "oracle")
LAST_FIVE_MEAN = "last_five_mean"
REPORT_SELECTIONS = (*SELECTION_RULES, LAST_FIVE_MEAN)
"""What ``fedbed report`` accepts: the rules of a run's summary and :data:`LAST_FIVE_MEAN`."""
EVALUATION_PROTOCOLS = ("argmax", "linear_probe")


_REGRESSION_SUMS = ("n", "sum_x", "sum_y", "sum_xx", "sum_yy", "sum_xy")


def metric_statistics(model: nn.Module, data: ClientData, task: str = "classification") -> dict[str, float]:
    """Sums from which the task's metric follows, and which add up over disjoint parts of a set,
    so that clients can each score their own share of a holdout and the server can combine them
    exactly (:func:`score_from_statistics`).

    Returns:
        classification: ``{"n", "correct"}`` (samples; samples whose arg-max logit is the label);
        regression: ``{"n", "sum_x", "sum_y", "sum_xx", "sum_yy", "sum_xy"}`` over the outputs
        ``x`` ``[n]`` and the targets ``y`` ``[n]``, in float64.

    Raises:
        KeyError: unknown task.
    """
    if task not in METRICS:
        raise KeyError(f"unknown task {task!r}; choose one of {', '.join(METRICS)}")
    if len(data) == 0:
        return {"n": 0.0, "correct": 0.0} if task == "classification" else dict.fromkeys(_REGRESSION_SUMS, 0.0)
    outputs = data.outputs_of(model)
    if task == "classification":
        return {"n": float(len(data)), "correct": float((outputs.argmax(dim=1) == data.targets).sum())}
    x, y = outputs.squeeze(1).to(torch.float64), data.targets.to(torch.float64)
    return {"n": float(len(data)), "sum_x": float(x.sum()), "sum_y": float(y.sum()), "sum_xx": float((x * x).sum()),
            "sum_yy": float((y * y).sum()), "sum_xy": float((x * y).sum())}


def add_statistics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise sum of :func:`metric_statistics` of disjoint parts of one set."""
    return {key: sum(part[key] for part in parts) for key in parts[0]} if parts else {}


def score_from_statistics(statistics: dict[str, float], task: str = "classification") -> float:
    """The task's metric from :func:`metric_statistics`: accuracy in percent, or Pearson's r
    (PPDG's regression metric on Poverty, Sec. 4.2),
    r = (n Σxy − Σx Σy) / sqrt((n Σxx − (Σx)²)(n Σyy − (Σy)²)).

    ``nan`` for an empty set, for fewer than two regression samples, and for a constant output
    or target.
    """
    n = statistics.get("n", 0.0)
    if task == "classification":
        return 100.0 * statistics["correct"] / n if n > 0 else float("nan")
    if n < 2:
        return float("nan")
    covariance = n * statistics["sum_xy"] - statistics["sum_x"] * statistics["sum_y"]
    variance_x = n * statistics["sum_xx"] - statistics["sum_x"] ** 2
    variance_y = n * statistics["sum_yy"] - statistics["sum_y"] ** 2
    if variance_x <= 0 or variance_y <= 0:
        return float("nan")
    return covariance / math.sqrt(variance_x * variance_y)


METRICS = {"classification": "accuracy", "regression": "pearson_r"}
"""Per task: the name of its metric (accuracy in percent; Pearson r)."""

IdStatistics = dict[tuple[int, int], dict[str, float]]
"""``(model index, source domain id) -> metric statistics`` of a model on a domain's holdout."""


def evaluate_models(
    models: list[tuple[nn.Module, tuple[int, ...] | None]],
    holdout: dict[int, ClientData],
    target: dict[int, ClientData],
    domain_names: tuple[str, ...],
    task: str = "classification",
    id_statistics: IdStatistics | None = None,
    probe: LinearProbe | None = None,
    num_classes: int = 0,
    seed: int = 0,
    id_domains: list[int] | None = None,
    device: torch.device = HOST,
) -> dict[str, Any]:
    """id and ood scores: accuracy (percent) or, for regression, Pearson r, per domain.

    Args:
        models: ``(model, domains)`` pairs; a model counts towards the id accuracy of the source
            domains in ``domains`` (all if ``None``) and towards every target domain. Several
            models (Local-only) are averaged.
        holdout: source domain id -> its id-validation samples (read only when
            ``id_statistics`` is ``None``).
        target: target domain id -> its samples.
        domain_names: names for the keys of the result.
        task: ``"classification"`` or ``"regression"`` (see :data:`METRICS`).
        id_statistics: the id statistics as the clients computed them on their shares of the
            holdouts (:mod:`fedbed.federation.client_evaluation`); a pair missing from it (its
            client was lost) makes that domain's id score ``nan``.
        probe: score by the ``linear_probe`` protocol instead of ``argmax`` (classification
            only; the id holdouts are then scored on the server).
        num_classes: the probe's output width.
        seed: the run's seed (fixes the probe's shares).
        id_domains: the source domains to score from ``id_statistics`` (default: ``holdout``'s,
            which a server holding no source data, the data being spread over the sites, lacks).
        device: where the models are scored (batched; each model returns to where it was).

    Returns:
        ``{"metric": name, "id": {domain: score}, "id_mean": float, "ood": {domain: score},
        "ood_mean": float}``; the means are unweighted over domains. A linear probe with
        ``repeats`` > 1 adds ``"probe_std": {"id": {domain: std}, "ood": {domain: std}}``: the
        sample standard deviation (percentage points) over the repeats, each repeat's score
        averaged over the models (FedGaLA Sec. 4 reports mean ± std over probe seeds).
    """
    with contextlib.ExitStack() as placed:
        for model in {id(model): model for model, _ in models}.values():
            placed.enter_context(on_device(model, device))
        return _scores(models, holdout, target, domain_names, task, id_statistics, probe, num_classes, seed, id_domains)


def _scores(models: list[tuple[nn.Module, tuple[int, ...] | None]], holdout: dict[int, ClientData],
            target: dict[int, ClientData], domain_names: tuple[str, ...], task: str, id_statistics: IdStatistics | None,
            probe: LinearProbe | None, num_classes: int, seed: int, id_domains: list[int] | None) -> dict[str, Any]:
    """:func:`evaluate_models` with the models where they are."""
    result: dict[str, Any] = {"metric": METRICS[task] if probe is None else "linear_probe_accuracy", "id": {}, "ood": {}}
    spread: dict[str, dict[str, float]] = {"id": {}, "ood": {}}

    def score(model: nn.Module, data: ClientData, domain_id: int) -> list[float]:
        """The score of ``model`` on ``data``: one value, or one per probe repeat."""
        if probe is not None:
            return probe.scores(model, data, num_classes, seed, domain_id)
        return [score_from_statistics(metric_statistics(model, data, task), task)]

    def record(kind: str, domain_id: int, per_model: list[list[float]]) -> None:
        """The models' mean score (each model's the mean of its repeats), and its spread over repeats."""
        scores = [sum(repeats) / len(repeats) for repeats in per_model]
        result[kind][domain_names[domain_id]] = sum(scores) / len(scores)
        if probe is None or min(map(len, per_model)) < 2:  # scores the clients computed have no repeats
            return
        per_repeat = [fmean(values) for values in zip(*per_model)]
        nan = any(math.isnan(value) for value in per_repeat)
        spread[kind][domain_names[domain_id]] = float("nan") if nan else stdev(per_repeat)

    for domain_id in holdout if id_statistics is None or id_domains is None else id_domains:
        counted = [j for j, (_, ds) in enumerate(models) if ds is None or domain_id in ds]
        if id_statistics is None:
            per_model = [score(models[j][0], holdout[domain_id], domain_id) for j in counted]
        else:
            per_model = [[score_from_statistics(id_statistics[(j, domain_id)], task) if (j, domain_id) in id_statistics
                          else float("nan")] for j in counted]
        if per_model:
            record("id", domain_id, per_model)
    for domain_id, data in target.items():
        record("ood", domain_id, [score(m, data, domain_id) for m, _ in models])
    if spread["id"] or spread["ood"]:
        result["probe_std"] = spread
    for kind in ("id", "ood"):
        values = list(result[kind].values())
        result[f"{kind}_mean"] = sum(values) / len(values) if values else float("nan")
    return result


def select_round(evaluations: list[dict[str, Any]], rule: str) -> dict[str, Any]:
    """Pick one evaluated round by a model-selection rule (rounds whose score is NaN are skipped).

    Args:
        evaluations: one dict per evaluated round with ``round``, ``id_mean`` and ``ood_mean``,
            in round order.
        rule: one of :data:`SELECTION_RULES`. Only ``oracle`` reads ``ood_mean``.

    Returns:
        The chosen dict, with ``selection`` set to the rule (``"oracle"`` for the oracle).

    Raises:
        ValueError: unknown rule or no evaluated round.
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"unknown model selection {rule!r}; choose one of {', '.join(SELECTION_RULES)}")
    if not evaluations:
        raise ValueError("no evaluated round to select from")
    if rule == "last":
        chosen = evaluations[-1]
    else:
        key = "id_mean" if rule == "train_domain_val" else "ood_mean"
        scored = [e for e in evaluations if e[key] is not None and not math.isnan(e[key])]
        if not scored:
            raise ValueError(f"no evaluated round has a {key} score to select by {rule}")
        best = max(e[key] for e in scored)
        chosen = next(e for e in scored if e[key] == best)
    return {**chosen, "selection": rule}


def mean_of_last_evaluations(evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """:data:`LAST_FIVE_MEAN`: the mean of a run's last five evaluations (all, if it has fewer).

    Args:
        evaluations: one dict per evaluated round with ``round``, ``metric``, ``id`` and ``ood``
            (domain name -> score), ``id_mean`` and ``ood_mean``, in round order (the
            ``evaluation`` entries of ``rounds.jsonl``).

    Returns:
        A dict shaped as :func:`select_round`'s: ``id``, ``ood``, ``id_mean`` and ``ood_mean``
        averaged over the evaluations (a NaN score, e.g. a lost client's domain, is left out of
        its mean; all NaN gives NaN), ``round`` the last evaluated round, ``rounds`` the averaged
        ones, ``metric`` and ``selection`` (:data:`LAST_FIVE_MEAN`).

    Raises:
        ValueError: no evaluated round.
    """
    if not evaluations:
        raise ValueError("no evaluated round to average")
    last = evaluations[-5:]

    def mean(values: list[float | None]) -> float:
        kept = [value for value in values if value is not None and not math.isnan(value)]
        return sum(kept) / len(kept) if kept else float("nan")

    scores = {kind: {domain: mean([e[kind].get(domain) for e in last]) for domain in last[-1][kind]} for kind in ("id", "ood")}
    return {"round": last[-1]["round"], "rounds": [e["round"] for e in last], "metric": last[-1].get("metric"), **scores,
            "id_mean": mean([e["id_mean"] for e in last]), "ood_mean": mean([e["ood_mean"] for e in last]),
            "selection": LAST_FIVE_MEAN}


def format_domain_table(selected: dict[str, dict[str, Any]]) -> str:
    """A plain-text table: one row per selection rule, one column per domain (id then ood); a
    linear probe's spread over its repeats (``probe_std``) follows a domain's score after ±."""
    def cell(entry: dict[str, Any], kind: str, domain: str) -> str:
        deviation = entry.get("probe_std", {}).get(kind, {}).get(domain)
        return f"{entry[kind][domain]:.1f}" + ("" if deviation is None else f"±{deviation:.1f}")

    first = next(iter(selected.values()))
    id_domains, ood_domains = list(first["id"]), list(first["ood"])
    header = ["selection", "round"] + [f"id:{d}" for d in id_domains] + ["id mean"]
    header += [f"ood:{d}" for d in ood_domains] + ["ood mean"]
    rows = [header]
    for rule, entry in selected.items():
        label = "oracle (reads target)" if rule == "oracle" else rule
        row = [label, str(entry["round"])]
        row += [cell(entry, "id", d) for d in id_domains] + [f"{entry['id_mean']:.1f}"]
        row += [cell(entry, "ood", d) for d in ood_domains] + [f"{entry['ood_mean']:.1f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
