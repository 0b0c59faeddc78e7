"""Plots of a run's alignment telemetry (in the spirit of hFedF Fig. 5a and FedGaLA Fig. 2b), of its
features (a t-SNE of the source and reference features, FedADG Fig. 3-4) and of a sweep (accuracy
curves, per-domain bars and the alignment telemetry across runs)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedbed.run_directory import LOG_NAME, PLOTS_FOLDER  # noqa: E402

if TYPE_CHECKING:
    from fedbed.results import FinishedRun


class PlotError(ValueError):
    """Raised when a run directory has no log or no alignment telemetry to plot."""


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """The per-round records of ``run_dir/rounds.jsonl``.

    Raises:
        PlotError: if the log is missing or empty.
    """
    from fedbed.run_result import read_log

    log = run_dir / LOG_NAME
    if not log.is_file():
        raise PlotError(f"{log} does not exist; give the directory of a FedBed run")
    records = read_log(run_dir)
    if not records:
        raise PlotError(f"{log} holds no round yet")
    return records


def _aggregation_weights(record: dict[str, Any]) -> dict[int, float]:
    """Client id -> weight the aggregator gave, from either telemetry form (dict or list + clients)."""
    telemetry = record.get("telemetry") or {}
    weights = telemetry.get("weights")
    if isinstance(weights, dict):
        return {int(c): float(w) for c, w in weights.items()}
    if isinstance(weights, list):
        clients = telemetry.get("clients") or (record.get("alignment") or {}).get("clients", [])
        return {int(c): float(w) for c, w in zip(clients, weights)}
    return {}


def plot_alignment(run_dir: Path, max_heatmaps: int = 16) -> list[Path]:
    """Write the alignment plots of a run into ``run_dir/plots/``.

    Files: ``cosine/round_XXXX.png`` (the pairwise cosine matrix of the client updates, one per
    round), ``alignment_cosine_overview.png`` (up to ``max_heatmaps`` rounds, evenly spaced) and
    ``alignment_over_rounds.png`` (conflicting pairs, update norms per client, aggregation
    weights per client and, where the aggregator masks coordinates, the masked fraction).

    Returns:
        The paths written.

    Raises:
        PlotError: no log, or no round with alignment telemetry.
    """
    records = [r for r in read_rounds(run_dir) if r.get("alignment")]
    if not records:
        raise PlotError(f"{run_dir / LOG_NAME} has no alignment telemetry (no client update was comparable)")
    out = run_dir / PLOTS_FOLDER
    (out / "cosine").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def heatmap(axis, record):
        alignment = record["alignment"]
        # A diverged round logs non-finite cosines as null: drawn as blank cells.
        image = axis.imshow(np.array(alignment["cosine"], dtype=float), vmin=-1, vmax=1, cmap="RdBu")
        labels = [str(c) for c in alignment["clients"]]
        axis.set_xticks(range(len(labels)), labels)
        axis.set_yticks(range(len(labels)), labels)
        axis.set_title(f"round {record['round']}")
        return image

    for record in records:
        figure, axis = plt.subplots(figsize=(4, 3.4))
        image = heatmap(axis, record)
        axis.set_xlabel("client")
        axis.set_ylabel("client")
        figure.colorbar(image, ax=axis, label="cosine of client updates")
        axis.set_title(f"{run_title(run_dir)}, round {record['round']}", fontsize="small")
        path = out / "cosine" / f"round_{record['round']:04d}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(path)

    step = max(1, -(-len(records) // max_heatmaps))
    chosen = records[::step][:max_heatmaps]
    columns = min(4, len(chosen))
    rows = -(-len(chosen) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3 * columns, 2.8 * rows), squeeze=False)
    for axis in axes.flat[len(chosen):]:
        axis.axis("off")
    for axis, record in zip(axes.flat, chosen):
        image = heatmap(axis, record)
    figure.colorbar(image, ax=axes, label="cosine of client updates")
    path = out / "alignment_cosine_overview.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    written.append(path)

    rounds = [r["round"] for r in records]
    masked = [(r["round"], r["telemetry"]["masked_fraction"]) for r in records if "masked_fraction" in (r.get("telemetry") or {})]
    panels = 4 if masked else 3
    figure, axes = plt.subplots(panels, 1, figsize=(7, 2.4 * panels), sharex=True)
    axes[0].plot(rounds, [r["alignment"]["conflicting_pairs"] for r in records], marker="o")
    axes[0].set_ylabel("conflicting pairs")
    clients = sorted({c for r in records for c in r["alignment"]["clients"]})
    for client in clients:
        points = [(r["round"], _finite(r["alignment"]["update_norms"][r["alignment"]["clients"].index(client)]))
                  for r in records if client in r["alignment"]["clients"]]
        axes[1].plot(*zip(*points), marker=".", label=f"client {client}")
        weights = [(r["round"], _aggregation_weights(r)[client]) for r in records if client in _aggregation_weights(r)]
        if weights:
            axes[2].plot(*zip(*weights), marker=".", label=f"client {client}")
    axes[1].set_ylabel("update norm ||Δθ||")
    axes[1].legend(fontsize="small", ncol=min(4, len(clients)))
    axes[2].set_ylabel("aggregation weight")
    # Weights live in [0, 1] (FedAvg's n_k/n, reweightings): a fixed range keeps equal weights
    # a flat line instead of magnifying rounding noise into a slope.
    top = max([1.0] + [w for r in records for w in _aggregation_weights(r).values()])
    axes[2].set_ylim(min([0.0] + [w for r in records for w in _aggregation_weights(r).values()]), top * 1.05)
    if masked:
        axes[3].plot(*zip(*masked), marker="o")
        axes[3].set_ylabel("masked fraction")
    axes[-1].set_xlabel("round")
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of pairs, from 0
    axes[0].set_ylim(-0.5, max([1] + [r["alignment"]["conflicting_pairs"] for r in records]) + 0.5)
    round_axis(axes[-1], rounds)
    figure.suptitle(f"{run_title(run_dir)}\nclients: {client_domains(run_dir, clients)}", fontsize="medium")
    path = out / "alignment_over_rounds.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    written.append(path)
    return written


def round_axis(axis, rounds: list[int]) -> None:
    """Whole-round ticks on ``axis``'s x-axis; a single round gets a window of one round either
    side (matplotlib's default ±5% would tick 0.945 … 1.050)."""
    if len(set(rounds)) == 1:
        axis.set_xlim(rounds[0] - 1, rounds[0] + 1)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_title(run_dir: Path) -> str:
    """``"<algorithm> on <dataset>, target <target>, seed <seed> (<folder>)"`` from the run's
    ``config.yaml``, or the folder name alone for a run without one."""
    import yaml

    from fedbed.run_directory import CONFIG_NAME

    config_path = run_dir / CONFIG_NAME
    if not config_path.is_file():
        return run_dir.name
    config = yaml.safe_load(config_path.read_text()) or {}
    return (f"{config.get('algorithm')} on {config.get('dataset')}, target {config.get('target')}, "
            f"seed {config.get('seed')} ({run_dir.name})")


def client_domains(run_dir: Path, clients: list[int]) -> str:
    """``"0 = art_painting, 1 = cartoon"``: each client and the domains it holds, from the run's
    ``summary.json`` (client ids alone while the run has none)."""
    from fedbed.run_directory import SUMMARY_NAME

    summary_path = run_dir / SUMMARY_NAME
    held = json.loads(summary_path.read_text()).get("clients", []) if summary_path.is_file() else []
    return ", ".join(f"{c} = {'+'.join(held[c])}" if c < len(held) else str(c) for c in clients)


def _finite(value: float | None) -> float:
    """A logged number, null (a non-finite value in the strict-JSON log) read back as ``nan``."""
    return float("nan") if value is None else float(value)


def _mean_std_by_round(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float], list[float]]:
    """Rounds, and per round the mean and sample std (0 for a single value) of ``row[key]`` over
    ``rows`` (rows of :func:`fedbed.results.round_rows` or :func:`fedbed.results.query_rounds`); null values
    are left out."""
    import statistics

    by_round: dict[int, list[float]] = {}
    for row in rows:
        if row[key] is not None:
            by_round.setdefault(row["round"], []).append(row[key])
    rounds = sorted(by_round)
    means = [statistics.fmean(by_round[r]) for r in rounds]
    spreads = [statistics.stdev(by_round[r]) if len(by_round[r]) > 1 else 0.0 for r in rounds]
    return rounds, means, spreads


