"""The ``fedbed`` command line (typer). Every command is a thin layer over the Python API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

# An unexpected error prints its traceback without every local variable (a round's records run to pages).
app = typer.Typer(add_completion=False, no_args_is_help=False, help="FedBed: federated domain generalization.",
                  pretty_exceptions_show_locals=False)
data_app = typer.Typer(add_completion=False, help="Prepare datasets.")
app.add_typer(data_app, name="data")
plot_app = typer.Typer(add_completion=False, help="Plot a run's telemetry.")
app.add_typer(plot_app, name="plot")

USAGE_ERROR = 2
INTERRUPTED = 130
"""Exit code after Ctrl-C, SIGTERM or SIGHUP (128 + SIGINT, the shell's convention)."""


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"fedbed {version('fedbed')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print FedBed's version and exit.")] = False,
) -> None:
    """FedBed: federated domain generalization."""


def fail(message: str) -> None:
    """Print one line to stderr and exit with code 2 (bad input), without a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


def on_terminal() -> bool:
    """Whether stderr is a terminal: progress bars are drawn there only, so a log piped to a file
    holds lines, not carriage-return fragments."""
    import sys

    return sys.stderr.isatty()


def parse_hp(pairs: list[str]) -> dict[str, Any]:
    """``["lr=0.1", "optimizer=sgd"]`` -> ``{"lr": 0.1, "optimizer": "sgd"}`` (values read as YAML scalars)."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--hp expects key=value, got {pair!r}")
        try:
            parsed[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed[key.strip()] = value
    return parsed


@app.command()
def run(
    dataset: Annotated[Optional[str], typer.Option(help="Dataset name (see `fedbed datasets`).")] = None,
    target: Annotated[Optional[str], typer.Option(help="Held-out target domain, or 'all' for one run per domain.")] = None,
    algorithm: Annotated[Optional[str], typer.Option(
        help="Registered algorithm (see `fedbed algorithms`), or CLIENT+SERVER: one method's clients under a server rule.")] = None,
    server: Annotated[Optional[str], typer.Option(
        help="A server rule for the algorithm's clients (e.g. --algorithm mcgdm --server fedomg: the run's algorithm "
             "is mcgdm+fedomg).")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="Model name, e.g. lenet (default: the dataset's own; an unknown name lists the choices).")] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Communication rounds.")] = None,
    local_epochs: Annotated[Optional[int], typer.Option(help="Local epochs per round.")] = None,
    local_steps: Annotated[Optional[int], typer.Option(help="Local batches per round (instead of epochs).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of everything random.")] = None,
    data_root: Annotated[Optional[Path], typer.Option(help="Dataset folder (default: $FEDBED_DATA).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML file of settings; flags override it.")] = None,
    hp: Annotated[Optional[list[str]], typer.Option(help="Algorithm hyperparameter key=value (repeatable).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Output folder of the run.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in its run directory from its checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier run with other settings in the run directory.")] = False,
    progress: Annotated[bool, typer.Option(help="Show the progress bar (on a terminal only).")] = True,
    backend: Annotated[str, typer.Option(help="Where clients run: in-process, flower-sim or flower-deployment.")] = "in-process",
    tls: Annotated[bool, typer.Option(help="flower-deployment: self-signed CA and certificates, TLS everywhere.")] = False,
    id_evaluation: Annotated[Optional[str], typer.Option(
        help="Where the id holdouts are scored: server, or clients (each site its own share; equal scores).")] = None,
    pretrained: Annotated[Optional[str], typer.Option(
        help="Pretrained backbone weights: imagenet (from the torch hub / timm cache; see README).")] = None,
    init_from: Annotated[Optional[Path], typer.Option(
        help="Start from the global model of this run folder's checkpoint (a warm start; same model and method family).")] = None,
    device: Annotated[Optional[str], typer.Option(
        help="Where to train and evaluate: auto (the first CUDA device, else the CPU), cpu, cuda, cuda:N or mps.")] = None,
    precision: Annotated[Optional[str], typer.Option(
        help="fp32, or bf16 / fp16 mixed precision of the clients' training (aggregation stays fp32).")] = None,
    deterministic: Annotated[Optional[bool], typer.Option(
        "--deterministic/--nondeterministic", help="torch's deterministic algorithms (README, Running on a GPU).")] = None,
    tracker: Annotated[Optional[str], typer.Option(
        help="Also log the run to an experiment tracker: tensorboard, mlflow or wandb (README, Experiment trackers).")] = None,
    tracker_uri: Annotated[Optional[str], typer.Option(
        help="MLflow's tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's own).")] = None,
) -> None:
    """Train one method across clients and evaluate it on the unseen target domain.

    With no arguments: FedAvg on RotatedMNIST (embedded MNIST sample unless a data root is
    set), target domain 0 degrees, LeNet, 15 rounds of 2 local epochs (under 90 s on 2 cores).
    """
    from fedbed.backends import TransportError, check_backend_options, check_before_running, run_on_backend
    from fedbed.config import ConfigError, load_config_file, override_settings, run_configs
    from fedbed.federation.engine import EngineError
    from fedbed.federation.evaluation import format_domain_table

    progress = progress and on_terminal()
    try:
        check_backend_options(backend, resume=resume, overwrite=overwrite, tls=tls)
        values = load_config_file(config) if config is not None else {}
        flags = {
            "dataset": dataset,
            "target": target,
            "algorithm": algorithm,
            "model": model,
            "rounds": rounds,
            "local_epochs": local_epochs,
            "local_steps": local_steps,
            "seed": seed,
            "data_root": data_root,
            "run_dir": run_dir,
            "id_evaluation": id_evaluation,
            "pretrained": pretrained,
            "init_from": init_from,
            "device": device,
            "precision": precision,
            "deterministic": deterministic,
            "tracker": tracker,
            "tracker_uri": tracker_uri,
        }
        values = override_settings(values, {k: v for k, v in flags.items() if v is not None})
        if server is not None:
            values["algorithm"] = f"{values.get('algorithm', 'fedavg')}+{server}"
        if hp:
            values["hp"] = {**values.get("hp", {}), **parse_hp(hp)}
        # Every target's run is checked (and validated, once) before the first starts.
        runs = [check_before_running(each, backend, resume=resume, check_folder=not overwrite)
                for each in run_configs(values)]
    except ConfigError as error:
        fail(str(error))
    for each in runs:
        try:
            summary = run_on_backend(each, backend, overwrite=overwrite, resume=resume, tls=tls, progress=progress,
                                     echo=typer.echo)
        except ConfigError as error:
            fail(str(error))
        except (EngineError, TransportError) as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(1)
        typer.echo(f"\n{summary['algorithm']} on {summary['dataset']}, target {summary['target']} (accuracy %):")
        typer.echo(format_domain_table(summary["selection"]))
        for key in ("note", "adaptation_note"):
            if key in summary["evaluation"]:
                typer.echo(f"evaluation: {summary['evaluation'][key]}")
        typer.echo(f"summary: {each.config.resolved_run_dir() / 'summary.json'}")


