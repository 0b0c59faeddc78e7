"""Tables across runs: mean ± std or ± standard error over seeds, and paired t-tests.

Every number says what it is: "± std" is the sample standard deviation over seeds (ddof = 1);
"± SE" is the standard error std/√n (what DomainBed prints after its ±).

A report reads one sweep folder or several (:func:`build_report`): the runs of all of them are
labelled together (:func:`fedbed.results.labelled_runs`) and paired by (label, target, seed)
across folders, so a comparison needs no job copied between folders.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy import stats

from fedbed.results import (
    FinishedRun,
    as_folders,
    finished_runs,
    labelled_runs,
    unfinished_runs,
)
from fedbed.run_directory import SUMMARY_NAME


def collect_summaries(sweep_dirs: Path | Sequence[Path]) -> list[dict[str, Any]]:
    """Every ``summary.json`` below one or more folders (sorted by path within each), a job
    copied into several folders once (:func:`fedbed.results.finished_runs`)."""
    return [run.summary for run in finished_runs(sweep_dirs)]


def run_score(summary: dict[str, Any], selection: str, metric: str = "ood", domain: str | None = None) -> float | None:
    """A run's score (accuracy, %) under a selection rule: its domain mean (``metric``: ``"ood"``,
    the target domains, or ``"id"``, the source holdouts), or one domain's score with ``domain``;
    ``None`` when the rule scored none (:func:`fedbed.federation.evaluation.recorded_score`: ``null``
    or ``nan``) or for a domain the run did not score. Every table, test, plot and
    hyperparameter choice reads scores through this one function, so a missing score is left out
    everywhere alike, never a zero and never a TypeError; :func:`missing_score_notes` says which
    runs a report left out.

    Raises:
        KeyError: ``selection`` is not among the summary's rules.
    """
    from fedbed.federation.evaluation import recorded_score

    scores = summary["selection"][selection]
    return recorded_score(scores[f"{metric}_mean"] if domain is None else scores[metric].get(domain))


def missing_score_notes(summaries: list[dict[str, Any]], selections: Sequence[str]) -> list[str]:
    """One note per rule and metric (``ood``, ``id``) under which some runs have no score
    (:func:`run_score`): how many were left out of their cells' means, and which (label, target,
    seed), so that a cell averaged over fewer seeds than the others is never taken for one over
    all of them."""
    notes = []
    for selection in selections:
        for metric in ("ood", "id"):
            missing = sorted(f"{s['label']} {s['target']} seed {s['seed']}" for s in summaries
                             if run_score(s, selection, metric) is None)
            if missing:
                notes.append(f"{selection}: {len(missing)} run(s) without an {metric} score, left out of their cells "
                             f"(fewer seeds there): {', '.join(missing)}")
    return notes


def mean_std_se(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean, sample standard deviation (ddof = 1) and standard error std/√n; std and SE are
    ``nan`` for fewer than two values."""
    count = len(values)
    mean = sum(values) / count
    if count < 2:
        return mean, float("nan"), float("nan")
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (count - 1))
    return mean, std, std / math.sqrt(count)


def format_spread(values: Sequence[float], spread: str = "std", decimals: int = 1) -> str:
    """``"mean ± spread"`` with ``decimals`` decimals (one: accuracies in %); ``spread`` is
    ``"std"`` or ``"se"``."""
    mean, std, se = mean_std_se(values)
    value = std if spread == "std" else se
    return f"{mean:.{decimals}f}" if math.isnan(value) else f"{mean:.{decimals}f} ± {value:.{decimals}f}"


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
    selections: str | Sequence[str],
    kind: str = "ood",
    spread: str = "std",
    group_key: str = "algorithm",
    per_seed: bool = False,
) -> list[list[str]]:
    """Rows (header first): one per group (algorithm or label), and per target domain one column
    per selection rule; a cell is the ``kind`` score (``"ood"`` or ``"id"``, the run's domain
    mean) under that rule, ``mean ± spread`` over seeds. With several rules a column is headed
    ``"<target>, <rule>"``. With ``per_seed``, each such column is preceded by one per seed of the
    target's runs (``"<target>, seed <s>"``, the run's score) and headed ``"<target>, all seeds"``.
    With more than one target, a "mean" column per rule averages the per-target means (left
    empty unless every target has runs; :func:`uneven_seed_notes` names a mean over targets with
    different numbers of seeds). A missing cell is "–"."""
    from fedbed.federation.evaluation import format_score

    selections = [selections] if isinstance(selections, str) else list(selections)
    label = "± std over seeds" if spread == "std" else "± SE over seeds"
    oracle = " (oracle: reads the target)" if "oracle" in selections else ""

    def name(*parts: str) -> str:
        return ", ".join(part for part in parts if part)

    def rule(selection: str) -> str:
        return selection if len(selections) > 1 else ""

    seeds = {target: sorted({s["seed"] for s in summaries if s["target"] == target}) for target in targets}
    header = [f"{kind} {group_key} ({', '.join(selections)}{oracle}, {label})"]
    for target in targets:
        for selection in selections:
            if per_seed:
                header += [name(target, rule(selection), f"seed {seed}") for seed in seeds[target]]
            header.append(name(target, rule(selection), "all seeds" if per_seed else ""))
    if len(targets) > 1:
        header += [name("mean", rule(selection)) for selection in selections]
    rows = [header]
    for group in groups:
        cells: list[str] = []
        means: dict[str, list[float]] = {selection: [] for selection in selections}
        for target in targets:
            runs = [s for s in summaries if s[group_key] == group and s["target"] == target]
            for selection in selections:
                scores = [run_score(s, selection, kind) for s in runs]
                values = [value for value in scores if value is not None]
                if per_seed:
                    by_seed = {s["seed"]: score for s, score in zip(runs, scores)}
                    cells += [format_score(by_seed.get(seed)) for seed in seeds[target]]
                collapsed = " †" if any(s.get("collapse") for s in runs) else ""  # collapse_notes names the runs
                cells.append(format_spread(values, spread) + collapsed if values else "–")
                if values:
                    means[selection].append(sum(values) / len(values))
        if len(targets) > 1:
            cells += [format_score(sum(means[s]) / len(means[s]) if len(means[s]) == len(targets) else None)
                      for s in selections]
        rows.append([group, *cells])
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


