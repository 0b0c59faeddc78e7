"""One experiment from configuration to summary: the Python API behind ``fedbed run``."""

from __future__ import annotations

import copy
import functools
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedbed.algorithms import AlgorithmContext, AlgorithmError, TrainingBudget, get_algorithm, resolve_hyperparameters
from fedbed.data import (
    DataError,
    add_few_shot_target_samples,
    dataset_spec,
    load_dataset,
    partition_domains_per_client,
    partition_lambda_mix,
    partition_one_client_per_domain,
    partition_pooled,
    resolve_data_root,
    split_leave_one_domain_out,
)
from fedbed.jsonlog import to_json
from fedbed.seeding import derive_seed
from fedbed.federation.client_evaluation import ID_EVALUATION_SITES, ClientEvaluator, holdout_shares
from fedbed.federation.engine import Federation, client_infos, run_rounds
from fedbed.federation.evaluation import SELECTION_RULES, select_round
from fedbed.data.augmentation import AUGMENTATIONS, Augmentation
from fedbed.federation.local_data import INPUT_SCALINGS, ClientData
from fedbed.federation.transport import ClientTransport, InProcessClients
from fedbed.models import MODELS, ModelError, build_model
from fedbed.provenance import read_starts, record_start

CONFIG_NAME = "config.yaml"
SUMMARY_NAME = "summary.json"


class ConfigError(ValueError):
    """Raised for any invalid experiment setting; the message is one line saying what to change."""


class ExperimentConfig(BaseModel):
    """Every setting of one run (leave-one-domain-out, one target domain).

    Attributes:
        dataset: a name from ``fedbed datasets``.
        target: the held-out target domain's name.
        algorithm: a registered algorithm name.
        rounds: communication rounds R (>= 1).
        local_epochs: local epochs per round (exclusive with ``local_steps``).
        local_steps: local batches per round instead of epochs.
        batch_size: samples per local batch (hFedF Sec. 5.1 and DomainBed: 64).
        seed: drives splits, partitions, sampling, initialisation and batch order.
        data_root: dataset folder (else ``$FEDBED_DATA``, else the embedded MNIST sample).
        image_size: side in pixels for image datasets (default per dataset).
        model: model name (default per dataset).
        pretrained_weights: local ImageNet state dict for ResNets.
        holdout_fraction: id-validation share of every source domain (DomainBed 0.2; hFedF 0.1).
        partition: ``domain`` (one client per source domain), ``domains_per_client`` (hFedF
            Algorithm 5) or ``lambda_mix`` (FedDG_Benchmark).
        num_clients: clients for ``domains_per_client`` / ``lambda_mix`` (default: number of sources).
        domains_per_client: d of hFedF's Algorithm 5.
        mix_lambda: λ of the λ-mix.
        participation_fraction: share of clients sampled each round.
        eval_every: evaluate every this many rounds (and after the last).
        few_shot_per_client: k target samples added to each client's training data (hFedF's
            few-shot protocol, Fig. 3); they are removed from the ood evaluation set. 0 (the
            default) keeps the target domain out of training entirely.
        id_evaluation: where the id-validation holdouts are scored: ``server`` (default) or
            ``clients`` (each client scores its share of its domains' holdouts and sends back sums,
            Flower's federated evaluation; the scores are equal, see
            :mod:`fedbed.federation.client_evaluation`). The ood score is always the server's.
        augmentation: a named augmentation applied to every training batch
            (:mod:`fedbed.data.augmentation`: ``flip_crop``, ``randaugment``, ``simclr``), seeded
            per round, client and batch; unset: none (a method may ask for its own views).
        input_scaling: how pixels become model input
            (:func:`fedbed.federation.local_data.to_model_input`): ``imagenet`` (DomainBed's, the
            default: RGB normalised with the ImageNet mean and std, grey scaled to [0, 1]),
            ``unit`` ([0, 1]) or ``symmetric`` ([−1, 1]).
        hp: algorithm hyperparameters by name (validated by the algorithm).
        run_dir: output folder (default ``runs/<dataset>/<algorithm>/<target>/seed<seed>``).
    """

    model_config = ConfigDict(extra="forbid")

    dataset: str = "RotatedMNIST"
    target: str = "0"
    algorithm: str = "fedavg"
    rounds: int = Field(15, gt=0)
    local_epochs: int | None = Field(1, gt=0)
    local_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = Field(0, ge=0)
    data_root: Path | None = None
    image_size: int | None = Field(None, gt=0)
    model: str | None = None
    pretrained_weights: Path | None = None
    holdout_fraction: float = Field(0.2, gt=0, lt=1)
    partition: Literal["domain", "domains_per_client", "lambda_mix"] = "domain"
    num_clients: int | None = Field(None, gt=0)
    domains_per_client: int = Field(1, gt=0)
    mix_lambda: float = Field(0.0, ge=0, le=1)
    participation_fraction: float = Field(1.0, gt=0, le=1)
    eval_every: int = Field(1, gt=0)
    few_shot_per_client: int = Field(0, ge=0)
    id_evaluation: Literal[ID_EVALUATION_SITES] = "server"
    augmentation: Literal[tuple(AUGMENTATIONS)] | None = None
    input_scaling: Literal[INPUT_SCALINGS] | None = None
    hp: dict[str, Any] = Field(default_factory=dict)
    run_dir: Path | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> "ExperimentConfig":
        if self.local_steps is not None:
            self.local_epochs = None
        if self.local_epochs is None and self.local_steps is None:
            raise ValueError("give local_epochs or local_steps")
        return self

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return self.run_dir
        return Path("runs") / self.dataset / self.algorithm / self.target / f"seed{self.seed}"