@app.command("flower-app")
def flower_app(
    folder: Annotated[Path, typer.Argument(help="Folder to write the Flower App into (created).")],
    config: Annotated[Path, typer.Option(help="YAML file of the run's settings (leave data_root out: each machine reads its own $FEDBED_DATA).")],
    round_timeout: Annotated[float, typer.Option(help="Seconds to wait for a round's replies before dropping silent sites.")] = 3600.0,
    discovery_timeout: Annotated[float, typer.Option(
        help="Seconds the ServerApp waits for every site to say its client id; then the run goes on without the missing ones.",
    )] = 600.0,
    site_key: Annotated[Optional[list[Path]], typer.Option(
        help="Each site's registered public key (site-K.pub), once per site in partition-id order: client K is then only "
             "the SuperNode signing with site K's key.",
    )] = None,
) -> None:
    """Write a Flower App for one run, to submit with `flwr run FOLDER FEDERATION` to a SuperLink
    whose SuperNodes run FedBed's ClientApp (the manual mode of "Running across machines")."""
    from fedbed.config import ConfigError, config_from_mapping, load_config_file, validate
    from fedbed.flower.deployment import write_app

    try:
        run = config_from_mapping(load_config_file(config))
        validated = validate(run)
    except ConfigError as error:
        fail(str(error))
    for option, seconds in (("--round-timeout", round_timeout), ("--discovery-timeout", discovery_timeout)):
        if seconds <= 0:
            fail(f"{option} must be positive, got {seconds}")
    try:
        write_app(folder, validated, round_timeout=round_timeout, discovery_timeout=discovery_timeout, site_keys=site_key)
    except ConfigError as error:
        fail(str(error))
    typer.echo(f"Flower App for {run.algorithm} on {run.dataset}, target {run.target}: {folder / 'pyproject.toml'}")
    typer.echo(f"submit it with: flwr run {folder} <federation> --stream")