def _plot_mean_band(axis, rows: list[dict[str, Any]], key: str, label: str) -> None:
    """One line of ``row[key]`` vs round (mean over ``rows``) with a band of ± one std."""
    rounds, means, spreads = _mean_std_by_round(rows, key)
    axis.plot(rounds, means, label=label, marker="o", markersize=3)
    axis.fill_between(rounds, [m - s for m, s in zip(means, spreads)], [m + s for m, s in zip(means, spreads)], alpha=0.2)
    round_axis(axis, rounds)


def _legend_beside(axis) -> None:
    """The figure's legend (one entry per label) to the right of ``axis``, the last panel, where
    long labels (a report over several folders names hyperparameters) cover no curve."""
    handles, labels = axis.figure.axes[0].get_legend_handles_labels()
    axis.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def _caption(figure, notes: list[str]) -> None:
    """Write ``notes`` (what the evaluation read, :func:`fedbed.reporting.evaluation_notes`, and
    the unfinished runs left out) under ``figure``, wrapped to its width, so a plot shown alone
    says what a report says."""
    import textwrap

    if notes:
        text = "\n".join(line for note in ["the sweep's finished runs (all targets):", *notes]
                          for line in textwrap.wrap(note, 150))
        figure.text(0.0, -0.02, text, fontsize="x-small", va="top", ha="left")