def config_from_mapping(values: dict[str, Any]) -> ExperimentConfig:
    """Validate a mapping (YAML file, CLI flags) into an :class:`ExperimentConfig`.

    Raises:
        ConfigError: one line naming the first bad or unknown key.
    """
    try:
        return ExperimentConfig(**values)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "config"
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"unknown setting {key!r}; known settings: {', '.join(ExperimentConfig.model_fields)}") from None
        raise ConfigError(f"{key}: {first['msg']} (got {first.get('input')!r})") from None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping.

    Raises:
        ConfigError: missing file, invalid YAML, or a top level that is not a mapping.
    """
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, got {type(values).__name__}")
    return values


def validate(config: ExperimentConfig) -> None:
    """Check every name in ``config`` before anything is loaded or written.

    Raises:
        ConfigError: unknown dataset, target domain, algorithm, hyperparameter or model.
    """
    try:
        spec = dataset_spec(config.dataset)
        if config.target not in spec.domain_names:
            raise ConfigError(
                f"{spec.name} has no domain {config.target!r}; its domains are {', '.join(spec.domain_names)}"
            )
        resolve_hyperparameters(get_algorithm(config.algorithm), config.hp, spec.name)
        resolve_data_root(config.data_root)
    except (DataError, AlgorithmError) as error:
        raise ConfigError(str(error)) from None
    if config.model is not None and config.model not in MODELS:
        raise ConfigError(f"unknown model {config.model!r}; choose one of {', '.join(MODELS)}")


def _partitions(config: ExperimentConfig, split, pooled: bool):
    if pooled:
        return partition_pooled(split)
    num_clients = config.num_clients or len(split.source_domains)
    if config.partition == "domains_per_client":
        return partition_domains_per_client(split, num_clients, config.domains_per_client, config.seed)
    if config.partition == "lambda_mix":
        return partition_lambda_mix(split, num_clients, config.mix_lambda, config.seed)
    return partition_one_client_per_domain(split)


PLACEMENT_SETTINGS = frozenset({"data_root", "run_dir", "id_evaluation"})
"""Settings that say where a run reads its data, writes its files and scores its id holdouts,
not what it computes (site-side and server-side id scores are the same sums,
:mod:`fedbed.federation.client_evaluation`; in another process with another thread count a
sample on a decision boundary may flip): left out of a sweep job's hash
(:func:`fedbed.sweep.config_hash`), and free to change when a run is resumed, so a run folder
or its data may move between machines."""

RESUMABLE_CHANGES = PLACEMENT_SETTINGS | {"rounds"}
"""Settings that may differ between a run and its resumption: :data:`PLACEMENT_SETTINGS`, and
the number of rounds (a finished run may be continued to a longer budget)."""


def prepare_run_dir(run_dir: Path, resolved: dict[str, Any], resume: bool, echo) -> None:
    """Check and create the run directory before anything is written into it.

    Without ``resume``, an earlier FedBed run in ``run_dir`` (a folder holding ``config.yaml``)
    is replaced; any other non-empty folder is refused. With ``resume``, the folder must hold a
    checkpoint of a run whose settings equal ``resolved`` except for :data:`RESUMABLE_CHANGES`.

    Raises:
        ConfigError: a non-empty folder that is not a run, or a resumption that cannot continue.
    """
    from fedbed.federation.engine import CHECKPOINT_NAME

    if resume:
        if not (run_dir / CHECKPOINT_NAME).exists():
            raise ConfigError(f"cannot resume: {run_dir / CHECKPOINT_NAME} does not exist; run without --resume")
        stored = yaml.safe_load((run_dir / CONFIG_NAME).read_text()) if (run_dir / CONFIG_NAME).exists() else {}
        changed = sorted(k for k in set(stored) | set(resolved) if k not in RESUMABLE_CHANGES and stored.get(k) != resolved.get(k))
        if changed:
            raise ConfigError(
                f"cannot resume {run_dir}: its settings differ in {', '.join(changed)}; only "
                f"{', '.join(sorted(RESUMABLE_CHANGES))} may change (or run without --resume)"
            )
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / CONFIG_NAME).exists():
            raise ConfigError(f"{run_dir} is not empty and holds no FedBed run; choose another --run-dir")
        echo(f"replacing the earlier run in {run_dir} (use --resume to continue it)")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


@dataclass
class BuiltRun:
    """One run's pieces, built from its :class:`ExperimentConfig` the same way on every machine
    (the seed fixes the split, the partitions and the initial model), so the server and each
    Flower site can build their own part.

    Attributes:
        config: the validated settings.
        algorithm: the registered method.
        hparams: its resolved hyperparameters.
        dataset: the loaded dataset.
        split: the leave-one-domain-out split (target vs sources, id holdouts).
        partitions: one per client: ``indices`` [n_k] into ``dataset`` and ``domains``.
        ood_indices: ``int64 [m]`` target samples for ood evaluation (few-shot samples removed).
        model_name: the model actually built.
        context: what the method's halves are created with.
        initial_model: the freshly initialised model (seeded), handed to the strategy.
    """

    config: ExperimentConfig
    algorithm: Any
    hparams: Any
    dataset: Any
    split: Any
    partitions: list[Any]
    ood_indices: torch.Tensor
    model_name: str
    context: AlgorithmContext
    initial_model: torch.nn.Module

    @property
    def input_scaling(self) -> str:
        """The run's input scaling (``imagenet`` unless the config says otherwise)."""
        return self.config.input_scaling or "imagenet"

    def data(self, indices: torch.Tensor) -> ClientData:
        """The dataset's samples at ``indices``, scaled as the run says."""
        return ClientData.from_dataset(self.dataset, indices, self.input_scaling)

    def client_data(self, client: int) -> ClientData:
        """Training data of one client (only its partition)."""
        return self.data(self.partitions[client].indices)

    @functools.cached_property
    def _holdout_shares(self) -> list[torch.Tensor]:
        return holdout_shares(self.split.holdout, [p.domains for p in self.partitions])

    def client_holdout(self, client: int) -> ClientData:
        """One client's share of its source domains' id-validation holdouts
        (:func:`fedbed.federation.client_evaluation.holdout_shares`, computed once per run)."""
        return self.data(self._holdout_shares[client])

    def evaluator(self) -> ClientEvaluator:
        """The client half of id evaluation on clients."""
        return ClientEvaluator(self.context.model_factory, self.dataset.task)

    def trainer(self):
        """A new instance of the method's client half."""
        return self.algorithm.create_trainer(self.hparams, self.context)

    def federation(self, clients: ClientTransport) -> Federation:
        """The server side: the strategy (initialised with the initial model and the clients'
        sizes and domains), the evaluation sets, and ``clients`` as the way to reach them.

        Raises:
            ConfigError: the strategy refuses the model or the clients (e.g. BatchNorm for a
                hypernetwork).
        """
        dataset, split = self.dataset, self.split
        federation = Federation(
            strategy=self.algorithm.create_strategy(self.hparams, self.context),
            clients=clients,
            holdout={d: self.data(idx) for d, idx in split.holdout.items()},
            target={
                d: self.data(self.ood_indices[dataset.domains[self.ood_indices] == d])
                for d in split.target_domains
            },
            domain_names=dataset.domain_names,
            task=dataset.task,
            id_evaluation=self.config.id_evaluation,
            client_domains=tuple(p.domains for p in self.partitions),
        )
        # The strategy may draw its own initial state (hFedF's hypernetwork): seeded here, so it
        # does not depend on what was built before it in this process (a Flower server builds no
        # client trainer, an in-process run does).
        torch.manual_seed(derive_seed(self.config.seed, 1))
        try:
            federation.strategy.initialize(copy.deepcopy(self.initial_model), client_infos(self.partitions))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return federation