@app.command("flower-clientapp")
def flower_clientapp(
    runtime_api_address: Annotated[str, typer.Option(
        help="HOST:PORT of the SuperNode's Runtime API (its --host and --port; the SuperNode started with --isolation process).",
    )],
) -> None:
    """Run FedBed's ClientApp for one SuperNode as one long-running process: it takes each of
    the SuperNode's messages and runs it here, so the site builds its data and model once per
    run (Flower's own flwr-clientapp starts a process per message). Stops when the SuperNode does."""
    from fedbed.flower.clientapp_process import serve
    from fedbed.flower.common import FlowerError

    try:
        serve(runtime_api_address, echo=typer.echo)
    except FlowerError as error:
        fail(str(error))
    except KeyboardInterrupt:
        typer.echo("flower-clientapp: stopped (Ctrl-C)", err=True)
        raise typer.Exit(130) from None


@app.command()
def datasets(
    paths: Annotated[Optional[list[str]], typer.Argument(
        help="Paths of your own datasets to list too (folder tree, packed .npz, or prepared folder).")] = None,
    data_root: Annotated[Optional[Path], typer.Option(help="Dataset folder (default: $FEDBED_DATA).")] = None,
) -> None:
    """List the datasets FedBed knows (and those at PATHS), their domains, and where each was found."""
    from fedbed.data import dataset_spec, known_datasets, resolve_data_root, with_found_domains
    from fedbed.data.base import DataError
    from fedbed.data.catalog import locate

    try:
        root = resolve_data_root(data_root)
        specs = list(known_datasets().values()) + [dataset_spec(path) for path in paths or []]
    except DataError as error:
        fail(str(error))
    typer.echo(f"data root: {root if root is not None else '(none: set --data-root or $FEDBED_DATA)'}")
    for spec in specs:
        where = locate(spec, root) or "not found"
        try:
            spec = with_found_domains(spec, root)  # Digits lists the domains found
        except DataError:
            pass
        typer.echo(f"{spec.name:15s} domains: {', '.join(spec.domain_names)}\n{'':15s} found: {where}")


@app.command()
def algorithms(
    name: Annotated[Optional[str], typer.Argument(help="One algorithm (default: all).")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="Show the values a run on this dataset uses (the paper's values for it replace the general defaults).")] = None,
) -> None:
    """List the registered algorithms with their hyperparameters (the values a run uses and where
    each comes from: the general default, or the paper's value for the dataset), the distributions
    a random hyperparameter search draws them from (for one NAME, with the source of each range),
    whether their server only averages (secure aggregation, robust aggregation and differential
    privacy apply), and where their defaults were measured to fail (a model that collapses to one
    class, and its results doc).
    NAME may be a composed CLIENT+SERVER method."""
    from fedbed.algorithms import ALGORITHMS, AlgorithmError, get_algorithm, resolve_hyperparameters
    from fedbed.data import DataError, dataset_spec

    try:
        chosen = [get_algorithm(name)] if name is not None else [cls() for _, cls in sorted(ALGORITHMS.items())]
        spec = dataset_spec(dataset) if dataset is not None else None
    except (AlgorithmError, DataError) as error:
        fail(str(error))
    def listed(values: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in values.items())

    for algorithm in chosen:
        server = ("averages: secure-aggregation compatible; robust_aggregation and differential_privacy apply"
                  if algorithm.secure_aggregation_compatible else
                  "needs each client's own update: not compatible with secure aggregation, robust_aggregation "
                  "or differential_privacy")
        role = (" (a server rule: CLIENT+" + algorithm.name + " trains another method's clients under it)"
                if algorithm.server_rule else "")
        typer.echo(f"{algorithm.name:10s} {algorithm.summary}\n{'':10s} server: {server}{role}")
        try:
            declared = algorithm.search_space()
            space = ", ".join(f"{key} ~ {distribution}" for key, distribution in declared.items())
        except AlgorithmError:
            declared, space = {}, "none declared (a sweep's hparams.search: random refuses it)"
        typer.echo(f"{'':10s} random search distributions: {space}")
        if name is not None:  # one method: where each range comes from
            for key, distribution in declared.items():
                typer.echo(f"{'':12s} {key}: {distribution.source}")
        for on, failure in algorithm.measured_failures.items():
            if spec is None or spec.name == on:
                typer.echo(f"{'':10s} measured failure on {on}: {failure}")
        if spec is None:
            defaults = ", ".join(f"{k}={f.default}" for k, f in algorithm.hyperparameters.model_fields.items())
            typer.echo(f"{'':10s} hyperparameters (general defaults): {defaults}")
            for on, values in algorithm.dataset_defaults.items():
                typer.echo(f"{'':10s} on {on} (its paper's values): {listed(values)}")
            for on, values in algorithm.dataset_run_settings.items():
                typer.echo(f"{'':10s} run settings on {on} (its paper's, where a run leaves them unset): {listed(values)}")
            continue
        resolved = resolve_hyperparameters(algorithm, {}, spec.name).model_dump()
        paper = algorithm.dataset_defaults.get(spec.name, {})
        cells = [f"{k}={v}" + (f" [paper's value on {spec.name}]" if k in paper else "") for k, v in resolved.items()]
        typer.echo(f"{'':10s} hyperparameters on {spec.name}: {', '.join(cells)}")
        run_settings = algorithm.dataset_run_settings.get(spec.name)
        if run_settings:
            typer.echo(f"{'':10s} run settings on {spec.name} (its paper's, where a run leaves them unset): "
                       f"{listed(run_settings)}")