def plot_sweep(sweep_dirs: Path | Sequence[Path], selection: str = "train_domain_val", out: Path | None = None,
               runs: list[FinishedRun] | None = None, unfinished: Sequence[Path] | None = None) -> list[Path]:
    """Write the plots of one sweep folder's finished runs, or of several folders' read together
    (labelled and paired as :func:`fedbed.reporting.build_report` does).

    Files: ``curve_<target>.png`` (ood and id accuracy vs round per label, mean over seeds with a
    band of ± one std), ``domains_<selection>.png`` (per-domain id and ood accuracy per label
    under ``selection``, mean over seeds and targets) and, when any run logged alignment
    telemetry, ``alignment_over_rounds.png`` (per label, the mean pairwise cosine of the client
    updates and the number of conflicting pairs ``⟨Δθ_i, Δθ_j⟩ < 0`` vs round, mean over targets
    and seeds with a band of ± one std; the sweep-wide view of :func:`plot_alignment`). Only
    finished runs (with ``summary.json``) are drawn: a running or interrupted job would pull a
    curve's late rounds towards its few seeds; the captions count the unfinished runs left out.
    The accuracy plots of runs scored by a linear probe (which trains on target labels) or under
    domain adaptation carry the reports' evaluation notes as a caption.

    Args:
        sweep_dirs: a sweep folder, or several.
        selection: the rule of the per-domain bars.
        out: where to write (default: the one folder's ``plots/``; required for several folders).
        runs: the runs to draw, scored under ``selection``
            (:func:`fedbed.reporting.scored_runs`; default: every finished run of the folders).
        unfinished: the unfinished runs the captions count (default: every one of the folders,
            :func:`fedbed.results.unfinished_runs`); a report of some targets or seeds passes its own.

    Returns:
        The paths written.

    Raises:
        ValueError: several folders without ``out``; ``last_five_mean`` and a run it cannot score
            (:func:`fedbed.reporting.scored_runs`); two different runs under one label, target and seed.
    """
    import statistics

    from fedbed.reporting import evaluation_notes, run_score, scored_runs
    from fedbed.results import as_folders, round_rows, unfinished_runs

    folders = as_folders(sweep_dirs)
    if out is None and len(folders) != 1:
        raise ValueError("the plots of several sweep folders need a folder to go to (out)")
    out = out if out is not None else folders[0] / PLOTS_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    runs = scored_runs(folders, selection) if runs is None else runs
    summaries = [run.summary for run in runs]
    all_rows = [{**row, "label": run.summary["label"], "target": run.summary["target"], "seed": run.summary["seed"]}
                for run in runs for row in round_rows(run.path)]
    rows = [r for r in all_rows if r["ood_mean"] is not None]
    notes = [note for note in evaluation_notes(summaries) if note.startswith("evaluation")]
    unfinished = unfinished_runs(folders) if unfinished is None else unfinished
    if unfinished:
        notes.append(f"left out: {len(unfinished)} unfinished run(s), without summary.json")
    for target in sorted({r["target"] for r in rows}, key=lambda t: (len(t), t)):
        figure, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
        for label in sorted({r["label"] for r in rows if r["target"] == target}):
            runs = [r for r in rows if r["target"] == target and r["label"] == label]
            for axis, key in zip(axes, ("ood_mean", "id_mean")):
                _plot_mean_band(axis, runs, key, label)
        axes[0].set_title(f"ood (target {target})")
        axes[1].set_title("id (source holdouts)")
        for axis in axes:
            axis.set_xlabel("round")
            axis.set_ylabel("accuracy (%), mean ± std over seeds")
        _legend_beside(axes[-1])
        _caption(figure, notes)
        path = out / f"curve_{target}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(path)

    labels = sorted({s["label"] for s in summaries})
    figure, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for axis, kind in zip(axes, ("id", "ood")):
        domains = sorted({d for s in summaries for d in s["selection"][selection][kind]}, key=lambda d: (len(d), d))
        width = 0.8 / max(1, len(labels))
        for position, label in enumerate(labels):
            heights = []
            for domain in domains:
                scores = [run_score(s, selection, kind, domain) for s in summaries if s["label"] == label]
                values = [value for value in scores if value is not None]
                heights.append(statistics.fmean(values) if values else math.nan)  # no score: no bar
            axis.bar([i + position * width for i in range(len(domains))], heights, width, label=label)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(domains))], domains)
        axis.set_title(f"{kind} accuracy per domain ({selection}{', oracle' if selection == 'oracle' else ''})")
        axis.set_ylabel("accuracy (%), mean over runs")
    _legend_beside(axes[-1])
    _caption(figure, notes)
    path = out / f"domains_{selection}.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    written.append(path)

    aligned = [r for r in all_rows if r["conflicting_pairs"] is not None]
    if aligned:
        figure, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
        for label in sorted({r["label"] for r in aligned}):
            runs = [r for r in aligned if r["label"] == label]
            for axis, key in zip(axes, ("mean_cosine", "conflicting_pairs")):
                _plot_mean_band(axis, runs, key, label)
        figure.suptitle("alignment of the client updates, mean ± std over targets and seeds")
        axes[0].set_ylabel("mean pairwise cosine")
        axes[0].axhline(0, color="grey", linewidth=0.8)
        axes[1].set_ylabel(r"conflicting pairs $\langle\Delta\theta_i, \Delta\theta_j\rangle < 0$")
        for axis in axes:
            axis.set_xlabel("round")
        _legend_beside(axes[-1])
        path = out / "alignment_over_rounds.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