def build_run(config: ExperimentConfig) -> BuiltRun:
    """Validate ``config``, load the data, split, partition and build the initial model.

    Raises:
        ConfigError: invalid settings, data that cannot be found or read, a model that does not fit.
    """
    validate(config)
    algorithm = get_algorithm(config.algorithm)
    spec = dataset_spec(config.dataset)
    hparams = resolve_hyperparameters(algorithm, config.hp, spec.name)
    try:
        dataset = load_dataset(spec.name, resolve_data_root(config.data_root), config.image_size)
        split = split_leave_one_domain_out(dataset, (config.target,), config.holdout_fraction, config.seed)
        partitions = _partitions(config, split, algorithm.pooled)
        ood_indices = split.target
        if config.few_shot_per_client:
            partitions, ood_indices = add_few_shot_target_samples(split, partitions, config.few_shot_per_client, config.seed)
        model_name = config.model or spec.default_model

        def model_factory():
            base = build_model(model_name, dataset.input_shape, dataset.num_classes, config.pretrained_weights)
            return algorithm.wrap_model(base, hparams)

        torch.manual_seed(derive_seed(config.seed, 0))
        initial_model = model_factory()
    except (DataError, ModelError) as error:
        raise ConfigError(str(error)) from None
    budget = TrainingBudget(config.batch_size, config.local_epochs, config.local_steps)
    augmentation = Augmentation(config.augmentation) if config.augmentation else None
    context = AlgorithmContext(model_factory=model_factory, budget=budget, seed=config.seed, task=dataset.task,
                               augmentation=augmentation)
    return BuiltRun(config, algorithm, hparams, dataset, split, partitions, ood_indices, model_name, context, initial_model)