@data_app.command("prepare")
def prepare(
    name: Annotated[str, typer.Argument(
        help="Image dataset in DomainBed's folder layout, e.g. PACS, Camelyon17, FMoW, PovertyMap (WILDS' layouts), "
             "the path of your folder <domain>/<class>/<image>, or hf:<hub name or folder> (a Hugging Face dataset).")],
    size: Annotated[int, typer.Option(help="Side in pixels after resizing.")] = 32,
    data_root: Annotated[Optional[Path], typer.Option(help="Folder holding <Name>/<domain>/<class>/<image>.")] = None,
    output_root: Annotated[Optional[Path], typer.Option(
        help="Where to write <name>/<name>_<size>.npz (and <name>_<size>.images.npy; default: the data root; for a "
             "path, the folder itself).")] = None,
    memory_mapped: Annotated[Optional[bool], typer.Option(
        "--memory-mapped/--compressed",
        help="The images uncompressed in <name>_<size>.images.npy, which runs memory-map, or one compressed .npz "
             "(default: memory-mapped from 128 px on).")] = None,
    image_column: Annotated[Optional[str], typer.Option(help="hf: datasets: the column of images (default: image).")] = None,
    label_column: Annotated[Optional[str], typer.Option(help="hf: datasets: the column of labels (default: label).")] = None,
    domain_column: Annotated[Optional[str], typer.Option(
        help="hf: datasets: the column naming each image's domain (default: domain).")] = None,
) -> None:
    """Decode and resize a DomainBed folder tree (Camelyon17, FMoW, PovertyMap: WILDS' layouts) once into the packed
    layout runs read: from 128 px on, <name>_<size>.npz with the images uncompressed beside it in
    <name>_<size>.images.npy, which runs memory-map, so a dataset larger than memory trains (the tree is decoded one
    image at a time); below, one compressed .npz. A Hugging Face dataset (hf:...) is packed where its runs read it, in
    the datasets library's cache (its runs pack it at their first use anyway)."""
    from fedbed.data import prepare_dataset, resolve_data_root
    from fedbed.data.base import DataError
    from fedbed.data.hugging_face import HuggingFaceColumns, is_hugging_face

    if size <= 0:
        fail(f"--size must be positive, got {size}")
    if not is_hugging_face(name) and any(column is not None for column in (image_column, label_column, domain_column)):
        fail(f"--image-column, --label-column and --domain-column apply to hf: datasets only, not to {name}")
    try:
        path = prepare_dataset(name, resolve_data_root(data_root), size, output_root, memory_mapped,
                               HuggingFaceColumns.from_settings(image_column, label_column, domain_column))
    except DataError as error:
        fail(str(error))
    typer.echo(f"wrote {path}")


