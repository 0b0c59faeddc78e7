"""The linear probe of finished runs' encoders, or of their untrained encoders (the floor a
self-supervised method must beat), at any labelled shares and number of probe seeds.

Rebuilds the run each finished run folder describes (its ``config.yaml``: same data, split, seed
and model) and scores either the global model of its checkpoint (its last round: the ``last``
selection) or the seeded initial model its training started from, with the linear probe
(``fedbed.federation.linear_probe``; the run's settings unless changed here) on each source
domain's id holdout and on the target domain. **On the target this reads target labels** (the
labelled share trains the probe): FedGaLA's evaluation protocol (``fedgala.md`` Sec. 4).

A sweep folder stands for its finished runs, labelled as ``fedbed report`` labels them (method
and variant). Prints, per run, encoder and labelled share, one line per domain, the target's
last: the mean ± std over the probe seeds (``repeats``); then the scale of each target's features
(median over dimensions of their standard deviation) and their effective rank (Roy and Vetterli
2007: exp of the entropy of the normalised squared singular values of the centred features; the
feature width if every direction carries equal variance); and last a markdown table with one row
per run and encoder: per labelled share, the id mean (the mean of the source domains' means) and
the target's mean ± std, then the target features' scale and effective rank.

    python benchmarks/linear_probe.py RUN_OR_SWEEP_DIR [RUN_OR_SWEEP_DIR ...]
        [--encoder trained untrained] [--labelled-fraction 0.1 0.3] [--repeats 5]
        [--standardize-features] [--data-root DATA]
    python benchmarks/linear_probe.py --smoke

``--smoke``: probes, with one probe seed, the trained and untrained encoders of a run it trains
first (:data:`SMOKE_RUN`: LeNet on the embedded MNIST sample, one round of two batches, scored by
a 2-epoch linear probe) in a temporary folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from _common import parse_arguments
from fedbed.config import ConfigError
from fedbed.experiment import ExperimentConfig, restore_run, run_experiment
from fedbed.results import query_runs
from fedbed.run_directory import CONFIG_NAME, SWEEP_RECORD
from fedbed.run_result import ResultsError

SMOKE_RUN = {"model": "lenet", "rounds": 1, "local_steps": 2, "batch_size": 16, "evaluation_protocol": "linear_probe",
             "linear_probe": {"epochs": 2}}
"""The run a smoke run trains, then probes (``ExperimentConfig`` settings; RotatedMNIST's embedded sample)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="*", metavar="RUN_OR_SWEEP_DIR",
                        help="finished run folders (their config.yaml and checkpoint.pt are read), or sweep folders "
                             "(their finished runs); at least one unless --smoke")
    parser.add_argument("--encoder", choices=("trained", "untrained"), nargs="+", default=["trained"],
                        help="the checkpoint's global model (last round), the seeded initial model, or both")
    parser.add_argument("--labelled-fraction", type=float, nargs="+", default=None,
                        help="shares of each domain whose labels train the probe (default: the run's; FedGaLA: 0.1 0.3)")
    parser.add_argument("--repeats", type=int, default=None, help="probe seeds (default: the run's)")
    parser.add_argument("--standardize-features", action="store_true",
                        help="z-score the features with the labelled share's statistics (LinearProbe.standardize_features)")
    parser.add_argument("--data-root", type=Path, default=None, help="the data root the runs read (default: $FEDBED_DATA)")
    arguments = parse_arguments(parser, smoke="a run it trains first (SMOKE_RUN)", encoder=["trained", "untrained"],
                                repeats=1, data_root=None)
    torch.set_num_threads(1)
    if arguments.smoke:
        with tempfile.TemporaryDirectory(prefix="fedbed-smoke-") as folder:
            run_experiment(ExperimentConfig(**SMOKE_RUN, run_dir=Path(folder)), progress=False, echo=lambda *_: None)
            probe_and_print(arguments, [Path(folder)])
    elif not arguments.folders:
        parser.error("give at least one RUN_OR_SWEEP_DIR, or --smoke")
    else:
        probe_and_print(arguments, arguments.folders)


def probe_and_print(arguments: argparse.Namespace, folders: list[Path]) -> None:
    """Probe the runs of ``folders`` as ``arguments`` say, printing per run and, last, the table."""
    try:
        runs = runs_to_probe(folders)
    except (ConfigError, ResultsError) as error:
        sys.exit(f"error: {error}")
    fractions = arguments.labelled_fraction or [None]
    table = []
    for run_dir, label in runs:
        try:
            table += probe_run(run_dir, label, arguments.encoder, fractions, arguments.repeats,
                               arguments.standardize_features, arguments.data_root)
        except ConfigError as error:
            sys.exit(f"error: {error}")
    shares = sorted({share for row in table for share in row["shares"]})
    print()
    print("| run | encoder | target | " + " | ".join(f"{share:.0%}: id mean / target" for share in shares)
          + " | target features: median std / effective rank |")
    print("|---|---|---|" + "---|" * (len(shares) + 1))
    for row in table:
        cells = [row["shares"].get(share, "–") for share in shares]
        print(f"| {row['label']} | {row['encoder']} | {row['target']} | " + " | ".join(cells) + f" | {row['features']} |")


