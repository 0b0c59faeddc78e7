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

import yaml
from scipy import stats

from fedbed.run_directory import CONFIG_NAME, SUMMARY_NAME


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


def score_table(
    summaries: list[dict[str, Any]],
    groups: Sequence[str],
    targets: Sequence[str],
    selection: str,
    kind: str = "ood",
    spread: str = "std",
    group_key: str = "algorithm",
) -> list[list[str]]:
    """Rows (header first): one per group (algorithm or label), one column per target domain plus
    the mean; a cell is the ``kind`` score (``"ood"`` or ``"id"``, the run's domain mean) under
    ``selection``, ``mean ± spread`` over seeds. The "mean" column averages the per-target means
    and is left empty unless every target has runs."""
    label = "± std over seeds" if spread == "std" else "± SE over seeds"
    oracle = " (oracle: reads the target)" if selection == "oracle" else ""
    rows = [[f"{kind} {group_key} ({selection}{oracle}, {label})", *targets, "mean"]]
    for group in groups:
        cells, means = [], []
        for target in targets:
            values = [
                s["selection"][selection][f"{kind}_mean"]
                for s in summaries if s[group_key] == group and s["target"] == target
            ]
            cells.append(format_spread(values, spread) if values else "–")
            if values:
                means.append(sum(values) / len(values))
        rows.append([group, *cells, f"{sum(means) / len(means):.1f}" if len(means) == len(targets) else "–"])
    return rows


def to_markdown(rows: list[list[str]]) -> str:
    """A Markdown table from rows (header first)."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows[1:]])


def to_latex(rows: list[list[str]]) -> str:
    """A LaTeX ``tabular`` from rows (header first); ``±`` becomes ``$\\pm$``, ``_`` is escaped."""
    def cell(text: str) -> str:
        return text.replace("_", "\\_").replace("±", "$\\pm$").replace("%", "\\%")

    lines = ["\\begin{tabular}{l" + "c" * (len(rows[0]) - 1) + "}", "\\hline"]
    lines.append(" & ".join(cell(c) for c in rows[0]) + " \\\\ \\hline")
    lines += [" & ".join(cell(c) for c in row) + " \\\\" for row in rows[1:]]
    return "\n".join(lines + ["\\hline", "\\end{tabular}"])


def tidy_rows(summaries: list[dict[str, Any]], selection: str) -> list[dict[str, Any]]:
    """One record per (label, target, metric) with numbers, not formatted text: ``label``,
    ``algorithm``, ``target``, ``selection``, ``metric`` (``ood`` or ``id``, the run's domain
    mean, %), ``mean``, ``std`` (ddof = 1), ``se``, ``n`` (seeds); ``std`` and ``se`` are empty
    for one seed."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    algorithms = {}
    for summary in summaries:
        algorithms[summary["label"]] = summary["algorithm"]
        for metric in ("ood", "id"):
            groups.setdefault((summary["label"], summary["target"], metric), []).append(
                summary["selection"][selection][f"{metric}_mean"])
    records = []
    for (label, target, metric), values in sorted(groups.items()):
        mean, std, se = mean_std_se(values)
        records.append({"label": label, "algorithm": algorithms[label], "target": target, "selection": selection,
                        "metric": metric, "mean": mean, "std": None if math.isnan(std) else std,
                        "se": None if math.isnan(se) else se, "n": len(values)})
    return records