def planned_line(row: dict[str, Any]) -> str:
    """One line of ``fedbed sweep --dry-run``: a row of :func:`fedbed.sweep.plan_sweep`."""
    partly = f" ({row['partly_run']} partly run)" if row["partly_run"] else ""
    remake = f", {row['remake']} to remake" if row["remake"] else ""
    if not row["pending"] and not row["remake"]:
        time_left = "nothing to run"
    elif row["pending_hours"] is None:
        time_left = "no finished job of it in the sweep to estimate from"
    else:
        speed = "" if row["seconds_per_round"] is None else f"; {row['seconds_per_round']:.1f} s a round"
        time_left = f"about {row['pending_hours']:.1f} h one job at a time{speed}"
    line = f"{row['algorithm']}: {row['jobs']} jobs, {row['finished']} finished, {row['pending']} pending{partly}{remake}: {time_left}"
    if row["remake_refused"]:
        refusal, count = row["remake_refused"]
        line += f"\n  {count} of the {row['remake']} to remake would be refused: {refusal}"
    return line


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="YAML sweep file (see docs/sweeps/).")],
    out: Annotated[Optional[Path], typer.Option(help="Sweep folder (default: runs/sweeps/<name>).")] = None,
    workers: Annotated[int, typer.Option(help="Parallel jobs; torch threads per job = cores // workers unless --threads.")] = 1,
    threads: Annotated[Optional[int], typer.Option(
        help="Torch threads per job (default cores // workers); 1 when another sweep process shares the cores.")] = None,
    data_root: Annotated[Optional[Path], typer.Option(help="Dataset folder (default: $FEDBED_DATA).")] = None,
    progress: Annotated[bool, typer.Option(help="Show the overall progress bar (on a terminal only).")] = True,
    only: Annotated[Optional[list[str]], typer.Option(
        help="KEY=VALUE with KEY algorithm, target or seed: run only the matching jobs (repeatable: any value of one "
             "key, every key given); the rest stay for a later run into the same folder.")] = None,
    remake_checkpoints: Annotated[bool, typer.Option(
        help="Re-run finished jobs without a checkpoint (records committed without it, e.g. the initial models of a "
             "warm-started sweep) and keep the checkpoint only if the re-run's rounds.jsonl equals the record.")] = False,
    dry_run: Annotated[bool, typer.Option(
        help="Run nothing, write nothing: per algorithm, the jobs finished, pending (partly run) and to remake, and "
             "their time one job at a time, from the seconds a round took in the sweep's finished jobs.")] = False,
) -> None:
    """Run a grid of algorithms x targets x seeds x hyperparameters; finished jobs are skipped."""
    from fedbed.config import ConfigError
    from fedbed.sweep import load_sweep_file, run_sweep

    progress = progress and on_terminal()
    cores = os.cpu_count() or 1
    if threads is not None and threads * workers > cores:
        typer.echo(f"warning: {workers} worker(s) x {threads} thread(s) exceed the {cores} cores; every job will run "
                   "slower than with fewer threads", err=True)
    selected: dict[str, list[str]] = {}
    for pair in only or []:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            fail(f"--only expects KEY=VALUE (e.g. --only seed=1), got {pair!r}")
        selected.setdefault(key, []).append(value)
    try:
        spec = load_sweep_file(sweep_file)
        folder = out or Path("runs") / "sweeps" / spec.name
        if dry_run:
            from fedbed.sweep import check_parallelism, plan_sweep

            check_parallelism(workers, threads)
            for row in plan_sweep(spec, folder, data_root, selected, remake_checkpoints):
                typer.echo(planned_line(row))
            return
        outcome = run_sweep(spec, folder, workers=workers, threads=threads, progress=progress, data_root=data_root,
                            only=selected, remake_checkpoints=remake_checkpoints)
    except ConfigError as error:
        fail(str(error))
    held = f"{len(outcome['held'])} running in another sweep process, " if outcome["held"] else ""
    left = f" ({outcome['left_out']} other job(s) of the sweep left for a later run: --only)" if outcome["left_out"] else ""
    remade = f"{outcome['remade']} checkpoint(s) remade, " if remake_checkpoints else ""
    typer.echo(f"{spec.name}: {outcome['total']} jobs{left}, {outcome['skipped']} already done, {outcome['ran']} run, "
               f"{remade}{held}{len(outcome['failed'])} failed; folder {folder}")
    for line in outcome["data"]:
        typer.echo(f"data: {line}")
    if outcome["other_code"]:
        typer.echo(f"note: other code than this made {len(outcome['other_code'])} finished job(s), e.g. "
                   f"{outcome['other_code'][0]} (see its provenance.jsonl); to redo them with this code, delete "
                   "their folders and run the sweep again", err=True)
    for run_dir, holder in outcome["held"].items():
        typer.echo(f"held: {run_dir}: claimed by {holder}", err=True)
    for run_dir, error in outcome["failed"].items():
        typer.echo(f"failed: {run_dir}: {error.splitlines()[0]}", err=True)
    if outcome["failed"]:
        raise typer.Exit(1)