def tidy_rows(summaries: list[dict[str, Any]], selections: str | Sequence[str]) -> list[dict[str, Any]]:
    """One record per (label, target, selection rule, metric) with numbers, not formatted text:
    ``label``, ``algorithm``, ``target``, ``selection``, ``metric`` (``ood`` or ``id``, the run's
    domain mean, %), ``mean``, ``std`` (ddof = 1), ``se``, ``n`` (seeds); ``std`` and ``se`` are
    empty for one seed. Sorted by label, target, then the rules in the given order."""
    selections = [selections] if isinstance(selections, str) else list(selections)
    groups: dict[tuple[str, str, int, str], list[float]] = {}
    algorithms = {}
    for summary in summaries:
        algorithms[summary["label"]] = summary["algorithm"]
        for position, selection in enumerate(selections):
            for metric in ("ood", "id"):
                groups.setdefault((summary["label"], summary["target"], position, metric), []).append(
                    run_score(summary, selection, metric))
    records = []
    for (label, target, position, metric), values in sorted(groups.items()):
        values = [value for value in values if value is not None]
        if not values:
            continue
        mean, std, se = mean_std_se(values)
        records.append({"label": label, "algorithm": algorithms[label], "target": target,
                        "selection": selections[position], "metric": metric, "mean": mean,
                        "std": None if math.isnan(std) else std, "se": None if math.isnan(se) else se, "n": len(values)})
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


BY_ROUND_SCORES = ("ood", "id")
"""The quantities of :func:`by_round_table` read from a round's evaluation (the domain mean);
any other name is read from the round's ``metrics`` (e.g. ``train_loss``)."""