def to_csv(records: list[dict[str, Any]]) -> str:
    """CSV text of :func:`tidy_rows` records (a header, then one line per record)."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(records[0]) if records else ["label"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


def ood_table(
    summaries: list[dict[str, Any]], algorithms: Sequence[str], targets: Sequence[str], selection: str, spread: str = "std"
) -> str:
    """:func:`score_table` of the ood scores per algorithm, as Markdown."""
    return to_markdown(score_table(summaries, algorithms, targets, selection, "ood", spread))


def paired_pairs(
    summaries: list[dict[str, Any]], method: str, baseline: str, selection: str, group_key: str = "algorithm"
) -> tuple[list[float], list[float]]:
    """ood scores of ``method`` and ``baseline`` matched on (target, seed)."""
    def scores(group):
        return {(s["target"], s["seed"]): s["selection"][selection]["ood_mean"] for s in summaries if s[group_key] == group}

    a, b = scores(method), scores(baseline)
    keys = sorted(set(a) & set(b))
    return [a[k] for k in keys], [b[k] for k in keys]


def labelled_summaries(sweep_dir: Path, selection: str | None = None) -> list[dict[str, Any]]:
    """The summaries below ``sweep_dir``, each with a ``label`` (see :func:`fedbed.results.run_label`),
    a ``group``: the label without the hyperparameters the sweep's grid varies (the method,
    and its variant), among whose runs :func:`select_hyperparameters` chooses.

    Args:
        sweep_dir: a sweep folder.
        selection: with :data:`~fedbed.federation.evaluation.LAST_FIVE_MEAN`, each summary's
            ``selection`` gains that report-only entry, computed from the run's ``rounds.jsonl``
            (only then are the logs read).

    Raises:
        ValueError: with ``LAST_FIVE_MEAN``, a run whose ``rounds.jsonl`` is missing, holds no
            evaluation or does not parse (the message names it).
    """
    from fedbed.federation.evaluation import LAST_FIVE_MEAN, mean_of_last_evaluations
    from fedbed.results import run_label, sweep_variants, varied_hyperparameters, variant_of
    from fedbed.run_result import read_log

    varied, variants = varied_hyperparameters(sweep_dir), sweep_variants(sweep_dir)
    summaries = []
    for path in sorted(sweep_dir.rglob(SUMMARY_NAME)):
        summary = json.loads(path.read_text())
        config = yaml.safe_load((path.parent / CONFIG_NAME).read_text()) if variants else {}
        summaries.append(summary)
        variant = variant_of(config, variants)
        summary["label"] = run_label(summary["algorithm"], summary.get("hp", {}), varied.get(summary["algorithm"], []), variant)
        summary["group"] = run_label(summary["algorithm"], {}, [], variant)
        if selection == LAST_FIVE_MEAN:
            try:
                evaluations = [record["evaluation"] for record in read_log(path.parent) if record.get("evaluation")]
            except json.JSONDecodeError as error:
                raise ValueError(f"{path.parent}'s rounds.jsonl does not parse ({error}); choose --selection last "
                                 "or train_domain_val") from None
            if not evaluations:
                raise ValueError(f"{path.parent} cannot be scored by {LAST_FIVE_MEAN}: its rounds.jsonl is missing or "
                                 "holds no evaluation; choose --selection last or train_domain_val")
            summary["selection"][LAST_FIVE_MEAN] = mean_of_last_evaluations(evaluations)
    return summaries


def select_hyperparameters(summaries: list[dict[str, Any]], selection: str) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """DomainBed's hyperparameter selection (``collect_results``, "training-domain validation"):
    per group (method and variant) and target domain, the label (hyperparameter values) whose
    runs have the highest mean id accuracy over seeds, the id accuracy being the source domains'
    holdouts at the round ``selection`` chooses. The target is never read.

    Args:
        summaries: :func:`labelled_summaries`.
        selection: ``last``, ``train_domain_val`` or ``last_five_mean``.

    Returns:
        ``(the chosen runs, relabelled by their group; rows (header first) of the choices)``.

    Raises:
        ValueError: ``selection`` is ``oracle`` (it would choose by target accuracy).
    """
    if selection == "oracle":
        raise ValueError("--select-hparams chooses by source-domain validation; use --selection last, train_domain_val or last_five_mean")
    candidates: dict[tuple[str, str], dict[str, list[float]]] = {}
    for summary in summaries:
        scores = candidates.setdefault((summary["group"], summary["target"]), {})
        scores.setdefault(summary["label"], []).append(summary["selection"][selection]["id_mean"])
    chosen = {key: max(scores, key=lambda label: (sum(scores[label]) / len(scores[label]), label))
              for key, scores in candidates.items()}
    rows = [[f"selected hyperparameters (highest mean id accuracy, {selection}; source domains only)", "target",
             "chosen", "id", "candidates"]]
    for (group, target), label in sorted(chosen.items()):
        values = candidates[(group, target)][label]
        rows.append([group, target, label, f"{sum(values) / len(values):.1f}", str(len(candidates[(group, target)]))])
    kept = [{**summary, "label": summary["group"]} for summary in summaries
            if chosen[(summary["group"], summary["target"])] == summary["label"]]
    return kept, rows


def t_test_rows(summaries: list[dict[str, Any]], labels: Sequence[str], baseline: str, selection: str) -> list[list[str]]:
    """Rows (header first) of a paired t-test of each label against ``baseline`` over (target,
    seed) pairs of ood scores, as PPDG's Table 7 (``scipy.stats.ttest_rel``, two-sided)."""
    rows = [[f"vs {baseline} ({selection})", "pairs", "mean difference", "t", "p"]]
    for label in labels:
        if label == baseline:
            continue
        method, base = paired_pairs(summaries, label, baseline, selection, group_key="label")
        if len(method) < 2:
            rows.append([label, str(len(method)), "–", "–", "–"])
            continue
        t, p = paired_t_test(method, base)
        difference = sum(a - b for a, b in zip(method, base)) / len(method)
        if math.isnan(t):  # every pair differs by the same amount (e.g. identical runs): no variance to test
            rows.append([label, str(len(method)), f"{difference:+.2f}", "undefined",
                         "undefined: the paired differences do not vary"])
            continue
        rows.append([label, str(len(method)), f"{difference:+.2f}", f"{t:.2f}", f"{p:.3g}"])
    return rows