@app.command()
def export(
    folder: Annotated[Path, typer.Argument(
        help="A finished run's folder, or a folder of runs (a sweep folder): every finished run below it.")],
    to: Annotated[str, typer.Option("--to", help="The tracker: tensorboard (into each run folder's tensorboard/), "
                                               "mlflow or wandb.")],
    tracker_uri: Annotated[Optional[str], typer.Option(
        help="MLflow's tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's own).")] = None,
) -> None:
    """Send finished runs' records (config.yaml, rounds.jsonl, summary.json, provenance, plots/) to an experiment
    tracker, as a run with `--tracker` sends them live."""
    from fedbed.results import finished_runs
    from fedbed.run_directory import SUMMARY_NAME
    from fedbed.tracking import TRACKERS, TrackingError, export_run, tracker_refusal

    if to not in TRACKERS:
        fail(f"unknown tracker {to!r}; choose one of {', '.join(TRACKERS)}")
    refusal = tracker_refusal(to, tracker_uri)
    if refusal is not None:
        fail(refusal)
    if not folder.is_dir():
        fail(f"{folder} is not a folder; give a run folder or a sweep folder")
    runs = [folder] if (folder / SUMMARY_NAME).is_file() else [run.path for run in finished_runs(folder)]
    if not runs:
        fail(f"{folder} holds no finished run ({SUMMARY_NAME} neither there nor below it)")
    for run_dir in runs:
        try:
            identity = export_run(run_dir, to, tracker_uri)
        except TrackingError as error:
            typer.echo(f"error: {run_dir}: {error}", err=True)
            raise typer.Exit(1)
        typer.echo(f"exported {run_dir}: {identity.name} (experiment {identity.experiment})")
    typer.echo(f"{len(runs)} run(s) exported to {to}")


