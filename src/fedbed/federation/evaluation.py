"""id / ood accuracy per domain and model selection over a run's rounds.

Model selection (DomainBed, Gulrajani & Lopez-Paz 2021, Sec. 3): ``last`` takes the final
evaluated round; ``train_domain_val`` the round with the best mean id-validation accuracy over
the source domains (ties: the earliest); ``oracle`` the round with the best target accuracy —
it looks at the target domain, so it is always labelled "oracle" and is never a default.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fedbed.federation.local_data import ClientData

SELECTION_RULES = ("last", "train_domain_val", "oracle")


@torch.no_grad()
def accuracy(model: nn.Module, data: ClientData, batch_size: int = 1024) -> float:
    """Fraction of ``data`` whose arg-max logit equals the label, in [0, 1] (``nan`` if empty)."""
    if len(data) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(data), batch_size):
        logits = model(data.inputs[start : start + batch_size])
        correct += int((logits.argmax(dim=1) == data.targets[start : start + batch_size]).sum())
    model.train(was_training)
    return correct / len(data)


@torch.no_grad()
def pearson_r(model: nn.Module, data: ClientData, batch_size: int = 1024) -> float:
    """Pearson correlation between the model's outputs ``[n, 1]`` and the targets ``[n]``
    (PPDG's regression metric on Poverty, Sec. 4.2); ``nan`` if fewer than two samples or a
    constant prediction or target."""
    if len(data) < 2:
        return float("nan")
    was_training = model.training
    model.eval()
    outputs = torch.cat([model(data.inputs[s : s + batch_size]).squeeze(1) for s in range(0, len(data), batch_size)])
    model.train(was_training)
    stacked = torch.stack([outputs.to(torch.float64), data.targets.to(torch.float64)])
    if bool((stacked.std(dim=1) == 0).any()):
        return float("nan")
    return float(torch.corrcoef(stacked)[0, 1])


METRICS = {"classification": ("accuracy", lambda m, d: 100.0 * accuracy(m, d)), "regression": ("pearson_r", pearson_r)}
"""Per task: the metric's name and a function ``(model, data) -> value`` (accuracy in percent)."""


def evaluate_models(
    models: list[tuple[nn.Module, tuple[int, ...] | None]],
    holdout: dict[int, ClientData],
    target: dict[int, ClientData],
    domain_names: tuple[str, ...],
    task: str = "classification",
) -> dict[str, Any]:
    """id and ood scores: accuracy (percent) or, for regression, Pearson r, per domain.

    Args:
        models: ``(model, domains)`` pairs; a model counts towards the id accuracy of the source
            domains in ``domains`` (all if ``None``) and towards every target domain. Several
            models (Local-only) are averaged.
        holdout: source domain id -> its id-validation samples.
        target: target domain id -> its samples.
        domain_names: names for the keys of the result.
        task: ``"classification"`` or ``"regression"`` (see :data:`METRICS`).

    Returns:
        ``{"metric": name, "id": {domain: score}, "id_mean": float, "ood": {domain: score},
        "ood_mean": float}``; the means are unweighted over domains.
    """
    metric_name, score = METRICS[task]
    result: dict[str, Any] = {"metric": metric_name, "id": {}, "ood": {}}
    for domain_id, data in holdout.items():
        scores = [score(m, data) for m, ds in models if ds is None or domain_id in ds]
        if scores:
            result["id"][domain_names[domain_id]] = sum(scores) / len(scores)
    for domain_id, data in target.items():
        scores = [score(m, data) for m, _ in models]
        result["ood"][domain_names[domain_id]] = sum(scores) / len(scores)
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


def format_domain_table(selected: dict[str, dict[str, Any]]) -> str:
    """A plain-text table: one row per selection rule, one column per domain (id then ood)."""
    first = next(iter(selected.values()))
    id_domains, ood_domains = list(first["id"]), list(first["ood"])
    header = ["selection", "round"] + [f"id:{d}" for d in id_domains] + ["id mean"]
    header += [f"ood:{d}" for d in ood_domains] + ["ood mean"]
    rows = [header]
    for rule, entry in selected.items():
        label = "oracle (reads target)" if rule == "oracle" else rule
        row = [label, str(entry["round"])]
        row += [f"{entry['id'][d]:.1f}" for d in id_domains] + [f"{entry['id_mean']:.1f}"]
        row += [f"{entry['ood'][d]:.1f}" for d in ood_domains] + [f"{entry['ood_mean']:.1f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