def report_summaries(sweep_dir: Path, selection: str, select_hparams: bool = False
                     ) -> tuple[list[dict[str, Any]], list[list[str]] | None]:
    """The labelled summaries a report shows and, with ``select_hparams``, the rows of the
    hyperparameter choices (:func:`select_hyperparameters`; else ``None``).

    Raises:
        ValueError: no finished run below ``sweep_dir``, a run ``last_five_mean`` cannot score
            (:func:`labelled_summaries`), or ``select_hparams`` with ``oracle``.
    """
    summaries = labelled_summaries(sweep_dir, selection)
    if not summaries:
        raise ValueError(f"{sweep_dir} holds no finished run (no {SUMMARY_NAME})")
    if not select_hparams:
        return summaries, None
    return select_hyperparameters(summaries, selection)


def sweep_tables(
    sweep_dir: Path, selection: str = "train_domain_val", spread: str = "std", baseline: str | None = None,
    select_hparams: bool = False,
) -> dict[str, list[list[str]]]:
    """The report's tables of a sweep folder: ``ood``, ``id``, with a baseline ``t_test``, and
    with ``select_hparams`` (:func:`select_hyperparameters`) one row per method and variant
    holding its chosen hyperparameters per target, plus the ``selected_hyperparameters`` table.

    Raises:
        ValueError: no finished run below ``sweep_dir``, a baseline that is not among the labels,
            or ``select_hparams`` with the ``oracle`` selection.
    """
    summaries, choices = report_summaries(sweep_dir, selection, select_hparams)
    labels = sorted({s["label"] for s in summaries})
    targets = sorted({s["target"] for s in summaries}, key=lambda t: (len(t), t))
    tables = {kind: score_table(summaries, labels, targets, selection, kind, spread, "label") for kind in ("ood", "id")}
    if baseline is not None:
        if baseline not in labels:
            raise ValueError(f"baseline {baseline!r} is not among the runs' labels: {', '.join(labels)}")
        tables["t_test"] = t_test_rows(summaries, labels, baseline, selection)
    if choices is not None:
        tables["selected_hyperparameters"] = choices
    return tables


def evaluation_notes(sweep_dir: Path) -> list[str]:
    """What the evaluation of the finished runs below ``sweep_dir`` read, and what privacy they
    guarantee, one line per distinct statement with its number of runs: a table scored by a
    linear probe, which reads target labels, or under domain adaptation says so
    (:meth:`fedbed.build.BuiltRun.evaluation_statement`); runs under differential privacy give
    their (ε, δ) (:func:`fedbed.algorithms.differential_privacy.privacy_statement`)."""
    counts: dict[str, int] = {}
    for summary in collect_summaries(sweep_dir):
        statement = summary.get("evaluation") or {}
        notes = [f"evaluation ({{}}): {statement[key]}" for key in ("note", "adaptation_note") if key in statement]
        if summary.get("privacy"):
            notes.append(f"privacy ({{}}): {summary['privacy']['note']}")
        for note in notes:
            counts[note] = counts.get(note, 0) + 1
    return [note.format(f"{count} run{'s' if count > 1 else ''}") for note, count in counts.items()]