@app.command()
def results(
    sweep_dir: Annotated[Path, typer.Argument(help="A sweep folder (or any folder of runs).")],
    where: Annotated[Optional[list[str]], typer.Option(help="Filter column=value (repeatable).")] = None,
) -> None:
    """Index the runs below a folder into results.sqlite and list them as a table."""
    from fedbed.federation.evaluation import format_score
    from fedbed.results import ResultsError, index_runs, query_runs

    filters = {}
    for pair in where or []:
        key, sep, value = pair.partition("=")
        if not sep:
            fail(f"--where expects column=value, got {pair!r}")
        filters[key] = value.lower() if key == "algorithm" else value  # registry names are lower case
    try:
        rows = query_runs(sweep_dir, filters)
        index_runs(sweep_dir)  # the store named below, for SQL users
    except ResultsError as error:
        fail(str(error))
    columns = ["label", "target", "seed", "done", "train_domain_val_round", "train_domain_val_id", "train_domain_val_ood", "run"]
    def shown(value: Any) -> str:  # no score (an unfinished run; no round scored): "–", as in reports
        return format_score(value) if value is None or isinstance(value, float) else str(value)

    table = [columns] + [[shown(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    typer.echo(f"{len(rows)} run(s); store: {sweep_dir / 'results.sqlite'}")
    from fedbed.reporting import collect_summaries, data_sources

    for line in data_sources(collect_summaries(sweep_dir))[0]:
        typer.echo(f"data: {line}")


@app.command()
def report(
    sweep_dirs: Annotated[list[Path], typer.Argument(
        help="One or more sweep folders; runs pair by label, target and seed across them (a job copied into "
             "several counts once).", show_default=False)],
    selection: Annotated[Optional[list[str]], typer.Option(
        help="Model selection: last, train_domain_val (default), oracle, or last_five_mean (mean of the last five "
             "evaluations); repeat for a column per rule; the first drives the t-tests, --select-hparams and plots.")
    ] = None,
    spread: Annotated[str, typer.Option(help="'std' (over seeds) or 'se' (standard error).")] = "std",
    baseline: Annotated[Optional[list[str]], typer.Option(
        help="Label to t-test every other label against (repeatable); an algorithm run under a sweep's "
             "variants is the baseline within each variant (feddg_ga[mix0] against fedavg[mix0]).")] = None,
    compare: Annotated[Optional[list[str]], typer.Option(
        help="'LABEL vs BASELINE': one more paired t-test (repeatable).")] = None,
    target: Annotated[Optional[list[str]], typer.Option(help="Show only this target (repeatable; columns in this order).")
                      ] = None,
    label: Annotated[Optional[list[str]], typer.Option(help="Show only this label (repeatable; rows in this order).")
                     ] = None,
    seed: Annotated[Optional[list[int]], typer.Option(
        help="Read only the runs of this seed (repeatable), e.g. the seeds a sweep run in parts has finished; "
             "tables, t-tests and --select-hparams see those runs only.")] = None,
    per_seed: Annotated[bool, typer.Option(help="A column per seed beside each mean over seeds.")] = False,
    format: Annotated[str, typer.Option(
        help="markdown, latex, or csv (tidy rows: label, algorithm, target, selection, metric, mean, std, se, n).")] = "markdown",
    output: Annotated[Optional[Path], typer.Option(help="Also write the tables to this file.")] = None,
    html: Annotated[Optional[Path], typer.Option(
        help="Write a self-contained HTML report (tables + plots) here; the plots go to the folder's plots/, or "
             "for several folders beside the page (<name>_plots/).")] = None,
    select_hparams: Annotated[bool, typer.Option(
        help="Per method and target, keep the hyperparameters (grid values or random-search trial) with the best "
             "mean id (source) validation over seeds, as DomainBed; a table names the chosen values.")] = False,
    keep_label: Annotated[Optional[list[str]], typer.Option(
        help="With --select-hparams: also keep this candidate label as a row of its own (repeatable), e.g. "
             "'fedavg(trial=0)', a random search's defaults, so that --compare 'fedavg vs fedavg(trial=0)' tests the "
             "tuned method against its defaults.")] = None,
    allow_mixed_data: Annotated[bool, typer.Option(help="Report runs that read different data together.")] = False,
    select_per_seed: Annotated[bool, typer.Option(
        help="With --select-hparams: choose for each seed on its own (DomainBed groups by trial seed).")] = False,
    by_round: Annotated[Optional[list[str]], typer.Option(
        help="ood, id, or a metric the rounds logged (e.g. train_loss): a table per target of it at every evaluated "
             "round, mean over seeds (repeatable).")] = None,
    differences: Annotated[bool, typer.Option(
        help="With --baseline or --compare: a table of each tested pair's ood difference (label - baseline) in every "
             "target and seed both ran, and how many are above and below zero.")] = False,
) -> None:
    """Tables of one or more sweep folders: labels x targets, mean ± std or ± SE over seeds, paired t-tests."""
    from fedbed.reporting import render_report, write_html_report

    try:
        built = report_from_options(sweep_dirs, selection, spread, baseline, compare, target, label, per_seed,
                                    select_hparams, allow_mixed_data, select_per_seed=select_per_seed, by_round=by_round,
                                    seed=seed, keep_label=keep_label, differences=differences)
        text = render_report(built, format)
    except ValueError as error:
        fail(str(error))
    typer.echo(text)
    if built.notes and format != "markdown":
        typer.echo("\n".join(built.notes), err=True)
    for warning in built.warnings:
        typer.echo(warning, err=True)
    if output is not None:
        output.write_text(text + "\n")
    if html is not None:
        from fedbed.plots import plot_sweep

        typer.echo(f"HTML report: {write_html_report(built, sweep_dirs, html, plot_sweep)}")


def report_from_options(sweep_dirs, selection, spread, baseline, compare, target, label, per_seed, select_hparams,
                        allow_mixed_data, select_per_seed=False, by_round=None, seed=None, keep_label=None,
                        differences=False, **_unused) -> Any:
    """The :class:`fedbed.reporting.Report` of ``fedbed report``'s options (by their parameter
    names; options that only say where to write are ignored).

    Raises:
        ValueError: as :func:`fedbed.reporting.build_report`.
    """
    from fedbed.reporting import build_report

    return build_report(sweep_dirs, selection or ["train_domain_val"], spread, baseline or (), compare or (),
                        select_hparams, target or (), label or (), per_seed, allow_mixed_data, select_per_seed,
                        by_round or (), seed or (), keep_label or (), differences)


def report_block_text(arguments: list[str]) -> str:
    """What ``fedbed report ARGUMENTS`` prints as Markdown, for a doc's generated block
    (:mod:`fedbed.doc_tables`): the arguments are parsed as the command line parses them.

    Raises:
        ValueError: arguments the command refuses, options that write elsewhere (``--html``,
            ``--output``) or another ``--format`` than Markdown, or the report's own errors.
    """
    import click
    import typer.main

    from fedbed.reporting import render_report

    command = typer.main.get_command(app).commands["report"]  # type: ignore[attr-defined]
    try:
        with command.make_context("fedbed report", list(arguments)) as context:
            options = dict(context.params)
    except click.ClickException as error:
        raise ValueError(error.format_message()) from None
    if options["html"] is not None or options["output"] is not None or options["format"] != "markdown":
        raise ValueError("a doc's block shows the Markdown tables only: drop --html, --output and --format")
    return render_report(report_from_options(**options), "markdown")


@app.command("update-docs")
def update_docs(
    docs: Annotated[list[Path], typer.Argument(help="Markdown files with generated blocks (e.g. docs/results/*.md).",
                                               show_default=False)],
    check: Annotated[bool, typer.Option(help="Write nothing; exit 1 if a block differs from what its command prints.")
                     ] = False,
) -> None:
    """Rewrite every block between `<!-- fedbed report ARGS -->` and `<!-- end fedbed report -->` with
    what `fedbed report ARGS` prints now, from the checkout's root (the folders are relative to it)."""
    from fedbed.doc_tables import DocTablesError, report_blocks, rewrite_blocks

    differing = 0
    for doc in docs:
        if not doc.is_file():
            fail(f"{doc} does not exist")
        text = doc.read_text()
        try:
            new, changed = rewrite_blocks(text, report_block_text)
        except DocTablesError as error:
            fail(f"{doc}: {error}")
        for block in changed:
            typer.echo(f"{doc}:{block.line}: {'differs' if check else 'rewritten'}: {block.command}")
        if changed and not check:
            doc.write_text(new)
        differing += len(changed)
        typer.echo(f"{doc}: {len(report_blocks(text))} generated block(s), {len(changed)} "
                   f"{'differ' if check else 'rewritten'}")
    if check and differing:
        raise typer.Exit(1)


@plot_app.command("alignment")
def plot_alignment_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holding rounds.jsonl).")],
) -> None:
    """Plot how client updates agree: cosine heatmaps per round, conflicts, norms and weights over rounds."""
    from fedbed.plots import PlotError, plot_alignment

    try:
        written = plot_alignment(run_dir)
    except PlotError as error:
        fail(str(error))
    typer.echo(f"wrote {len(written)} plots to {run_dir / 'plots'}")


@plot_app.command("features")
def plot_features_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holding config.yaml and checkpoint.pt).")],
    per_domain: Annotated[int, typer.Option(help="At most this many samples per source domain.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the subsample, the reference draws and t-SNE.")] = 0,
    data_root: Annotated[Optional[Path], typer.Option(help="Where the run's data is, if it moved.")] = None,
) -> None:
    """t-SNE of the source features (colour: class, marker: domain) and FedADG's reference features (its Fig. 3-4)."""
    from fedbed.plots import PlotError, plot_features

    try:
        path, counts = plot_features(run_dir, per_domain, seed, data_root)
    except PlotError as error:
        fail(str(error))
    typer.echo(f"wrote {path} ({counts['source']} source features, {counts['reference']} reference features)")


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP (``kill``, ``timeout``, a closed terminal, a job scheduler) stop
    FedBed as Ctrl-C does: a ``KeyboardInterrupt`` in the main thread, so every process FedBed
    started is stopped on the way out (a Flower deployment's process groups, a sweep's workers)
    and an in-process run keeps the checkpoint of its last complete round."""
    import signal

    def interrupt(signum, frame):  # noqa: ARG001  (signal handler signature)
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")

    for name in ("SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), interrupt)


def main() -> None:
    """Entry point of the ``fedbed`` script.

    A malformed command line (an unknown option, ``--rounds abc``) prints one line and exits
    with code 2, as every other bad input does, instead of click's usage box. SIGTERM and SIGHUP
    stop a run as Ctrl-C does (:func:`stop_on_signals`): exit code 130.
    """
    import click

    stop_on_signals()
    try:
        code = app(standalone_mode=False)  # returns the code of a typer.Exit instead of exiting
    except click.UsageError as error:
        hint = f"; see `{error.ctx.command_path} --help`" if error.ctx is not None else ""
        typer.echo(f"error: {error.format_message().rstrip('.')}{hint}", err=True)
        raise SystemExit(USAGE_ERROR) from None
    except click.exceptions.Abort:
        code = INTERRUPTED
    if code == INTERRUPTED:  # typer turns a KeyboardInterrupt into this exit code
        typer.echo("stopped: interrupted (a run keeps the checkpoint of its last complete round; --resume continues it)",
                   err=True)
        # A KeyboardInterrupt raised while a C extension ran code through PyRun_String (torch's
        # import does) leaves CPython's "unhandled KeyboardInterrupt" flag set even though it was
        # handled here, and CPython then ends the process by re-sending itself SIGINT (exit -2)
        # instead of exiting with 130. Blocked at exit (atexit runs before that SIGINT, and only
        # when the process ends: a caller of main() in the same process keeps its signals), the
        # SIGINT stays pending and 130 is the exit code.
        import atexit
        import signal

        atexit.register(signal.pthread_sigmask, signal.SIG_BLOCK, {signal.SIGINT})
    if isinstance(code, int) and code:
        raise SystemExit(code)