def run_experiment(config: ExperimentConfig, *, resume: bool = False, progress: bool = True, echo=print) -> dict[str, Any]:
    """Train and evaluate one leave-one-domain-out run in this process; write its run directory;
    return the summary.

    The run directory holds ``config.yaml`` (resolved), ``rounds.jsonl`` (one line per round),
    ``checkpoint.pt`` (latest round), ``provenance.jsonl`` (the code that started and each time
    resumed it, :mod:`fedbed.provenance`) and ``summary.json`` (model selection by ``last``,
    ``train_domain_val`` and ``oracle``, the last labelled as such; ``provenance`` repeats the
    starts).

    Raises:
        ConfigError: invalid settings, data that cannot be found or read, a model that does not fit.
        fedbed.federation.engine.EngineError: a round in which every client failed.
    """
    built = build_run(config)
    clients = InProcessClients(built.trainer(), [built.client_data(k) for k in range(len(built.partitions))])
    if config.id_evaluation == "clients":
        clients.evaluator = built.evaluator()
        clients.holdouts = [built.client_holdout(k) for k in range(len(built.partitions))]
    return execute_run(built, built.federation(clients), resume=resume, progress=progress, echo=echo)


def execute_run(built: BuiltRun, federation: Federation, *, resume: bool = False, progress: bool = True, echo=print,
                backend: str = "in-process") -> dict[str, Any]:
    """Run the rounds of a built run over ``federation`` (whatever transport reaches its
    clients), write the run directory and return the summary (see :func:`run_experiment`).

    Raises:
        ConfigError: a run directory that cannot be used or resumed.
        fedbed.federation.engine.EngineError: a round in which every client failed.
    """
    config, dataset, partitions = built.config, built.dataset, built.partitions
    echo(f"data: {dataset.source}")
    run_dir = config.resolved_run_dir()
    resolved = {**config.model_dump(mode="json"), "model": built.model_name, "hp": built.hparams.model_dump(mode="json")}
    prepare_run_dir(run_dir, resolved, resume, echo)
    (run_dir / CONFIG_NAME).write_text(yaml.safe_dump(resolved, sort_keys=False))
    echo(
        f"{built.algorithm.name} on {dataset.name}, target {config.target}: {len(partitions)} client(s) "
        f"holding {[[dataset.domain_names[d] for d in p.domains] for p in partitions]}, run dir {run_dir}, backend {backend}"
    )
    starts: list[dict[str, Any]] = []

    def note_start(completed_rounds: int) -> None:
        # A resumption with no round left to run trains nothing: no new start is recorded.
        done = completed_rounds >= config.rounds
        starts.extend(read_starts(run_dir) if done else record_start(run_dir, completed_rounds))

    began = time.perf_counter()
    evaluations = run_rounds(
        federation,
        rounds=config.rounds,
        seed=config.seed,
        participation_fraction=config.participation_fraction,
        eval_every=config.eval_every,
        run_dir=run_dir,
        resume=resume,
        progress=progress,
        on_start=note_start,
    )
    summary = {
        "dataset": dataset.name,
        "data_source": dataset.source,
        "algorithm": built.algorithm.name,
        "hp": built.hparams.model_dump(mode="json"),
        "target": config.target,
        "seed": config.seed,
        "rounds": config.rounds,
        "backend": backend,
        "clients": [[dataset.domain_names[d] for d in p.domains] for p in partitions],
        "wall_seconds": time.perf_counter() - began,
        "selection": {rule: select_round(evaluations, rule) for rule in SELECTION_RULES},
        "provenance": starts,
        "note": "accuracies in percent; 'oracle' selects the round by target accuracy and is not a valid DG estimate",
    }
    (run_dir / SUMMARY_NAME).write_text(to_json(summary, indent=2))
    return summary