def runs_to_probe(folders: list[Path]) -> list[tuple[Path, str]]:
    """``(run folder, label)`` of each folder: a run folder as it is (labelled by its method), a
    sweep folder (its ``sweep.yaml`` record) as its finished runs, labelled as the reports label them.

    Raises:
        ConfigError: a folder that is neither a run folder nor a sweep folder, or a sweep folder
            with no finished run.
        ResultsError: a sweep folder that holds no run at all.
    """
    runs = []
    for folder in folders:
        if (folder / SWEEP_RECORD).is_file():
            finished = [(folder / row["run"], row["label"]) for row in query_runs(folder, {"done": "1"})]
            if not finished:
                raise ConfigError(f"sweep folder {folder} holds no finished run yet; nothing to probe")
            runs += finished
        elif (folder / CONFIG_NAME).is_file():
            runs.append((folder, yaml.safe_load((folder / CONFIG_NAME).read_text())["algorithm"]))
        else:
            raise ConfigError(f"{folder} holds neither {CONFIG_NAME} nor {SWEEP_RECORD}; give a FedBed run or sweep folder")
    return runs


def probe_run(run_dir: Path, label: str, encoders: list[str], fractions: list[float | None], repeats: int | None,
              standardize: bool, data_root: Path | None) -> list[dict]:
    """Probe ``run_dir``'s encoders at each labelled share, printing per domain; one table row per
    encoder and target: ``label``, ``encoder``, ``target`` and ``shares`` (share -> its cell).

    Raises:
        ConfigError: a run that cannot be restored (:func:`fedbed.experiment.restore_run`) or that
            is not scored by the linear probe.
    """
    built, trained, _ = restore_run(run_dir, data_root)
    if built.probe is None:
        raise ConfigError(f"{run_dir} is not scored by the linear probe; nothing to compare")
    federation = built.federation(clients=None)
    names, classes, seed = built.dataset.domain_names, built.dataset.num_classes, built.config.seed
    rows = []
    for encoder in encoders:
        model = trained if encoder == "trained" else built.initial_model
        cells: dict[str, dict[float, str]] = {names[domain]: {} for domain in federation.target}
        for fraction in fractions:
            changes = {"labelled_fraction": fraction, "repeats": repeats, "standardize_features": standardize or None}
            probe = built.probe.model_copy(update={key: value for key, value in changes.items() if value is not None})
            print(f"{label}, {encoder} encoder of {run_dir}, linear probe: {probe.labelled_fraction:.0%} labelled, "
                  f"{probe.repeats} probe seed(s), {probe.epochs} epochs, "
                  f"{'standardized' if probe.standardize_features else 'raw'} features")
            id_means = []
            for domain, data in federation.holdout.items():
                scores = probe.scores(model, data, classes, seed, domain)
                id_means.append(statistics.mean(scores))
                print(f"id {names[domain]}: {statistics.mean(scores):.1f} ± {spread(scores):.1f}")
            for domain, data in federation.target.items():
                scores = probe.scores(model, data, classes, seed, domain)
                print(f"target (reads target labels) {names[domain]}: {statistics.mean(scores):.1f} ± {spread(scores):.1f}")
                cells[names[domain]][probe.labelled_fraction] = (
                    f"{statistics.mean(id_means):.1f} / {statistics.mean(scores):.1f} ± {spread(scores):.1f}")
        for domain, data in federation.target.items():
            features = data.outputs_of(model.featurizer)
            scale, rank = float(features.std(dim=0).median()), effective_rank(features)
            print(f"target {names[domain]} features: median per-dimension std {scale:.3g}, "
                  f"effective rank {rank:.1f} of {features.shape[1]}")
            rows.append({"label": label, "encoder": encoder, "target": names[domain], "shares": cells[names[domain]],
                         "features": f"{scale:.3g} / {rank:.1f}"})
    return rows


def spread(scores: list[float]) -> float:
    """The sample std of the probe seeds' scores (0 for one seed)."""
    return statistics.stdev(scores) if len(scores) > 1 else 0.0


def effective_rank(features: torch.Tensor) -> float:
    """Roy and Vetterli's effective rank of ``features`` ``[n, d]`` (centred): in [1, min(n, d)]."""
    squared = torch.linalg.svdvals(features - features.mean(dim=0)) ** 2
    shares = squared / squared.sum()
    return float(torch.exp(-(shares * shares.clamp_min(1e-12).log()).sum()))


if __name__ == "__main__":
    main()
