"""Plots of a run's alignment telemetry (in the spirit of hFedF Fig. 5a and FedGaLA Fig. 2b)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedbed.federation.engine import LOG_NAME  # noqa: E402


class PlotError(ValueError):
    """Raised when a run directory has no log or no alignment telemetry to plot."""


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """The per-round records of ``run_dir/rounds.jsonl``.

    Raises:
        PlotError: if the log is missing or empty.
    """
    log = run_dir / LOG_NAME
    if not log.is_file():
        raise PlotError(f"{log} does not exist; give the directory of a FedBed run")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
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
    out = run_dir / "plots"
    (out / "cosine").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def heatmap(axis, record):
        alignment = record["alignment"]
        image = axis.imshow(alignment["cosine"], vmin=-1, vmax=1, cmap="RdBu")
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
        points = [(r["round"], r["alignment"]["update_norms"][r["alignment"]["clients"].index(client)])
                  for r in records if client in r["alignment"]["clients"]]
        axes[1].plot(*zip(*points), marker=".", label=f"client {client}")
        weights = [(r["round"], _aggregation_weights(r)[client]) for r in records if client in _aggregation_weights(r)]
        if weights:
            axes[2].plot(*zip(*weights), marker=".", label=f"client {client}")
    axes[1].set_ylabel("update norm ||Δθ||")
    axes[1].legend(fontsize="small", ncol=min(4, len(clients)))
    axes[2].set_ylabel("aggregation weight")
    if masked:
        axes[3].plot(*zip(*masked), marker="o")
        axes[3].set_ylabel("masked fraction")
    axes[-1].set_xlabel("round")
    path = out / "alignment_over_rounds.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    written.append(path)
    return written