DOMAIN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
"""Marker of each source domain in :func:`plot_features` (in domain order)."""


def plot_features(run_dir: Path, per_domain: int = 100, seed: int = 0, data_root: Path | None = None) -> tuple[Path, dict[str, int]]:
    """A t-SNE (van der Maaten and Hinton 2008, scikit-learn's) of the source features and the
    reference features of a run's latest global model (FedADG's Fig. 3-4), into
    ``run_dir/plots/features_tsne.png``.

    The run is rebuilt from its ``config.yaml`` (the same seeded split) and its global model is
    restored from ``checkpoint.pt``. Up to ``per_domain`` training samples of each source domain,
    drawn with ``seed``, are embedded by the featurizer (``[n, d]``, evaluation mode). A model that
    draws reference features (``reference_features(labels)``: FedADG's G(z, y), or its fixed
    reference) adds one reference feature per source sample, for that sample's label, drawn with
    ``seed``. Colour: the class; marker: the source domain; reference features: stars with a red
    edge (the paper's red asterisks), in their class's colour.

    Args:
        run_dir: a FedBed run directory with ``config.yaml`` and ``checkpoint.pt``.
        per_domain: at most this many samples per source domain (>= 2).
        seed: drives the subsample, the reference draws and t-SNE.
        data_root: where the run's data is, if not where it was trained.

    Returns:
        The image's path and ``{"source": n, "reference": m}``, the points drawn.

    Raises:
        PlotError: no run or checkpoint there, its data cannot be loaded, a model without a
            featurizer, or ``per_domain < 2``.
    """
    import torch
    from sklearn.manifold import TSNE

    from fedbed.config import ConfigError
    from fedbed.experiment import restore_run

    if per_domain < 2:
        raise PlotError(f"--per-domain must be at least 2, got {per_domain}")
    try:
        built, model, checkpoint_round = restore_run(run_dir, data_root)
        built.require_domains(built.split.source_domains, "the feature plot (it draws the source domains' samples)")
    except ConfigError as error:
        raise PlotError(f"cannot rebuild the run of {run_dir}: {error}") from None
    if not hasattr(model, "featurizer"):
        raise PlotError(f"the {built.algorithm.name} model of {run_dir} has no featurizer to plot")
    generator = torch.Generator().manual_seed(seed)
    chosen = [built.split.train[d][torch.randperm(len(built.split.train[d]), generator=generator)[:per_domain]]
              for d in built.split.source_domains]
    indices = torch.cat(chosen)
    data = built.data(indices)
    features = data.outputs_of(model.featurizer)
    reference = None
    if hasattr(model, "reference_features"):
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            reference = model.reference_features(data.targets)
    points = features if reference is None else torch.cat([features, reference])
    embedded = TSNE(n_components=2, perplexity=min(30.0, (len(points) - 1) / 3), init="pca",
                    random_state=seed).fit_transform(points.numpy().astype(np.float64))
    dataset = built.dataset
    colours = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (6, 7)]  # red marks the reference
    colour = [colours[int(label) % len(colours)] for label in data.targets]
    domains = data.domains.tolist()
    figure, axis = plt.subplots(figsize=(7, 6))
    for position, domain in enumerate(built.split.source_domains):
        mask = np.array([d == domain for d in domains])
        marker = DOMAIN_MARKERS[position % len(DOMAIN_MARKERS)]
        axis.scatter(embedded[: len(features)][mask, 0], embedded[: len(features)][mask, 1], s=14, alpha=0.8,
                     marker=marker, c=[colour[i] for i in np.flatnonzero(mask)])
        axis.scatter([], [], c="grey", marker=marker, label=f"domain {dataset.domain_names[domain]}")
    if reference is not None:
        axis.scatter(embedded[len(features):, 0], embedded[len(features):, 1], s=60, marker="*", c=colour,
                     edgecolors="red", linewidths=0.6, label="reference features")
    for label in sorted(set(data.targets.tolist())):
        axis.scatter([], [], c=[colours[label % len(colours)]], marker="s", label=f"class {dataset.class_names[label]}")
    axis.legend(fontsize="x-small", loc="best", ncol=2)
    axis.set_title(f"{built.algorithm.name}, target {built.config.target}: t-SNE of features after round {checkpoint_round}")
    axis.set_xticks([])
    axis.set_yticks([])
    out = run_dir / PLOTS_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    path = out / "features_tsne.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path, {"source": len(features), "reference": 0 if reference is None else len(reference)}