def by_round_table(labels: Sequence[str], runs: Sequence[tuple[str, Path]], quantity: str, target: str,
                   spread: str = "std") -> list[list[str]]:
    """Rows (header first): one per label, one column per round at which a run evaluated; a cell
    is ``quantity`` at that round, ``mean ± spread`` over the label's runs (seeds), "–" where no
    run has it (a label without runs here gets a row of "–"). ``ood`` and ``id`` are the
    evaluation's domain means (one decimal); any other name is the round's logged metric of that
    name (three decimals), e.g. ``train_loss`` or FedGaLA's ``discard_ratio``, shown at the same
    evaluated rounds. Read from each run's ``rounds.jsonl`` (:func:`fedbed.run_result.read_log`);
    null, NaN and non-numbers count as missing (:func:`fedbed.federation.evaluation.recorded_score`).

    Args:
        labels: the rows, in order.
        runs: ``(label, run folder)`` of the target's runs.
        quantity: ``ood``, ``id`` or a metric's name (:func:`logged_metrics` lists a run's).
        target: the runs' target, for the header.
        spread: ``"std"`` or ``"se"`` over seeds.
    """
    from fedbed.federation.evaluation import recorded_score
    from fedbed.run_result import read_log

    values: dict[str, dict[int, list[float]]] = {label: {} for label in labels}
    evaluated: set[int] = set()
    for label, path in runs:
        for record in read_log(path):
            evaluation = record.get("evaluation")
            if not evaluation:
                continue
            evaluated.add(record["round"])
            raw = evaluation.get(f"{quantity}_mean") if quantity in BY_ROUND_SCORES else (record.get("metrics") or {}).get(quantity)
            value = recorded_score(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
            if value is not None:
                values[label].setdefault(record["round"], []).append(value)
    rounds = sorted(evaluated)
    decimals = 1 if quantity in BY_ROUND_SCORES else 3
    label_spread = "± std over seeds" if spread == "std" else "± SE over seeds"
    header = [f"{quantity} by round, target {target} ({label_spread})", *(str(r) for r in rounds)]
    return [header] + [[label, *(format_spread(by_round[r], spread, decimals) if by_round.get(r) else "–" for r in rounds)]
                       for label, by_round in values.items()]


def logged_metrics(paths: Sequence[Path]) -> set[str]:
    """The names of the metrics the runs' rounds logged (``metrics`` in ``rounds.jsonl``),
    without the per-array ones (``NAME/ARRAY``)."""
    from fedbed.run_result import read_log

    return {name for path in paths for record in read_log(path) for name in (record.get("metrics") or {}) if "/" not in name}


def matched_scores(
    summaries: list[dict[str, Any]], method: str, baseline: str, selection: str, group_key: str = "algorithm"
) -> dict[tuple[str, int], tuple[float, float]]:
    """ood scores (%) of ``method`` and ``baseline`` under ``selection``, ``(method's, baseline's)``
    by the (target, seed) both scored, in sorted order; a run without a score (:func:`run_score`)
    pairs with nothing."""
    def scores(group):
        scored = {(s["target"], s["seed"]): run_score(s, selection) for s in summaries if s[group_key] == group}
        return {key: value for key, value in scored.items() if value is not None}

    a, b = scores(method), scores(baseline)
    return {key: (a[key], b[key]) for key in sorted(set(a) & set(b))}


def paired_pairs(
    summaries: list[dict[str, Any]], method: str, baseline: str, selection: str, group_key: str = "algorithm"
) -> tuple[list[float], list[float]]:
    """The two lists of :func:`matched_scores`: ``method``'s scores and ``baseline``'s, in the
    same (target, seed) order."""
    matched = matched_scores(summaries, method, baseline, selection, group_key)
    return [a for a, _ in matched.values()], [b for _, b in matched.values()]


def scored_runs(sweep_dirs: Path | Sequence[Path], selections: str | Sequence[str] = ()) -> list[FinishedRun]:
    """The finished runs below one or more folders, labelled over all of them
    (:func:`fedbed.results.labelled_runs`): each summary has a ``label`` and a ``group`` (the
    label without hyperparameters: the method and its variant, among whose runs
    :func:`select_hyperparameters` chooses).

    Args:
        sweep_dirs: a sweep folder, or several.
        selections: the rules to be read; with :data:`~fedbed.federation.evaluation.LAST_FIVE_MEAN`
            among them, each summary's ``selection`` gains that report-only entry, computed from
            the run's ``rounds.jsonl`` (only then are the logs read).

    Raises:
        ValueError: two different runs with one label, target and seed
            (:class:`fedbed.results.ResultsError`); with ``LAST_FIVE_MEAN``, a run whose
            ``rounds.jsonl`` is missing, holds no evaluation or does not parse (the message names it).
    """
    import json

    from fedbed.federation.evaluation import LAST_FIVE_MEAN, mean_of_last_evaluations
    from fedbed.run_result import read_log

    runs = labelled_runs(sweep_dirs)
    if LAST_FIVE_MEAN not in ([selections] if isinstance(selections, str) else selections):
        return runs
    for run in runs:
        try:
            evaluations = [record["evaluation"] for record in read_log(run.path) if record.get("evaluation")]
        except json.JSONDecodeError as error:
            raise ValueError(f"{run.path}'s rounds.jsonl does not parse ({error}); choose --selection last "
                             "or train_domain_val") from None
        if not evaluations:
            raise ValueError(f"{run.path} cannot be scored by {LAST_FIVE_MEAN}: its rounds.jsonl is missing or "
                             "holds no evaluation; choose --selection last or train_domain_val")
        run.summary["selection"][LAST_FIVE_MEAN] = mean_of_last_evaluations(evaluations)
    return runs


def labelled_summaries(sweep_dirs: Path | Sequence[Path], selections: str | Sequence[str] = ()) -> list[dict[str, Any]]:
    """The summaries of :func:`scored_runs` (same arguments and errors)."""
    return [run.summary for run in scored_runs(sweep_dirs, selections)]


def select_hyperparameters(summaries: list[dict[str, Any]], selection: str,
                           per_seed: bool = False) -> tuple[list[dict[str, Any]], list[list[str]], list[tuple[str, str]]]:
    """DomainBed's hyperparameter selection (``collect_results``, "training-domain validation"):
    per group (method and variant) and target domain, the label (grid values or random-search
    trial) whose runs have the highest mean id accuracy over seeds, the id accuracy being the
    source domains' holdouts at the round ``selection`` chooses; with ``per_seed``, per group,
    target and seed, the label with the highest id accuracy of that seed's run (DomainBed groups
    by ``trial_seed`` before it chooses). The target is never read. Labels that tie on the best
    id accuracy (a holdout's accuracy is a count over its size, so equal scores happen) go to the
    label last in string order (DomainBed's tie-break is its records' load order), and a note
    names the tie. When not every candidate of a group and target has a scored run of every seed
    (a run unfinished or without an id score), the choice compares means over different seeds
    (or, per seed, fewer candidates in some seeds), and a note names the labels short of a seed.

    Args:
        summaries: :func:`labelled_summaries`.
        selection: ``last``, ``train_domain_val`` or ``last_five_mean``.
        per_seed: choose for each seed on its own, as DomainBed does.

    Returns:
        ``(the chosen runs, relabelled by their group, the label they had as ``chosen_label``;
        rows (header first) of the choices; ``(group, note)`` per tied choice and per group
        and target whose candidates' seeds are uneven)``: a row per group, target (and seed)
        with the chosen label, its ``values`` (the hyperparameters that differ among the
        candidates, at the chosen label's values; ``–`` for a single candidate), its id
        accuracy and the number of candidates (labels
        with at least one run that has an id score, :func:`run_score`; a run without one is left
        out of its label's mean). A group and target in which no run has an id score gets a row
        that says so and keeps no run.

    Raises:
        ValueError: ``selection`` is ``oracle`` (it would choose by target accuracy).
    """
    if selection == "oracle":
        raise ValueError("--select-hparams chooses by source-domain validation; use --selection last, train_domain_val or last_five_mean")

    def key_of(summary: dict[str, Any]) -> tuple:
        return (summary["group"], summary["target"], *((summary["seed"],) if per_seed else ()))

    candidates: dict[tuple, dict[str, list[float]]] = {}
    seeds_of: dict[str, dict[str, dict[str, set[int]]]] = {}  # group -> target -> label -> its scored seeds
    settings: dict[tuple, dict[str, dict[str, Any]]] = {}
    for summary in summaries:
        score = run_score(summary, selection, "id")
        scores = candidates.setdefault(key_of(summary), {})
        scored_seeds = seeds_of.setdefault(summary["group"], {}).setdefault(summary["target"], {}).setdefault(
            summary["label"], set())
        if score is not None:  # a run without an id score cannot speak for its label
            scores.setdefault(summary["label"], []).append(score)
            scored_seeds.add(summary["seed"])
        settings.setdefault(key_of(summary), {}).setdefault(summary["label"], summary.get("hp", {}))
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    chosen = {key: max(scores, key=lambda label: (mean(scores[label]), label))
              for key, scores in candidates.items() if scores}
    choice_notes = []
    for key, label in sorted(chosen.items()):
        tied = sorted(other for other, values in candidates[key].items() if mean(values) == mean(candidates[key][label]))
        if len(tied) > 1:
            where = ", ".join(f"{name} {value}" for name, value in zip(["target", "seed"], key[1:]))
            choice_notes.append((key[0], f"tie: {key[0]}, {where}: {', '.join(tied)} have the same id accuracy "
                                         f"({mean(candidates[key][label]):.2f}); {label} is chosen (the last label)"))
    for group, by_target in sorted(seeds_of.items()):
        for target, by_label in sorted(by_target.items()):
            every_seed = set().union(*by_label.values())
            short = [f"{label} has no seed {', '.join(map(str, sorted(every_seed - seeds)))}"
                     for label, seeds in sorted(by_label.items()) if seeds != every_seed]
            if short and len(by_label) > 1:
                compared = "fewer candidates in some seeds" if per_seed else "means over different seeds"
                choice_notes.append((group, f"uneven seeds: {group}, target {target}: not every candidate has a "
                                            f"scored run of every seed ({'; '.join(short)}), so the choice compares "
                                            f"{compared}; finish those runs, or choose among seeds every candidate "
                                            f"has with --seed"))
    rule = "id accuracy of each seed's run" if per_seed else "mean id accuracy"
    rows = [[f"selected hyperparameters (highest {rule}, {selection}; source domains only)", "target",
             *(["seed"] if per_seed else []), "chosen", "values", "id", "candidates"]]
    for key in sorted(candidates):
        label = chosen.get(key)
        if label is None:
            rows.append([key[0], *(str(part) for part in key[1:]), "– (no run has an id score)", "–", "–", "0"])
            continue
        values = candidates[key][label]
        rows.append([key[0], *(str(part) for part in key[1:]), label, differing_values(settings[key], label),
                     f"{mean(values):.1f}", str(len(candidates[key]))])
    kept = [{**summary, "label": summary["group"], "chosen_label": summary["label"]}
            for summary in summaries if chosen.get(key_of(summary)) == summary["label"]]
    return kept, rows, choice_notes


def differing_values(settings: dict[str, dict[str, Any]], label: str) -> str:
    """``"name=value, ..."`` of the hyperparameters whose values differ among the candidates
    (``settings``: label -> its runs' hyperparameters), at ``label``'s values (floats to 3
    significant digits), sorted by name; ``–`` when none differs (a single candidate)."""
    import json

    names = sorted({name for hp in settings.values() for name in hp})
    differing = [name for name in names if len({json.dumps(hp.get(name), sort_keys=True) for hp in settings.values()}) > 1]

    def shown(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    return ", ".join(f"{name}={shown(settings[label].get(name))}" for name in differing) or "–"


def comparison_pairs(labels: Sequence[str], baselines: Sequence[str] = (),
                     comparisons: Sequence[str] = ()) -> list[tuple[str, str]]:
    """The (label, baseline) pairs a report t-tests, in order and each once: every label against
    each of ``baselines``, then each ``"A vs B"`` of ``comparisons``.

    A baseline that is not a label but an algorithm run under a sweep's named variants (labels
    ``fedavg[mix0]``, ``fedavg[mix1]``) is the baseline within each variant: every label of
    variant ``V`` is paired with ``baseline[V]`` (``feddg_ga[mix0]`` with ``fedavg[mix0]``); a
    label without a variant, or of a variant without ``baseline[V]``, is not tested.

    Raises:
        ValueError: a baseline that is neither a label nor an algorithm with variant labels, a
            compared label that is not among ``labels``, or a comparison without `` vs ``.
    """
    def known(label: str, role: str) -> str:
        if label not in labels:
            raise ValueError(f"{role} {label!r} is not among the runs' labels: {', '.join(labels)}")
        return label

    def against(baseline: str) -> list[tuple[str, str]]:
        if baseline in labels:
            return [(label, baseline) for label in labels if label != baseline]
        within_variants = [(label, f"{baseline}[{variant}]") for label in labels
                           if (variant := label_variant(label)) is not None and f"{baseline}[{variant}]" in labels
                           and label != f"{baseline}[{variant}]"]
        if not within_variants:
            known(baseline, "baseline")  # raises: neither a label nor an algorithm with variant labels
        return within_variants

    pairs = [pair for baseline in baselines for pair in against(baseline)]
    for comparison in comparisons:
        method, separator, baseline = comparison.partition(" vs ")
        if not separator:
            raise ValueError(f"--compare expects 'LABEL vs BASELINE', got {comparison!r}")
        pairs.append((known(method.strip(), "compared label"), known(baseline.strip(), "compared label")))
    return list(dict.fromkeys(pairs))


def label_variant(label: str) -> str | None:
    """The sweep variant a run label names (``mix0.1`` of ``fedavg[mix0.1]``, as
    :func:`fedbed.results.run_label` writes it), or ``None`` for a label without one."""
    algorithm, bracket, rest = label.partition("[")
    return rest.partition("]")[0] if bracket and algorithm and "(" not in algorithm and "{" not in algorithm else None


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``m`` p-values (Holm 1979), in their order: with the
    p-values sorted ascending, the i-th (1-based) becomes ``max over j <= i of min(1, (m − j + 1)·p_(j))``;
    an adjusted p below α rejects at family-wise error rate α. Empty in, empty out."""
    order = sorted(range(len(p_values)), key=lambda index: p_values[index])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def t_test_rows(summaries: list[dict[str, Any]], pairs: Sequence[tuple[str, str]], selection: str) -> list[list[str]]:
    """Rows (header first) of a paired t-test of each (label, baseline) pair over the (target,
    seed) pairs of their ood scores under ``selection``, as PPDG's Table 7
    (``scipy.stats.ttest_rel``, two-sided): the number of pairs, the mean difference label −
    baseline, t, p, and p adjusted by :func:`holm` over the table's tests; "–" with fewer than
    two pairs, "undefined" where the differences do not vary (neither counts in Holm's m)."""
    rows, p_values = [], []
    for label, baseline in pairs:
        method, base = paired_pairs(summaries, label, baseline, selection, group_key="label")
        if len(method) < 2:
            rows.append([label, baseline, str(len(method)), "–", "–", "–"])
            continue
        t, p = paired_t_test(method, base)
        difference = sum(a - b for a, b in zip(method, base)) / len(method)
        if math.isnan(t):  # every pair differs by the same amount (e.g. identical runs): no variance to test
            rows.append([label, baseline, str(len(method)), f"{difference:+.2f}", "undefined",
                         "undefined: the paired differences do not vary"])
            continue
        rows.append([label, baseline, str(len(method)), f"{difference:+.2f}", f"{t:.2f}", f"{p:.3g}"])
        p_values.append((len(rows) - 1, p))
    adjusted = dict(zip((row for row, _ in p_values), holm([p for _, p in p_values])))
    header = [f"paired t-test of ood ({selection})", "against", "pairs", "mean difference", "t", "p",
              f"p, Holm over {len(p_values)}"]
    return [header] + [row + [f"{adjusted[index]:.3g}" if index in adjusted else "–"] for index, row in enumerate(rows)]


def difference_rows(summaries: list[dict[str, Any]], pairs: Sequence[tuple[str, str]], targets: Sequence[str],
                    selection: str) -> list[list[str]]:
    """Rows (header first): per (label, baseline) pair, the ood difference label − baseline
    (percentage points, two decimals, of the unrounded scores under ``selection``) in each
    (target, seed) both scored, the pairs :func:`t_test_rows` tests, then how many of them are
    above zero and how many below (a zero difference is neither). Columns: per target, one per
    seed that any of ``summaries`` ran there (``"<target>, seed <s>"``); "–" where the label or
    its baseline has no score. It shows what the paired test's mean difference averages: whether
    a gain is on every target and seed or on a few."""
    columns = [(target, seed) for target in targets
               for seed in sorted({s["seed"] for s in summaries if s["target"] == target})]
    rows = [[f"ood difference ({selection}), label − baseline", "against",
             *(f"{target}, seed {seed}" for target, seed in columns), "above", "below"]]
    for label, baseline in pairs:
        matched = matched_scores(summaries, label, baseline, selection, group_key="label")
        shown = [matched[column][0] - matched[column][1] if column in matched else None for column in columns]
        values = [value for value in shown if value is not None]
        rows.append([label, baseline, *("–" if value is None else f"{value:+.2f}" for value in shown),
                     str(sum(value > 0 for value in values)), str(sum(value < 0 for value in values))])
    return rows


@dataclass(frozen=True)
class Report:
    """What ``fedbed report`` shows (:func:`build_report`).

    Attributes:
        selections: the model-selection rules of the tables; the first is the one the t-tests,
            ``select_hparams`` and the plots use.
        tables: rows (header first) by key of :data:`TABLE_HEADINGS`: ``ood``, ``id``, and with
            comparisons ``t_test``, with ``select_hparams`` ``selected_hyperparameters``, with
            ``by_round`` one ``by_round:QUANTITY:TARGET`` each, with ``differences`` (and
            comparisons) ``differences``.
        summaries: the labelled summaries the tables read (under ``select_hparams``, the chosen
            runs relabelled by their group, and the kept labels' runs under their own labels: a
            run can appear under both; :func:`distinct_runs` counts it once).
        runs: the runs of the shown targets and labels (under ``select_hparams``, every candidate
            of the shown methods, and the kept labels' runs), for the settings block and the plots.
        notes: which data the runs read (``data: ...``, :func:`data_sources`) and what their
            evaluation read (:func:`evaluation_notes`).
        warnings: runs made by several versions of the code (:func:`code_mix_warning`), and
            unfinished runs left out.
        unfinished: the unfinished runs of the shown targets and seeds
            (:func:`fedbed.results.unfinished_runs`), which the tables and plots leave out.
    """

    selections: list[str]
    tables: dict[str, list[list[str]]]
    summaries: list[dict[str, Any]]
    runs: list[FinishedRun]
    notes: list[str]
    warnings: list[str]
    unfinished: list[Path]


def build_report(
    sweep_dirs: Path | Sequence[Path],
    selections: str | Sequence[str] = ("train_domain_val",),
    spread: str = "std",
    baselines: Sequence[str] = (),
    comparisons: Sequence[str] = (),
    select_hparams: bool = False,
    targets: Sequence[str] = (),
    labels: Sequence[str] = (),
    per_seed: bool = False,
    allow_mixed_data: bool = False,
    select_per_seed: bool = False,
    by_round: Sequence[str] = (),
    seeds: Sequence[int] = (),
    keep_labels: Sequence[str] = (),
    differences: bool = False,
) -> Report:
    """The report of one sweep folder or of several read together: rows are labels (method,
    variant and varied hyperparameters, :func:`fedbed.results.labelled_runs`), columns target
    domains (:func:`score_table`); runs pair by (label, target, seed) across the folders, a job
    copied into several counts once, and two different runs under one key are refused.

    Args:
        sweep_dirs: the folders.
        selections: model-selection rules (:data:`~fedbed.federation.evaluation.REPORT_SELECTIONS`),
            one column each; the first drives the t-tests and ``select_hparams``.
        spread: ``"std"`` (over seeds) or ``"se"`` (standard error).
        baselines: labels to t-test every other shown label against (:func:`comparison_pairs`).
        comparisons: ``"LABEL vs BASELINE"`` pairs to t-test.
        select_hparams: keep, per method (and variant) and target, the hyperparameters with the best
            source validation (:func:`select_hyperparameters`).
        targets: show only these targets, in this order (default: all, shortest name first).
        labels: show only these labels (rows), in this order (default: all, sorted); under
            ``select_hparams``, method (and variant) names.
        per_seed: a column per seed beside each mean (:func:`score_table`).
        allow_mixed_data: report runs that read different data together.
        select_per_seed: with ``select_hparams``, choose for each seed on its own (DomainBed's
            grouping by trial seed) instead of by the mean over seeds.
        by_round: quantities (``ood``, ``id`` or a logged metric's name) to show at every
            evaluated round: one :func:`by_round_table` per quantity and target, keyed
            ``by_round:QUANTITY:TARGET``, after the other tables.
        seeds: read only the runs of these seeds (default: all), e.g. the seeds a sweep run in
            parts has finished on every target; the t-tests, ``select_hparams`` and every table
            then see those runs only.
        keep_labels: with ``select_hparams``, candidate labels (e.g. ``fedavg(trial=0)``, a
            random search's defaults) kept as rows of their own beside the choices, so that a
            comparison can t-test a tuned method against its defaults (a cell where the defaults
            were chosen pairs a run with itself).
        differences: with comparisons, a table of each tested pair's difference in every
            (target, seed) (:func:`difference_rows`), after the t-tests.

    Raises:
        ValueError: an unknown rule or spread, no finished run, two different runs under one
            (label, target, seed), a run ``last_five_mean`` cannot score, a target, label,
            baseline, compared label or seed not among the runs', ``select_hparams`` with ``oracle``,
            ``select_per_seed`` or ``keep_labels`` without ``select_hparams``, a kept label not
            among the runs' labels or that is its method's only candidate (already a row), runs
            that read different data without ``allow_mixed_data``, a ``by_round`` quantity no
            run logged, or ``differences`` without comparisons.
    """
    from fedbed.federation.evaluation import REPORT_SELECTIONS

    folders = as_folders(sweep_dirs)
    asked_targets = tuple(targets)
    selections = [selections] if isinstance(selections, str) else list(selections) or ["train_domain_val"]
    for selection in selections:
        if selection not in REPORT_SELECTIONS:
            raise ValueError(f"unknown selection {selection!r}; choose one of {', '.join(REPORT_SELECTIONS)}")
    if spread not in ("std", "se"):
        raise ValueError(f"--spread must be 'std' or 'se', got {spread!r}")
    runs = scored_runs(folders, selections)
    if not runs:
        where = ", ".join(str(folder) for folder in folders)
        raise ValueError(f"{where} {'holds' if len(folders) == 1 else 'hold'} no finished run (no {SUMMARY_NAME})")
    found = sorted({run.summary["target"] for run in runs}, key=lambda t: (len(t), t))
    for target in targets:
        if target not in found:
            raise ValueError(f"target {target!r} is not among the runs' targets: {', '.join(found)}")
    targets = list(targets) or found
    runs = [run for run in runs if run.summary["target"] in targets]
    found_seeds = sorted({run.summary["seed"] for run in runs})
    for seed in seeds:
        if seed not in found_seeds:
            raise ValueError(f"seed {seed} is not among the seeds of the runs on {', '.join(targets)}: "
                             f"{', '.join(map(str, found_seeds))}")
    runs = [run for run in runs if not seeds or run.summary["seed"] in seeds]
    summaries, choices, choice_notes = [run.summary for run in runs], None, []
    folder_of = {(run.summary["label"], run.summary["target"], run.summary["seed"]): run.path for run in runs}
    if select_per_seed and not select_hparams:
        raise ValueError("--select-per-seed says how --select-hparams chooses; give --select-hparams too")
    if keep_labels and not select_hparams:
        raise ValueError("--keep-label keeps a candidate beside --select-hparams's choices; give --select-hparams "
                         "too (without it every label is a row already)")
    candidate_labels = sorted({s["label"] for s in summaries})
    for label in keep_labels:
        if label not in candidate_labels:
            raise ValueError(f"--keep-label {label!r} is not among the runs' labels: {', '.join(candidate_labels)}")
        if any(s["label"] == label == s["group"] for s in summaries):
            raise ValueError(f"--keep-label {label!r} is a method with a single candidate, already a row of its own "
                             "under --select-hparams; keep a candidate label such as 'fedavg(trial=0)'")
    if select_hparams:
        kept = [s for s in summaries if s["label"] in keep_labels]
        summaries, choices, choice_notes = select_hyperparameters(summaries, selections[0], select_per_seed)
        summaries += kept
    # A group whose runs have no id score in any target keeps no run, but keeps its row (of "–")
    # and its choice rows, which say why.
    shown = sorted({s["label"] for s in summaries} | {row[0] for row in (choices or [[]])[1:]})
    for label in labels:
        if label not in shown:
            raise ValueError(f"label {label!r} is not among the runs' labels: {', '.join(shown)}")
    labels = list(labels) or shown
    summaries = [s for s in summaries if s["label"] in labels]
    targets = [target for target in targets if any(s["target"] == target for s in summaries)]
    tables = {kind: score_table(summaries, labels, targets, selections, kind, spread, "label", per_seed)
              for kind in ("ood", "id")}
    pairs = comparison_pairs(labels, baselines, comparisons)
    if differences and not pairs:
        raise ValueError("--differences shows each tested pair's difference per target and seed; give --baseline "
                         "or --compare too")
    if pairs:
        tables["t_test"] = t_test_rows(summaries, pairs, selections[0])
    if differences:
        tables["differences"] = difference_rows(summaries, pairs, targets, selections[0])
    if choices is not None:
        tables["selected_hyperparameters"] = [choices[0]] + [row for row in choices[1:] if row[0] in labels]
    shown_runs = [(s["label"], s["target"], folder_of[s.get("chosen_label", s["label"]), s["target"], s["seed"]])
                  for s in summaries]
    unknown = [q for q in by_round if q not in BY_ROUND_SCORES]
    logged = logged_metrics([path for _, _, path in shown_runs]) if unknown else set()
    for quantity in unknown:
        if quantity not in logged:
            raise ValueError(f"--by-round {quantity}: no shown run logged a metric of that name; choose ood, id or "
                             f"one of: {', '.join(sorted(logged)) or 'none'}")
    for quantity in by_round:
        for target in targets:
            tables[f"by_round:{quantity}:{target}"] = by_round_table(
                labels, [(label, path) for label, run_target, path in shown_runs if run_target == target], quantity,
                target, spread)
    distinct = distinct_runs(summaries)
    sources, mixed = data_sources(distinct)
    if mixed and not allow_mixed_data:
        raise ValueError(f"the runs in {', '.join(str(folder) for folder in folders)} read different data "
                         f"({'; '.join(sources)}); report them separately, or pass --allow-mixed-data")
    warnings = [warning for warning in [code_mix_warning(distinct)] if warning is not None]
    unfinished = unfinished_runs(folders, asked_targets, seeds)
    if unfinished:
        warnings.append(f"note: {len(unfinished)} unfinished run(s) left out (no {SUMMARY_NAME} yet), e.g. {unfinished[0]}")
    runs = [run for run in runs
            if run.summary["label"] in labels or select_hparams and run.summary["group"] in labels]
    return Report(selections, tables, summaries, runs,
                  [f"data: {line}" for line in sources] + evaluation_notes(distinct) + holdout_steering_notes(distinct)
                  + collapse_notes(summaries)
                  + uneven_seed_notes(summaries, labels, targets)
                  + missing_score_notes(summaries, selections) + [note for group, note in choice_notes if group in labels],
                  warnings, unfinished)


def render_report(report: Report, format: str = "markdown") -> str:
    """The report's text as ``fedbed report`` prints it: its tables in ``format`` (``markdown``
    or ``latex``, :data:`RENDERERS`), separated by blank lines, and with Markdown its notes
    after them; with ``csv``, :func:`tidy_rows` of every selection rule instead.

    Raises:
        ValueError: an unknown format, or ``csv`` with ``by_round`` or ``differences`` tables.
    """
    if format == "csv":
        formatted_only = [option for option, shown in (
            ("--by-round", any(key.startswith("by_round:") for key in report.tables)),
            ("--differences", "differences" in report.tables)) if shown]
        if formatted_only:
            raise ValueError(f"--format csv writes the tidy rows of the scores; the {' and '.join(formatted_only)} "
                             "tables are markdown or latex: drop one of the two")
        return to_csv(tidy_rows(report.summaries, report.selections)).rstrip("\n")
    if format not in RENDERERS:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(RENDERERS)}, csv")
    text = "\n\n".join(RENDERERS[format](rows) for rows in report.tables.values())
    return text + "\n\n" + "\n".join(report.notes) if report.notes and format == "markdown" else text


def distinct_runs(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``summaries`` with each run once: under ``select_hparams`` a kept label's run
    (:func:`build_report`'s ``keep_labels``) may also be its group's choice, shown under both
    labels; notes that count runs count it once."""
    return list({(s.get("chosen_label", s["label"]), s["target"], s["seed"]): s for s in summaries}.values())


def collapse_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """One line per run whose model collapsed to one class (the summary's ``collapse``,
    :func:`fedbed.federation.evaluation.collapse_of`); the score tables mark its cells with †."""
    return [f"† collapsed: {s['label']}, target {s['target']}, seed {s['seed']}: class {s['collapse']['class']} predicted "
            f"for {s['collapse']['share']:.0%} of the source holdouts from round {s['collapse']['round']}"
            for s in summaries if s.get("collapse")]


def _counted(count: Any, noun: str) -> str:
    """``count`` and ``noun`` in words, the noun plural unless ``count`` is 1 ("1 run", "3 runs")."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def uneven_seed_notes(summaries: list[dict[str, Any]], labels: Sequence[str], targets: Sequence[str]) -> list[str]:
    """One line per label whose "mean" column (:func:`score_table`) averages targets run with
    different numbers of seeds: a partly run multi-seed sweep weighs each target's mean alike
    whatever its seeds, so the line names the seeds per target (shown with two or more targets,
    for labels with runs on every target)."""
    notes = []
    for label in labels:
        seeds = {target: len({s["seed"] for s in summaries if s["label"] == label and s["target"] == target})
                 for target in targets}
        if len(targets) > 1 and all(seeds.values()) and len(set(seeds.values())) > 1:
            by_count: dict[int, list[str]] = {}
            for target, count in seeds.items():
                by_count.setdefault(count, []).append(target)
            listed = "; ".join(f"{', '.join(names)}: {_counted(count, 'seed')}"
                               for count, names in sorted(by_count.items(), reverse=True))
            notes.append(f"uneven seeds: {label}'s mean averages targets run with different numbers of seeds ({listed})")
    return notes


def holdout_steering_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """One line per label whose runs' training read their id-validation holdouts
    (:func:`fedbed.algorithms.base.client_reports.holdout_steering`, from each run's recorded
    ``hp``), with its number of runs: their id scores and ``train_domain_val`` choices are not
    read on samples training left alone."""
    from fedbed.algorithms.base.client_reports import holdout_steering

    counts = Counter((summary.get("chosen_label", summary["label"]), statement) for summary in summaries
                     if (statement := holdout_steering(summary.get("hp") or {})) is not None)
    return [f"id holdouts read by training ({label}, {_counted(count, 'run')}): {statement}"
            for (label, statement), count in counts.items()]


def evaluation_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """What the evaluation of the runs of ``summaries`` read, and what privacy they guarantee,
    one line per distinct statement with its number of runs: a table scored by a linear probe,
    which reads target labels, or under domain adaptation says so
    (:meth:`fedbed.build.BuiltRun.evaluation_statement`); runs under differential privacy give
    their (ε, δ) (:func:`fedbed.algorithms.options.differential_privacy.privacy_statement`)."""
    counts: Counter[str] = Counter()
    for summary in summaries:
        statement = summary.get("evaluation") or {}
        counts.update(f"evaluation ({{}}): {statement[key]}" for key in ("note", "adaptation_note") if key in statement)
        if summary.get("privacy"):
            counts[f"privacy ({{}}): {summary['privacy']['note']}"] += 1
    return [note.format(_counted(count, "run")) for note, count in counts.items()]


def data_sources(summaries: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """Which data the runs read: one line per source (its description without folders,
    :func:`fedbed.data.base.portable_source`, and its fingerprints) with its number of runs, and
    whether they mix data (more than one source, or more than one fingerprint)."""
    from fedbed.data.base import portable_source

    runs: Counter[str] = Counter()
    fingerprints: dict[str, set[str]] = {}
    for summary in summaries:
        source = portable_source(summary.get("data_source", "unrecorded"))
        runs[source] += 1
        fingerprints.setdefault(source, set()).update([summary["data_fingerprint"]] if summary.get("data_fingerprint") else [])
    lines = [f"{source} (fingerprint {', '.join(sorted(fingerprints[source])) or 'unrecorded'}): "
             f"{_counted(count, 'run')}" for source, count in sorted(runs.items())]
    mixed = len(runs) > 1 or len(set().union(*fingerprints.values())) > 1
    return lines, mixed


def code_mix_warning(summaries: list[dict[str, Any]]) -> str | None:
    """One line if the runs of ``summaries`` were made by more than one version of FedBed's code,
    counting a run resumed under other code than it began with
    (:func:`fedbed.provenance.code_versions`), else ``None``: a code change can change a
    method's numbers under unchanged settings, and a sweep skips finished jobs."""
    from fedbed.provenance import code_versions, source_mix

    mix, versions = source_mix(summaries), code_versions(summaries)
    if len(versions) < 2:
        return None
    counts = ", ".join(f"{source.replace('+', ' then ')}: {count}" for source, count in mix.most_common())
    return (f"warning: these runs come from {len(versions)} versions of FedBed's code (runs per source fingerprint: "
            f"{counts}); their numbers may not be comparable: delete the older run folders and run the sweep again")


def mixed_code_warning(sweep_dirs: Path | Sequence[Path]) -> str | None:
    """:func:`code_mix_warning` of every finished run below one or more folders."""
    return code_mix_warning(collect_summaries(sweep_dirs))


RENDERERS = {"markdown": to_markdown, "latex": to_latex}
"""Renderers of the formatted tables; ``csv`` writes :func:`tidy_rows` instead."""


TABLE_HEADINGS = {
    "ood": "Accuracy on the unseen target domain (ood)",
    "id": "Accuracy on the source domains' validation holdouts (id)",
    "t_test": "Paired t-tests against the baseline",
    "differences": "Differences from the baseline per target and seed",
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

    budgets = [_counted(c.get("rounds"), "round") + " x " + (_counted(c["local_epochs"], "local epoch") if c.get("local_epochs")
                                                              else _counted(c.get("local_steps"), "local step"))
               + f", batch {c.get('batch_size')}" for c in configs]
    return [("dataset", values(s.get("dataset") for s in summaries)),
            ("data", "; ".join(data_sources(distinct_runs(summaries))[0])),
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
        parts.append(f"<h2>{html.escape(TABLE_HEADINGS.get(name, rows[0][0]))}</h2><table id='{html.escape(name)}'><tr>")
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


def write_html_report(report: Report, sweep_dirs: Sequence[Path], path: Path,
                      plot: Callable[[Sequence[Path], str, Path | None, list[FinishedRun], list[Path]], list[Path]]) -> Path:
    """Write ``fedbed report --html``'s page for ``report`` of ``sweep_dirs`` to ``path``: the
    plots of its first selection rule (``plot``, :func:`fedbed.plots.plot_sweep`: into the
    folder's ``plots/``, or for several folders beside the page, ``<name>_plots/``), the settings
    block (:func:`sweep_settings`), the notes other than the data lines (the settings give the
    data) and the tables (:func:`html_report`); return ``path``.

    ``plot`` is passed in: :mod:`fedbed.plots` imports this module, which does not import it back.
    """
    plots = path.parent / f"{path.stem}_plots" if len(sweep_dirs) > 1 else None
    images = plot(sweep_dirs, report.selections[0], plots, report.runs, report.unfinished)
    title = ", ".join(folder.name for folder in sweep_dirs)
    selections = ", ".join(report.selections)
    path.write_text(html_report(report.tables, images, f"FedBed report: {title} ({selections})",
                                [note for note in report.notes if not note.startswith("data: ")],
                                sweep_settings(report.summaries, [run.config for run in report.runs], selections)))
    return path
