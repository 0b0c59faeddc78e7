"""Tables across runs: mean ± std or ± standard error over seeds, and paired t-tests.

Every number says what it is: "± std" is the sample standard deviation over seeds (ddof = 1);
"± SE" is the standard error std/√n (what DomainBed prints after its ±).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy import stats

from fedbed.experiment import SUMMARY_NAME


def collect_summaries(root: Path) -> list[dict[str, Any]]:
    """Every ``summary.json`` below ``root`` (sorted by path)."""
    return [json.loads(path.read_text()) for path in sorted(root.rglob(SUMMARY_NAME))]


def mean_std_se(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean, sample standard deviation (ddof = 1) and standard error std/√n; std and SE are
    ``nan`` for fewer than two values."""
    count = len(values)
    mean = sum(values) / count
    if count < 2:
        return mean, float("nan"), float("nan")
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (count - 1))
    return mean, std, std / math.sqrt(count)


def format_spread(values: Sequence[float], spread: str = "std") -> str:
    """``"mean ± spread"`` with one decimal; ``spread`` is ``"std"`` or ``"se"``."""
    mean, std, se = mean_std_se(values)
    value = std if spread == "std" else se
    return f"{mean:.1f}" if math.isnan(value) else f"{mean:.1f} ± {value:.1f}"


def paired_t_test(method: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """Two-sided paired t-test (``scipy.stats.ttest_rel``) of ``method`` vs ``baseline`` over
    matched pairs (e.g. (target, seed)); returns ``(t statistic, p-value)``.

    Raises:
        ValueError: if the samples differ in length or have fewer than two pairs.
    """
    if len(method) != len(baseline) or len(method) < 2:
        raise ValueError(f"a paired t-test needs two equal-length samples of >= 2 pairs, got {len(method)} and {len(baseline)}")
    result = stats.ttest_rel(method, baseline)
    return float(result.statistic), float(result.pvalue)


def ood_table(
    summaries: list[dict[str, Any]], algorithms: Sequence[str], targets: Sequence[str], selection: str, spread: str = "std"
) -> str:
    """A Markdown table: algorithms as rows, target domains as columns plus the mean; cells are
    ood score under ``selection``, ``mean ± spread`` over seeds; the "mean" column averages the
    per-target means."""
    label = "± std over seeds" if spread == "std" else "± SE over seeds"
    lines = [
        f"| algorithm ({selection}, {label}) | " + " | ".join(targets) + " | mean |",
        "|---|" + "---|" * (len(targets) + 1),
    ]
    for algorithm in algorithms:
        cells, means = [], []
        for target in targets:
            values = [s["selection"][selection]["ood_mean"] for s in summaries if s["algorithm"] == algorithm and s["target"] == target]
            cells.append(format_spread(values, spread) if values else "–")
            if values:
                means.append(sum(values) / len(values))
        mean = f"{sum(means) / len(means):.1f}" if len(means) == len(targets) else "–"
        lines.append(f"| {algorithm} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def paired_pairs(summaries: list[dict[str, Any]], method: str, baseline: str, selection: str) -> tuple[list[float], list[float]]:
    """ood scores of ``method`` and ``baseline`` matched on (target, seed)."""
    def scores(algorithm):
        return {(s["target"], s["seed"]): s["selection"][selection]["ood_mean"] for s in summaries if s["algorithm"] == algorithm}

    a, b = scores(method), scores(baseline)
    keys = sorted(set(a) & set(b))
    return [a[k] for k in keys], [b[k] for k in keys]