def data_sources(summaries: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """Which data the runs read: one line per source (its description without folders,
    :func:`fedbed.data.base.portable_source`, and its fingerprints) with its number of runs, and
    whether they mix data (more than one source, or more than one fingerprint)."""
    from fedbed.data.base import portable_source

    runs: dict[str, int] = {}
    fingerprints: dict[str, set[str]] = {}
    for summary in summaries:
        source = portable_source(summary.get("data_source", "unrecorded"))
        runs[source] = runs.get(source, 0) + 1
        fingerprints.setdefault(source, set()).update([summary["data_fingerprint"]] if summary.get("data_fingerprint") else [])
    lines = [f"{source} (fingerprint {', '.join(sorted(fingerprints[source])) or 'unrecorded'}): "
             f"{count} run{'s' if count > 1 else ''}" for source, count in sorted(runs.items())]
    mixed = len(runs) > 1 or len(set().union(*fingerprints.values())) > 1
    return lines, mixed


def mixed_code_warning(sweep_dir: Path) -> str | None:
    """One line if the finished runs below ``sweep_dir`` were made by more than one version of
    FedBed's code, counting a run resumed under other code than it began with
    (:func:`fedbed.provenance.code_versions`), else ``None``: a code change can change a
    method's numbers under unchanged settings, and a sweep skips finished jobs."""
    from fedbed.provenance import code_versions, source_mix

    summaries = collect_summaries(sweep_dir)
    mix, versions = source_mix(summaries), code_versions(summaries)
    if len(versions) < 2:
        return None
    counts = ", ".join(f"{source.replace('+', ' then ')}: {count}" for source, count in mix.most_common())
    return (f"warning: these runs come from {len(versions)} versions of FedBed's code (runs per source fingerprint: "
            f"{counts}); their numbers may not be comparable: delete the older run folders and run the sweep again")


RENDERERS = {"markdown": to_markdown, "latex": to_latex}
"""Renderers of the formatted tables; ``csv`` writes :func:`tidy_rows` instead."""


TABLE_HEADINGS = {
    "ood": "Accuracy on the unseen target domain (ood)",
    "id": "Accuracy on the source domains' validation holdouts (id)",
    "t_test": "Paired t-tests against the baseline",
    "selected_hyperparameters": "Hyperparameters selected by source-domain validation",
}
"""Headings of the report's tables, by their key in :func:`sweep_tables`."""


def image_heading(stem: str) -> str:
    """The heading of a plot of :func:`fedbed.plots.plot_sweep`, by its file stem."""
    if stem.startswith("curve_"):
        return f"Accuracy against rounds, target {stem.removeprefix('curve_')}"
    if stem.startswith("domains_"):
        return f"Accuracy per domain ({stem.removeprefix('domains_')} selection)"
    if stem == "alignment_over_rounds":
        return "Agreement of the client updates against rounds"
    return stem


def sweep_settings(summaries: list[dict[str, Any]], configs: list[dict[str, Any]], selection: str) -> list[tuple[str, str]]:
    """The settings block of a report: dataset, data, budget, seeds, selection and FedBed's
    version, each the set of values found among the runs (``summary.json`` and ``config.yaml``)."""
    from importlib.metadata import version

    def values(items) -> str:
        found = sorted({str(item) for item in items})
        return ", ".join(found) if found else "unrecorded"

    def plural(count: Any, noun: str) -> str:
        return f"{count} {noun}" + ("" if count == 1 else "s")

    budgets = [plural(c.get("rounds"), "round") + " x " + (plural(c["local_epochs"], "local epoch") if c.get("local_epochs")
                                                            else plural(c.get("local_steps"), "local step"))
               + f", batch {c.get('batch_size')}" for c in configs]
    return [("dataset", values(s.get("dataset") for s in summaries)),
            ("data", "; ".join(data_sources(summaries)[0])),
            ("budget", values(budgets)),
            ("seeds", values(s.get("seed") for s in summaries)),
            ("selection", selection),
            ("FedBed", version("fedbed"))]


def html_report(tables: dict[str, list[list[str]]], images: list[Path], title: str, notes: Sequence[str] = (),
                settings: Sequence[tuple[str, str]] = ()) -> str:
    """One self-contained HTML page: the settings block (:func:`sweep_settings`), the notes (e.g.
    :func:`evaluation_notes`), the tables under headings in words and the PNG plots embedded as
    base64."""
    import base64
    import html

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #999;padding:4px 8px;text-align:right}th:first-child,td:first-child{text-align:left}"
             "#settings td{text-align:left}img{max-width:100%}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    if settings:
        parts.append("<table id='settings'>" + "".join(f"<tr><th>{html.escape(key)}</th><td>{html.escape(value)}</td></tr>"
                                                        for key, value in settings) + "</table>")
    parts += [f"<p class='note'>{html.escape(note)}</p>" for note in notes]
    for name, rows in tables.items():
        parts.append(f"<h2>{html.escape(TABLE_HEADINGS.get(name, name))}</h2><table id='{html.escape(name)}'><tr>")
        parts += [f"<th>{html.escape(c)}</th>" for c in rows[0]]
        parts.append("</tr>")
        for row in rows[1:]:
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    for image in images:
        encoded = base64.b64encode(image.read_bytes()).decode()
        heading = html.escape(image_heading(image.stem))
        parts.append(f"<h3>{heading}</h3><img alt='{heading}' src='data:image/png;base64,{encoded}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
