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
        classification: ``{"n", "correct", "predicted_0", ..., "predicted_{C-1}"}`` (samples;
        samples whose arg-max logit is the label; samples predicted as each class: the counts
        from which :func:`top_class` tells a collapsed model); regression: ``{"n", "sum_x", "sum_y", "sum_xx", "sum_yy", "sum_xy"}`` over the outputs
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
        predicted = outputs.argmax(dim=1)
        counts = torch.bincount(predicted, minlength=outputs.shape[1]).tolist()
        return {"n": float(len(data)), "correct": float((predicted == data.targets).sum()),
                **{f"{PREDICTED}{c}": float(count) for c, count in enumerate(counts)}}
    x, y = outputs.squeeze(1).to(torch.float64), data.targets.to(torch.float64)
    return {"n": float(len(data)), "sum_x": float(x.sum()), "sum_y": float(y.sum()), "sum_xx": float((x * x).sum()),
            "sum_yy": float((y * y).sum()), "sum_xy": float((x * y).sum())}


def add_statistics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise sum of :func:`metric_statistics` of disjoint parts of one set (a key a part lacks,
    an empty part's class counts, counts 0)."""
    keys = list(dict.fromkeys(key for part in parts for key in part))
    return {key: sum(part.get(key, 0.0) for part in parts) for key in keys}


PREDICTED = "predicted_"
"""Prefix of :func:`metric_statistics`' per-class prediction counts (``predicted_3``)."""

COLLAPSE_SHARE = 0.9
"""A model predicting one class for at least this share of the source holdouts has collapsed ..."""
COLLAPSE_EVALUATIONS = 3
"""... when it does so for this many evaluations in a row (:func:`collapse_of`)."""


def top_class(statistics: dict[str, float]) -> tuple[int, float] | None:
    """The most-predicted class of :func:`metric_statistics` (summed over parts or models) and
    the share of the samples predicted as it; ``None`` without class counts (regression, a
    linear probe, an empty set, statistics recorded before the counts were)."""
    counts = {int(key.removeprefix(PREDICTED)): value for key, value in statistics.items() if key.startswith(PREDICTED)}
    total = sum(counts.values())
    if not counts or total <= 0:
        return None
    best = max(counts, key=lambda c: (counts[c], -c))
    return best, counts[best] / total


def collapse_of(evaluations: list[dict[str, Any]], share: float = COLLAPSE_SHARE,
                in_a_row: int = COLLAPSE_EVALUATIONS) -> dict[str, Any] | None:
    """Whether a run's model collapsed to one class: the first of ``in_a_row`` consecutive
    evaluations whose most-predicted class over the pooled source holdouts (``top_class.id``)
    takes at least ``share`` of the samples (whichever class it is: a model jumping from one
    class to another between rounds has collapsed too).

    Returns:
        ``{"round": the first such evaluation's round, "class": its class index, "share": its
        share, "evaluations": how many evaluations in all met the condition}``, or ``None``.
    """
    found, streak_start, met = None, None, 0
    for index, evaluation in enumerate(evaluations):
        pooled = (evaluation.get("top_class") or {}).get("id")
        if pooled is None or pooled[1] < share:
            streak_start = None
            continue
        met += 1
        streak_start = index if streak_start is None else streak_start
        if found is None and index - streak_start + 1 >= in_a_row:
            first = evaluations[streak_start]
            found = {"round": first["round"], "class": first["top_class"]["id"][0], "share": first["top_class"]["id"][1]}
    return None if found is None else {**found, "evaluations": met}


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
        "ood_mean": float}``; the means are unweighted over domains. A classification scored by
        arg-max adds ``"top_class": {"id": [class, share], "id_domains": {domain: [class, share]},
        "ood": {domain: [class, share]}}``: the most-predicted class and the share of the samples
        predicted as it, over the pooled source holdouts and per domain (:func:`collapse_of`). A linear probe with
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

    predictions: dict[str, dict[int, list[dict[str, float]]]] = {"id": {}, "ood": {}}

    def score(model: nn.Module, data: ClientData, domain_id: int, kind: str) -> list[float]:
        """The score of ``model`` on ``data``: one value, or one per probe repeat."""
        if probe is not None:
            return probe.scores(model, data, num_classes, seed, domain_id)
        statistics = metric_statistics(model, data, task)
        predictions[kind].setdefault(domain_id, []).append(statistics)
        return [score_from_statistics(statistics, task)]

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
            per_model = [score(models[j][0], holdout[domain_id], domain_id, "id") for j in counted]
        else:
            per_model = [[score_from_statistics(id_statistics[(j, domain_id)], task) if (j, domain_id) in id_statistics
                          else float("nan")] for j in counted]
            predictions["id"][domain_id] = [id_statistics[(j, domain_id)] for j in counted if (j, domain_id) in id_statistics]
        if per_model:
            record("id", domain_id, per_model)
    for domain_id, data in target.items():
        record("ood", domain_id, [score(m, data, domain_id, "ood") for m, _ in models])
    if spread["id"] or spread["ood"]:
        result["probe_std"] = spread
    tops = {kind: {domain_names[d]: top_class(add_statistics(parts)) for d, parts in by_domain.items()}
            for kind, by_domain in predictions.items()}
    pooled = top_class(add_statistics([part for parts in predictions["id"].values() for part in parts]))
    if pooled is not None:  # classification by arg-max: the share of the most-predicted class
        result["top_class"] = {"id": list(pooled), "id_domains": {n: list(t) for n, t in tops["id"].items() if t},
                               "ood": {n: list(t) for n, t in tops["ood"].items() if t}}
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
        The chosen dict, with ``selection`` set to the rule (``"oracle"`` for the oracle). When no
        evaluated round has the rule's score (a site's share of the id holdouts was missing from
        every evaluation, so no ``id_mean``), no round is chosen: ``round`` is ``None``, every
        score NaN (the last evaluation's domains), and ``unavailable`` says why.

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
            last = evaluations[-1]
            return {"round": None, "id": dict.fromkeys(last["id"], math.nan), "ood": dict.fromkeys(last["ood"], math.nan),
                    "id_mean": math.nan, "ood_mean": math.nan, "selection": rule,
                    "unavailable": f"no evaluated round has a {key} score to select by {rule}"}
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


def recorded_score(value: float | None) -> float | None:
    """A score as a record holds it, or ``None`` when there is none: ``null`` (how the strict-JSON
    ``summary.json`` and ``rounds.jsonl`` write a non-finite number: no evaluated round had that
    score, e.g. a lost site's holdout share) or ``nan`` (the same score before it was written).
    Everything that reads a run's scores for a person (``fedbed run``'s table, reports, plots)
    reads them through this, so a missing score is shown as missing, never as a number."""
    return None if value is None or math.isnan(value) else float(value)


def format_score(value: float | None) -> str:
    """A score (accuracy in %) as every table shows it: one decimal, or "–" when the record holds
    none (:func:`recorded_score`)."""
    score = recorded_score(value)
    return "–" if score is None else f"{score:.1f}"


def format_domain_table(selected: dict[str, dict[str, Any]]) -> str:
    """A plain-text table: one row per selection rule, one column per domain (id then ood); a
    linear probe's spread over its repeats (``probe_std``) follows a domain's score after ±; a
    missing score (:func:`recorded_score`; from a summary in memory or read back) is "–"."""
    def cell(entry: dict[str, Any], kind: str, domain: str) -> str:
        deviation = recorded_score(entry.get("probe_std", {}).get(kind, {}).get(domain))
        return format_score(entry[kind].get(domain)) + ("" if deviation is None else f"±{deviation:.1f}")

    first = next(iter(selected.values()))
    id_domains, ood_domains = list(first["id"]), list(first["ood"])
    header = ["selection", "round"] + [f"id:{d}" for d in id_domains] + ["id mean"]
    header += [f"ood:{d}" for d in ood_domains] + ["ood mean"]
    rows = [header]
    for rule, entry in selected.items():
        label = "oracle (reads target)" if rule == "oracle" else rule
        row = [label, "–" if entry["round"] is None else str(entry["round"])]
        row += [cell(entry, "id", d) for d in id_domains] + [format_score(entry["id_mean"])]
        row += [cell(entry, "ood", d) for d in ood_domains] + [format_score(entry["ood_mean"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
