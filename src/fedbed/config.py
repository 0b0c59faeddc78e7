"""The settings of one run: their schema, defaults, reading from YAML and validation.

Every setting of ``fedbed run`` is a field of :class:`ExperimentConfig`; :func:`validate` checks
every name in it (dataset, target, algorithm, hyperparameters, model, data root) before anything
is loaded or written, once per run, and returns a :class:`ValidatedConfig` (the settings and
what it resolved): building the run (:func:`fedbed.build.build_run`), the backends and the
Flower apps take that and neither look the names up nor check them again. Settings sent to
another process travel with the marker that they were validated (:func:`settings_digest`),
and :func:`validated_settings` re-reads them there without validating them again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fedbed.algorithms import (
    Algorithm,
    AlgorithmError,
    Hyperparameters,
    get_algorithm,
    resolve_hyperparameters,
)
from fedbed.algorithms.base.search_space import HyperparameterTrial
from fedbed.algorithms.options.differential_privacy import DifferentialPrivacy
from fedbed.algorithms.options.robust_aggregation import (
    DEFAULT_BYZANTINE_CLIENTS,
    DEFAULT_TRIMMED_FRACTION,
    ROBUST_RULES,
    check_robust_aggregation,
)
from fedbed.data import DataError, dataset_spec, resolve_data_root, with_found_domains
from fedbed.data.augmentation import AUGMENTATIONS
from fedbed.data.catalog import DatasetSpec, known_datasets, spread_data_refusal
from fedbed.data.hugging_face import HuggingFaceColumns, hugging_face_display_name, is_hugging_face
from fedbed.data.path_datasets import display_name
from fedbed.federation.client_evaluation import ID_EVALUATION_SITES
from fedbed.federation.devices import PRECISIONS, device_refusal
from fedbed.federation.evaluation import EVALUATION_PROTOCOLS
from fedbed.federation.faults import FAULTS
from fedbed.federation.linear_probe import LinearProbe
from fedbed.federation.local_data import INPUT_SCALINGS
from fedbed.federation.sampling import clients_per_round
from fedbed.models import model_refusal
from fedbed.models.backbones import PRETRAINED_SOURCES
from fedbed.run_directory import CHECKPOINT_NAME
from fedbed.tracking import TRACKERS, tracker_refusal

PROTOCOLS = ("domain_generalization", "domain_adaptation")
"""What the target domain gives the run: nothing but its test samples, or also unlabelled images."""


class ConfigError(ValueError):
    """Raised for any invalid experiment setting; the message is one line saying what to change."""


def name_from_number(value: Any) -> Any:
    """A domain or class name that YAML read as a number, as its text: ``15`` -> ``"15"``
    (RotatedMNIST's domains are named by their angles, digit datasets' class folders by their
    digits); ``15.0`` -> ``"15"``; anything else (a string, a boolean, a list) unchanged, for
    the setting's own check to judge."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    return value


class ClientResources(BaseModel):
    """What Flower's simulation gives each client actor (Ray's ``client_resources``).

    Attributes:
        cpus: CPU cores per client actor (1).
        gpus: the share of a GPU per client actor (0; 0.25 packs four clients on one GPU); with
            ``device: auto`` or ``cuda`` a client with a share trains on the GPU Ray gives it.
    """

    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)


class ExperimentConfig(BaseModel):
    """Every setting of one run (leave-one-domain-out, one target domain).

    Attributes:
        dataset: a name from ``fedbed datasets`` (any case; stored in its canonical spelling),
            the path of the user's own data (:mod:`fedbed.data.path_datasets`; stored as given),
            or ``hf:<hub name or path>``, a Hugging Face dataset (:mod:`fedbed.data.hugging_face`).
        target: the held-out target domain's name (any case; a YAML number is read as its
            digits; stored in the dataset's spelling); unset: the dataset's natural default
            (RotatedMNIST: ``0``), and an error for a dataset without one.
        algorithm: a registered algorithm name (any case; stored as registered).
        rounds: communication rounds R (>= 1).
        local_epochs: local epochs per round (default 2, hFedF's Sec. 5.1).
        local_steps: local batches per round instead of epochs; giving both ``local_epochs``
            and ``local_steps`` is an error.
        batch_size: samples per local batch (hFedF Sec. 5.1 and DomainBed: 64).
        seed: drives splits, partitions, sampling, initialisation and batch order.
        data_root: dataset folder (else ``$FEDBED_DATA``, else the embedded MNIST sample).
        image_size: side in pixels for image datasets (default per dataset).
        channels: 1 or 3 to convert the images before the model is built for them
            (:meth:`fedbed.data.DomainDataset.with_channels`: grey repeated into RGB, RGB to grey
            by ITU-R 601-2 luma); unset: the data's own channels, and the model is built for them.
        domain_names: the federation's domains, in order, for data spread over machines: each
            machine's data root then needs to hold only its own part (a site its domain, the
            server the target) of a DomainBed folder tree or a packed file, and every machine
            numbers domains by this list (:meth:`fedbed.data.DomainDataset.conformed`); unset:
            the data's own (a dataset FedBed knows by name has fixed domains: repeat them).
        class_names: the federation's classes, in order, for data spread over machines (needed
            with ``domain_names`` for classification data: a site may lack a class); unset:
            the data's own (sorted class folder names).
        image_column: the column of images of an ``hf:`` dataset (unset: ``image``).
        label_column: its column of class labels (a ``ClassLabel``, strings or integers; floats:
            regression targets; unset: ``label``).
        domain_column: its column naming each sample's domain (a ``ClassLabel``, strings or
            integers; unset: ``domain``). The three apply to ``hf:`` datasets only.
        model: model name (default per dataset).
        pretrained_weights: local ImageNet state dict for ResNets and timm models.
        pretrained: ``imagenet``: ``resnet18``/``resnet50`` with torchvision's ImageNet weights, a
            ``timm:NAME`` model with timm's, read from their caches (:mod:`fedbed.models.backbones`);
            refused at validation when they are not cached, unless ``FEDBED_ALLOW_DOWNLOADS=1``
            (then downloaded when the model is built). Not with ``pretrained_weights``. Unset: none.
        init_from: a run folder (finished or not, on this machine) whose checkpoint's global model
            this run starts from instead of a fresh one: a warm start. Only the global model is
            read, never a client's state; the architectures must match. Part of the run's
            identity; recorded with the source's method and round in the summary, the provenance
            line and the reports' labels. Unset: a fresh model.
        init_from_arrays: ``all`` (unset): every array of the source's model, which must be this
            run's architecture exactly; ``matching``: the arrays this run's model shares with it by
            name, shape and dtype (a method with modules of its own, FedADG's generator, FedSR's
            variational encoder, starts them fresh: :func:`fedbed.build.matching_arrays`), the
            arrays left fresh recorded as ``kept_initial`` in the warm start's record.
        freeze_batchnorm: keep the featurizer's BatchNorm layers in evaluation mode in training
            (DomainBed's ``freeze_bn``: running statistics neither used nor updated); unset: off.
        classifier_dropout: dropout on the features before the classifier (DomainBed's
            ``resnet_dropout``); unset: none.
        device: where the clients train and the server evaluates: ``auto`` (unset: the first CUDA
            device, else the CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``
            (:mod:`fedbed.federation.devices`); payloads, replies, checkpoints and client state
            stay on the CPU. A placement setting: a run may resume on another device.
        precision: ``fp32`` (unset), or ``bf16`` / ``fp16`` mixed precision of the clients'
            forward passes and losses (``torch.autocast``; ``fp16`` with a gradient scaler);
            aggregation and evaluation stay in fp32. A method that cannot train in one says so
            at validation (``Algorithm.precisions``).
        client_resources: ``flower-sim`` only: CPUs and the share of a GPU each client actor gets
            (:class:`ClientResources`; unset: one CPU, no GPU). A placement setting.
        deterministic: torch's deterministic algorithms (and what CUDA needs for them), so a
            seed fixes a GPU run as it fixes a CPU run (README, "Running on a GPU").
        holdout_fraction: id-validation share of every source domain (DomainBed 0.2; hFedF 0.1).
        partition: ``domain`` (one client per source domain), ``domains_per_client`` (hFedF
            Algorithm 5), ``lambda_mix`` (FedDG_Benchmark) or ``dirichlet`` (the Dirichlet label
            split of the pooled source samples, :func:`fedbed.data.splits.partition_dirichlet`).
        num_clients: clients for ``domains_per_client`` / ``lambda_mix`` / ``dirichlet`` (default:
            number of sources).
        domains_per_client: d of hFedF's Algorithm 5.
        mix_lambda: λ of the λ-mix.
        dirichlet_alpha: α of ``partition: dirichlet`` (smaller: fewer classes per client); unset:
            0.5 (:data:`fedbed.data.splits.DEFAULT_DIRICHLET_ALPHA`). Applies to that partition only.
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
            (:mod:`fedbed.data.augmentation`: ``flip_crop``, ``randaugment``, ``simclr``, ``jigen``,
            ``amplitude_mix``), seeded per round, client and batch; unset: none. Refused for a
            method that draws its own views (MCGDM: its hyperparameter ``augmentation``).
        input_scaling: how pixels become model input
            (:func:`fedbed.federation.local_data.to_model_input`): ``imagenet`` (DomainBed's, the
            default: RGB normalised with the ImageNet mean and std, grey scaled to [0, 1]),
            ``unit`` ([0, 1]) or ``symmetric`` ([−1, 1]).
        mixstyle: insert MixStyle layers into the featurizer (Zhou et al. 2021; MCGDM's Baseline,
            :mod:`fedbed.models.mixstyle`); unset: none.
        evaluation_protocol: ``argmax`` (the model's own predictions) or ``linear_probe`` (a
            linear classifier on the frozen featurizer, trained on a seeded labelled share of each
            evaluated domain: on the target it reads target labels, and the summary says so);
            unset: the method's choice (:attr:`fedbed.algorithms.Algorithm.evaluation_protocol`).
        linear_probe: the probe's settings (:class:`fedbed.federation.linear_probe.LinearProbe`;
            unset: FedGaLA's, 10% labelled, 100 epochs, Adam 3e-3).
        protocol: ``domain_generalization`` (unset: the target stays out of training) or
            ``domain_adaptation``: the target is split with the run's seed into an unlabelled
            adaptation share that the server holds (without labels) and a disjoint test share on
            which ood accuracy is measured.
        adaptation_fraction: the adaptation share of the target under ``domain_adaptation``
            (unset: 0.5).
        target_adaptation: ``knowledge_vote`` adds a target model trained on pseudo-labels of the
            adaptation share to any averaging method (:mod:`fedbed.algorithms.options.knowledge_vote`);
            unset: the server does not use the target images.
        client_timeout: seconds a client's local training may take; a reply that took longer is
            dropped from the round as late (in-process the time is measured after the fit
            returns: a running fit cannot be pre-empted). Unset: no limit.
        update_norm_factor: a client update whose L2 norm is over this many times the round's
            median update norm is dropped (unset: 1000, ``fedbed.federation.engine.DEFAULT_UPDATE_NORM_FACTOR``;
            ``.inf`` turns the check off).
        robust_aggregation: ``median``, ``trimmed_mean``, ``krum`` or ``multi_krum`` in place of the
            weighted average, for methods that average (:mod:`fedbed.algorithms.options.robust_aggregation`,
            Flower's functions); unset: the method's average.
        trimmed_fraction: β of ``trimmed_mean``: the share of clients cut at each end (unset: 0.2).
        byzantine_clients: f, the number of Byzantine clients ``krum`` and ``multi_krum`` tolerate
            (unset: 1; needs at least 2f + 3 clients a round).
        differential_privacy: client-level DP for methods that average
            (:class:`fedbed.algorithms.options.differential_privacy.DifferentialPrivacy`: ``clipping``
            ``server`` or ``client``, ``clipping_norm``, ``noise_multiplier``, ``delta``); the
            (ε, δ) spent is logged per round and in the summary. Unset: none.
        attack: a test and evaluation harness, not a method: the first ``attacking_clients``
            clients misbehave as this says (:mod:`fedbed.federation.faults`: ``sign_flip_scale10``
            sends the honest update sign-flipped and x10; ``exception``, ``slow``,
            ``non_finite``, ``wrong_shape``, ``wrong_dtype``, ``missing_array``, ``norm_1e6``
            inject faults). Unset: every client is honest.
        attacking_clients: how many clients (ids 0, 1, ...) ``attack`` makes misbehave (unset: 1).
        tracker: ``tensorboard``, ``mlflow`` or ``wandb``: also send the run's settings, rounds,
            summary and plots to that experiment tracker as it runs (:mod:`fedbed.tracking`; each
            tool is an extra: ``pip install 'fedbed[mlflow]'``). Where the run's records also go,
            not what it computes: a placement setting. Unset: none.
        tracker_uri: MLflow's tracking URI (``tracker: mlflow`` only); unset: ``MLFLOW_TRACKING_URI``,
            else MLflow's default (``sqlite:///mlflow.db`` in the working directory).
        hparams_trial: which trial of a sweep's random hyperparameter search the run is
            (:class:`fedbed.algorithms.base.search_space.HyperparameterTrial`: ``search``, ``seed``,
            ``trial``, and ``draws: common`` for a trial of common draws), set by the sweep with the
            trial's values in ``hp``; a record of where they came from, part of the run's identity,
            in its summary and its reports' labels (``fedprox(trial=3)``, ``fedprox(trial=3,
            draws=common)``). Unset: not a search trial.
        hp: algorithm hyperparameters by name (validated by the algorithm).
        run_dir: output folder (default ``runs/<dataset>/<algorithm>/<target>/seed<seed>``).

    Settings left unset take the general defaults of the fields, except where the run's method
    gives its paper's run settings for the run's dataset
    (:attr:`fedbed.algorithms.Algorithm.dataset_run_settings`; e.g. MCGDM on PACS: 40 rounds of
    1 local epoch, batch 16, MixStyle); ``fedbed algorithms`` lists them.
    """

    model_config = ConfigDict(extra="forbid")

    dataset: str = "RotatedMNIST"
    target: str | None = None
    algorithm: str = "fedavg"
    rounds: int = Field(15, gt=0)
    local_epochs: int | None = Field(2, gt=0)
    local_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = Field(0, ge=0)
    data_root: Path | None = None
    image_size: int | None = Field(None, gt=0)
    channels: Literal[1, 3] | None = None
    domain_names: list[str] | None = Field(None, min_length=2)
    class_names: list[str] | None = Field(None, min_length=1)
    image_column: str | None = Field(None, min_length=1)
    label_column: str | None = Field(None, min_length=1)
    domain_column: str | None = Field(None, min_length=1)
    model: str | None = None
    pretrained_weights: Path | None = None
    init_from: Path | None = None
    init_from_arrays: Literal["all", "matching"] | None = None
    pretrained: Literal[PRETRAINED_SOURCES] | None = None
    freeze_batchnorm: bool | None = None
    classifier_dropout: float | None = Field(None, ge=0, lt=1)
    device: str | None = None
    precision: Literal[PRECISIONS] | None = None
    deterministic: bool | None = None
    client_resources: ClientResources | None = None
    holdout_fraction: float = Field(0.2, gt=0, lt=1)
    partition: Literal["domain", "domains_per_client", "lambda_mix", "dirichlet"] = "domain"
    num_clients: int | None = Field(None, gt=0)
    domains_per_client: int = Field(1, gt=0)
    mix_lambda: float = Field(0.0, ge=0, le=1)
    dirichlet_alpha: float | None = Field(None, gt=0, allow_inf_nan=False)
    participation_fraction: float = Field(1.0, gt=0, le=1)
    eval_every: int = Field(1, gt=0)
    few_shot_per_client: int = Field(0, ge=0)
    id_evaluation: Literal[ID_EVALUATION_SITES] = "server"
    augmentation: Literal[tuple(AUGMENTATIONS)] | None = None
    input_scaling: Literal[INPUT_SCALINGS] | None = None
    mixstyle: bool | None = None
    evaluation_protocol: Literal[EVALUATION_PROTOCOLS] | None = None
    linear_probe: LinearProbe | None = None
    protocol: Literal[PROTOCOLS] | None = None
    adaptation_fraction: float | None = Field(None, gt=0, lt=1)
    target_adaptation: Literal["knowledge_vote"] | None = None
    client_timeout: float | None = Field(None, gt=0)
    update_norm_factor: float | None = Field(None, gt=1)
    robust_aggregation: Literal[ROBUST_RULES] | None = None
    trimmed_fraction: float | None = Field(None, gt=0, lt=0.5)
    byzantine_clients: int | None = Field(None, gt=0)
    differential_privacy: DifferentialPrivacy | None = None
    attack: Literal[FAULTS] | None = None
    attacking_clients: int | None = Field(None, gt=0)
    tracker: Literal[TRACKERS] | None = None
    tracker_uri: str | None = None
    hparams_trial: HyperparameterTrial | None = None
    hp: dict[str, Any] = Field(default_factory=dict)
    run_dir: Path | None = None

    def __init__(self, **values: Any) -> None:
        """Validate the settings.

        Raises:
            ConfigError: one line naming the first bad or unknown setting (never pydantic's
                multi-line ``ValidationError``), whether the settings come from a file, flags or Python.
        """
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise ConfigError(one_line(error)) from None

    @field_validator("target", mode="before")
    @classmethod
    def _number_as_domain_name(cls, target: Any) -> Any:
        return name_from_number(target)

    @field_validator("domain_names", "class_names", mode="before")
    @classmethod
    def _list_from_json_text(cls, names: Any) -> Any:
        # Flower's run config holds no lists: a list setting travels as its JSON text.
        if isinstance(names, str) and names.startswith("["):
            names = json.loads(names)
        return [name_from_number(name) for name in names] if isinstance(names, list) else names

    @field_validator("domain_names", "class_names")
    @classmethod
    def _distinct_names(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"each name may appear once; repeated: {', '.join(repeated)}")
        return names

    def declared_names(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """``(domain names, class names)`` when the data is spread over machines (either
        setting given; an unset one is empty), else ``None``."""
        if self.domain_names is None and self.class_names is None:
            return None
        return tuple(self.domain_names or ()), tuple(self.class_names or ())

    @model_validator(mode="after")
    def _canonical_names(self) -> "ExperimentConfig":
        # Names typed in any case are stored as the catalog and the registry spell them, so the
        # run folder, config.yaml, summary.json and result filters agree. Unknown names stay as
        # typed: validate() reports them with the choices.
        try:
            spec = dataset_spec(self.dataset, tuple(self.domain_names) if self.domain_names else None,
                                hugging_face_columns(self))
        except DataError:
            return self
        if spec.path is None:
            self.dataset = spec.name
        if self.target is None:
            self.target = spec.default_target
        elif self.target.lower() != "all":
            self.target = spec.domain_named(self.target) or self.target
        try:
            self.algorithm = get_algorithm(self.algorithm).name
        except AlgorithmError:
            pass
        return self

    @model_validator(mode="after")
    def _paper_run_settings(self) -> "ExperimentConfig":
        # The method's paper's run settings on its datasets (Algorithm.dataset_run_settings) fill
        # the settings the run leaves unset; a run that gives either budget keeps its own. A switch
        # the run sets to null is stored as off (False): transports that drop nulls (Flower's run
        # config) would otherwise rebuild it as unset, and the paper's value would turn it on.
        try:
            algorithm = get_algorithm(self.algorithm)
        except AlgorithmError:
            return self
        if self.dataset not in known_datasets():
            return self
        given = self.model_fields_set
        for setting, value in algorithm.dataset_run_settings.get(self.dataset, {}).items():
            if setting in given:
                if getattr(self, setting) is None and isinstance(value, bool):
                    setattr(self, setting, False)
            elif not (setting in BUDGET_SETTINGS and given.intersection(BUDGET_SETTINGS)):
                setattr(self, setting, value)
        return self

    @model_validator(mode="after")
    def _one_budget(self) -> "ExperimentConfig":
        if self.local_steps is not None:
            if self.local_epochs is not None and "local_epochs" in self.model_fields_set:
                raise ValueError(f"give local_epochs or local_steps, not both (got local_epochs={self.local_epochs}, "
                                 f"local_steps={self.local_steps})")
            self.local_epochs = None
        if self.local_epochs is None and self.local_steps is None:
            raise ValueError("give local_epochs or local_steps")
        for setting in ("adaptation_fraction", "target_adaptation"):
            if getattr(self, setting) is not None and self.protocol != "domain_adaptation":
                raise ValueError(f"{setting} applies to protocol: domain_adaptation only")
        if self.protocol == "domain_adaptation" and self.few_shot_per_client:
            raise ValueError("few_shot_per_client (labelled target samples) and protocol: domain_adaptation exclude each other")
        return self

    @model_validator(mode="after")
    def _partition_settings(self) -> "ExperimentConfig":
        if self.dirichlet_alpha is not None and self.partition != "dirichlet":
            raise ValueError(f"dirichlet_alpha applies to partition: dirichlet only (this run's partition is "
                             f"{self.partition}); leave it out or set partition: dirichlet")
        return self

    @model_validator(mode="after")
    def _columns_of_hugging_face_data(self) -> "ExperimentConfig":
        given = [name for name in HUGGING_FACE_COLUMNS if getattr(self, name) is not None]
        if given and not is_hugging_face(self.dataset):
            raise ValueError(f"{', '.join(given)} applies to Hugging Face datasets (dataset: hf:<hub name or folder>) "
                             f"only, not to {self.dataset}; leave it out")
        return self

    @model_validator(mode="after")
    def _server_options(self) -> "ExperimentConfig":
        if self.trimmed_fraction is not None and self.robust_aggregation != "trimmed_mean":
            raise ValueError("trimmed_fraction applies to robust_aggregation: trimmed_mean only")
        if self.byzantine_clients is not None and self.robust_aggregation not in ("krum", "multi_krum"):
            raise ValueError("byzantine_clients applies to robust_aggregation: krum or multi_krum only")
        if self.attacking_clients is not None and self.attack is None:
            raise ValueError("attacking_clients applies with an attack only")
        if self.robust_aggregation is not None and self.differential_privacy is not None:
            raise ValueError("differential_privacy calibrates its noise to the mean of clipped updates; "
                             "it cannot be combined with robust_aggregation")
        if self.differential_privacy is not None and self.target_adaptation is not None:
            raise ValueError("target_adaptation: knowledge_vote reads each client's model on the server; "
                             "it cannot be combined with differential_privacy")
        return self

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return self.run_dir
        return Path("runs") / self.dataset_name() / self.algorithm / str(self.target) / f"seed{self.seed}"

    def dataset_path(self) -> str | None:
        """``dataset`` when it is a path (the user's own data), as given; ``None`` for a known name."""
        return None if self.dataset in known_datasets() else self.dataset

    def dataset_name(self) -> str:
        """The dataset's name: ``dataset`` itself for a known name, the folder or file stem for a
        path (:func:`fedbed.data.path_datasets.display_name`) or a Hugging Face dataset
        (:func:`fedbed.data.hugging_face.hugging_face_display_name`), without reading the data."""
        path = self.dataset_path()
        if path is None:
            return self.dataset
        return hugging_face_display_name(path) if is_hugging_face(path) else display_name(path)


HUGGING_FACE_COLUMNS = ("image_column", "label_column", "domain_column")
"""The settings naming the columns of a Hugging Face dataset (:class:`fedbed.data.hugging_face.HuggingFaceColumns`)."""


def hugging_face_columns(settings: ExperimentConfig | dict[str, Any]) -> HuggingFaceColumns:
    """The columns a run's settings (a config, or a mapping of settings such as a sweep's
    ``base``) read a Hugging Face dataset from, an unset one taking its default."""
    values = settings if isinstance(settings, dict) else {name: getattr(settings, name) for name in HUGGING_FACE_COLUMNS}
    return HuggingFaceColumns.from_settings(*(values.get(name) for name in HUGGING_FACE_COLUMNS))


BUDGET_SETTINGS = ("local_epochs", "local_steps")
"""The two ways to give the local budget; a change that names one replaces the other."""


def override_settings(settings: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``settings`` updated by ``changes`` (flags over a config file, a sweep variant over its
    base); ``changes`` that give one local budget drop the other from ``settings``, so a file's
    ``local_epochs`` does not conflict with a flag's ``local_steps``."""
    merged = dict(settings)
    for key, other in (BUDGET_SETTINGS, BUDGET_SETTINGS[::-1]):
        if changes.get(key) is not None and other not in changes:
            merged.pop(other, None)
    merged.update(changes)
    return merged


def one_line(error: ValidationError) -> str:
    """The first problem of an :class:`ExperimentConfig`'s validation, in one line."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        if len(first["loc"]) > 1:
            return f"unknown setting {key!r}"
        return f"unknown setting {key!r}; known settings: {', '.join(ExperimentConfig.model_fields)}"
    if first["type"] == "value_error" and not first["loc"]:  # a rule across settings: its message says it all
        return str(first["msg"]).removeprefix("Value error, ")
    return f"{key}: {first['msg']} (got {first.get('input')!r})"


def config_from_mapping(values: dict[str, Any]) -> ExperimentConfig:
    """Validate a mapping (YAML file, CLI flags) into an :class:`ExperimentConfig`.

    Raises:
        ConfigError: one line naming the first bad or unknown key.
    """
    return ExperimentConfig(**values)


def number_of_clients(config: ExperimentConfig, sources: int, pooled: bool) -> int:
    """How many clients the run's partition makes from ``sources`` source domains: 1 for a
    pooled method (Central), one per source domain for ``partition: domain``, else
    ``num_clients`` (unset: one per source domain)."""
    if pooled:
        return 1
    if config.partition == "domain":
        return sources
    return config.num_clients or sources


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


_ISSUED = object()
"""Held by every :class:`ValidatedConfig` made in this module: one is made by :func:`validate` (or
rebuilt by :func:`validated_settings` from settings :func:`validate` passed elsewhere), never by hand."""


@dataclass(frozen=True)
class ValidatedConfig:
    """Settings that passed :func:`validate`, with what it looked up: the run's settings
    (``config``), the dataset's spec, the method, its hyperparameters (its defaults, its paper's
    values for the dataset, then the config's), the data root and the evaluation protocol (the
    config's, else the method's).

    Made only by :func:`validate` (or :func:`validated_settings`, for settings validated in
    another process); :func:`fedbed.build.build_run`, :func:`fedbed.backends.run_on_backend` and
    the Flower apps take one and never validate again, so a run validates its settings once.

    Raises:
        TypeError: made otherwise than by this module.
    """

    config: ExperimentConfig
    dataset: DatasetSpec
    algorithm: Algorithm
    hparams: Hyperparameters
    data_root: Path | None
    evaluation_protocol: str = "argmax"
    _issuer: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._issuer is not _ISSUED:
            raise TypeError("a ValidatedConfig is made by fedbed.config.validate only")

    @property
    def digest(self) -> str:
        """The marker that these settings were validated (:func:`settings_digest` of ``config``),
        sent with them to another process (a Flower app) so that it does not validate them again."""
        return settings_digest(self.config)

    @property
    def num_clients(self) -> int:
        """The run's number of clients (:func:`number_of_clients` of the dataset's source
        domains), known without reading any data."""
        return number_of_clients(self.config, len(self.dataset.domain_names) - 1, self.algorithm.pooled)

    def with_run_dir(self, run_dir: Path) -> "ValidatedConfig":
        """The same validated run writing to ``run_dir`` (where a run writes is checked with its
        folder, :func:`fedbed.backends.check_before_running`, not by :func:`validate`)."""
        return replace(self, config=self.config.model_copy(update={"run_dir": run_dir}))

    def with_absolute_paths(self) -> "ValidatedConfig":
        """The same validated run with absolute paths (run directory, data root, pretrained
        weights): Flower's apps may run in another working directory. The paths name the same
        files, so nothing validated changes."""
        config = self.config
        updates: dict[str, Any] = {"run_dir": config.resolved_run_dir().resolve()}
        if config.data_root is not None:
            updates["data_root"] = config.data_root.resolve()
        if config.pretrained_weights is not None:
            updates["pretrained_weights"] = config.pretrained_weights.resolve()
        if config.init_from is not None:
            updates["init_from"] = config.init_from.resolve()
        return replace(self, config=config.model_copy(update=updates),
                       data_root=self.data_root.resolve() if self.data_root is not None else None)


def settings_digest(config: ExperimentConfig) -> str:
    """A SHA-256 of ``config``'s settings (canonical JSON): what :attr:`ValidatedConfig.digest`
    sends along with validated settings, and what :func:`validated_settings` compares. It marks
    settings as validated, it does not authenticate them: whoever submits a run chooses its
    settings anyway."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _dataset_of(config: ExperimentConfig) -> tuple[DatasetSpec, Path | None]:
    """The dataset's spec of ``config`` (narrowed to the domains under the data root) and the data root.

    Raises:
        DataError: a dataset or data root that cannot be found.
    """
    declared = config.declared_names()
    spec = dataset_spec(config.dataset, declared[0] or None if declared else None, hugging_face_columns(config))
    data_root = resolve_data_root(config.data_root)
    return with_found_domains(spec, data_root), data_root  # Digits: the domains under the data root


def _method_of(config: ExperimentConfig, spec: DatasetSpec) -> tuple[Algorithm, Hyperparameters]:
    """The method of ``config`` and its hyperparameters on ``spec``'s dataset.

    Raises:
        AlgorithmError: an unknown method or hyperparameter.
    """
    algorithm = get_algorithm(config.algorithm)
    # A paper's per-dataset values apply to the dataset it names, not to a folder that happens to share its name.
    return algorithm, resolve_hyperparameters(algorithm, config.hp, spec.name if spec.path is None else None)


def validate(config: ExperimentConfig) -> ValidatedConfig:
    """Check every name in ``config`` before anything is loaded or written: the one validation
    of a run (:class:`ValidatedConfig` carries the result to everything that builds or runs it).

    Returns:
        The validated settings and the names resolved, for building the run without looking
        them up or checking them again.

    Raises:
        ConfigError: unknown dataset, target domain, algorithm, hyperparameter or model, a
            data root that does not exist, or settings that do not fit together (among them
            data spread over machines that cannot be, :func:`check_spread_data`).
    """
    declared = config.declared_names()
    try:
        spec, data_root = _dataset_of(config)
        if config.target is None:
            raise ConfigError(f"{spec.name} has no default target domain; give one (--target or target:) of "
                              f"{', '.join(spec.domain_names)}")
        if config.target not in spec.domain_names:
            raise ConfigError(
                f"{spec.name} has no domain {config.target!r}; its domains are {', '.join(spec.domain_names)}"
            )
        algorithm, hparams = _method_of(config, spec)
    except (DataError, AlgorithmError) as error:
        raise ConfigError(str(error)) from None
    if declared is not None:
        check_spread_data(config, spec, algorithm)
    refusal = device_refusal(config.device)
    if refusal is not None:
        raise ConfigError(refusal)
    refusal = tracker_refusal(config.tracker, config.tracker_uri)
    if refusal is not None:
        raise ConfigError(refusal)
    if config.precision is not None and config.precision not in algorithm.precisions:
        raise ConfigError(f"{algorithm.name} trains in {' or '.join(algorithm.precisions)} only, not {config.precision}")
    if config.init_from_arrays is not None and config.init_from is None:
        raise ConfigError("init_from_arrays says which arrays a warm start reads; give init_from (a run folder) too, "
                          "or leave it out")
    if config.init_from is not None and not (config.init_from / CHECKPOINT_NAME).is_file():
        raise ConfigError(f"init_from: {config.init_from} holds no {CHECKPOINT_NAME} to start from (checkpoints are never "
                          "committed: give the folder of a run made on this machine, or run it again)")
    if config.pretrained is not None and config.pretrained_weights is not None:
        raise ConfigError("give pretrained (weights from the cache) or pretrained_weights (a local file), not both")
    refusal = model_refusal(config.model or spec.default_model, config.pretrained, bool(config.freeze_batchnorm))
    if refusal is not None:
        raise ConfigError(refusal)
    if config.augmentation is not None and algorithm.draws_its_own_views:
        raise ConfigError(f"{algorithm.name} draws its own augmented views (its hyperparameter 'augmentation'); "
                          f"remove the run's augmentation setting or set --hp augmentation={config.augmentation}")
    evaluation_protocol = config.evaluation_protocol or algorithm.evaluation_protocol
    if evaluation_protocol == "linear_probe" and config.id_evaluation == "clients":
        raise ConfigError("the linear_probe evaluation trains its probes on the server; use id_evaluation: server")
    if config.linear_probe is not None and evaluation_protocol != "linear_probe":
        raise ConfigError("linear_probe settings apply to evaluation_protocol: linear_probe only")
    check_server_options(config, algorithm, number_of_clients(config, len(spec.domain_names) - 1, algorithm.pooled))
    return ValidatedConfig(config, spec, algorithm, hparams, data_root, evaluation_protocol, _ISSUED)


def as_validated(config: ExperimentConfig | ValidatedConfig) -> ValidatedConfig:
    """``config`` itself when it is already validated, else :func:`validate` of it: for the
    entry points that accept either (the Python API), so that each run validates once.

    Raises:
        ConfigError: as :func:`validate`.
    """
    return config if isinstance(config, ValidatedConfig) else validate(config)


def validated_settings(config: ExperimentConfig, digest: str | None) -> ValidatedConfig:
    """Settings received from the process that validated them (a Flower ServerApp or ClientApp,
    possibly on another machine): when ``digest`` is their :func:`settings_digest` (they are the
    settings :func:`validate` passed there, unchanged), their names are looked up for building
    the run (dataset spec, this machine's data root, method, hyperparameters) and nothing is
    checked or refused again; otherwise (no digest: an app written by hand; another digest: a
    setting overridden after validation, ``flwr run --run-config``) they are validated here,
    their only validation.

    Raises:
        ConfigError: settings that fail :func:`validate`, or names this machine cannot look up
            (its data root missing, a dataset path not there).
    """
    if digest is None or digest != settings_digest(config):
        return validate(config)
    try:
        spec, data_root = _dataset_of(config)
        algorithm, hparams = _method_of(config, spec)
    except (DataError, AlgorithmError) as error:
        raise ConfigError(str(error)) from None
    return ValidatedConfig(config, spec, algorithm, hparams, data_root,
                           config.evaluation_protocol or algorithm.evaluation_protocol, _ISSUED)


def run_configs(values: dict[str, Any]) -> list[ExperimentConfig]:
    """The runs of one set of settings (a config file with flags over it): one, or with
    ``target: all`` one per domain of the dataset (those found under the data root for a
    dataset made of the domains present, :func:`fedbed.data.with_found_domains`).

    Raises:
        ConfigError: an invalid setting, a dataset that cannot be looked up for ``target: all``,
            or ``target: all`` with a ``run_dir`` (each target needs its own).
    """
    targets = [values.get("target")]
    if str(targets[0]).lower() == "all":
        try:
            spec = dataset_spec(values.get("dataset", "RotatedMNIST"), columns=hugging_face_columns(values))
            targets = list(with_found_domains(spec, resolve_data_root(values.get("data_root"))).domain_names)
        except DataError as error:
            raise ConfigError(str(error)) from None
        if "run_dir" in values:
            raise ConfigError("--target all writes one run directory per target; drop --run-dir")
    return [config_from_mapping({**values, "target": target}) for target in targets]


def check_spread_data(config: ExperimentConfig, spec: DatasetSpec, algorithm: Algorithm) -> None:
    """Check that a run can use data spread over machines (``domain_names`` / ``class_names``):
    each site then builds its client from its own domain alone, which the one-client-per-domain
    partition allows and the others (which cut or pool domains by their sizes) do not.

    Raises:
        ConfigError: a dataset built by its own reader (MNIST-based, Digits, WILDS' layouts,
            registered loaders: :func:`fedbed.data.catalog.spread_data_refusal`), a dataset known
            by name given other domain names than its own, or domain names missing for a path;
            another partition than ``domain``, a pooled method, or few-shot target samples
            (which sites would need the target for).
    """
    refusal = spread_data_refusal(spec)
    if refusal is not None:
        raise ConfigError(refusal)
    if spec.path is None and config.domain_names is not None and tuple(config.domain_names) != spec.domain_names:
        raise ConfigError(f"{spec.name}'s domains are {', '.join(spec.domain_names)}; give domain_names in that order "
                          "or leave it out")
    if spec.path is not None and config.domain_names is None:
        raise ConfigError("data spread over machines given as a path needs domain_names: the federation's domains in "
                          "order (no machine sees them all)")
    if config.partition != "domain" or algorithm.pooled:
        what = f"partition: {config.partition}" if config.partition != "domain" else f"{algorithm.name} (one client pooling every domain)"
        raise ConfigError(f"with data spread over machines each site holds its own domain, so each client is one domain; "
                          f"{what} needs every domain on one machine: leave domain_names and class_names out")
    if config.few_shot_per_client:
        raise ConfigError("few_shot_per_client gives sites target samples, which data spread over machines keeps on the "
                          "server; leave one of them out")


def check_server_options(config: ExperimentConfig, algorithm: Algorithm, clients: int) -> None:
    """Whether the run's robust aggregation, differential privacy and attack fit the method
    and its ``clients`` clients.

    Raises:
        ConfigError: robust aggregation or differential privacy on a method whose server needs
            each client's own update (:attr:`fedbed.algorithms.Algorithm.secure_aggregation_compatible`),
            a robust rule with too few clients a round
            (:func:`fedbed.algorithms.options.robust_aggregation.check_robust_aggregation`), or more
            attacking clients than clients.
    """
    option = "robust_aggregation" if config.robust_aggregation else "differential_privacy" if config.differential_privacy else None
    if option is not None and not algorithm.secure_aggregation_compatible:
        raise ConfigError(f"{algorithm.name}'s server needs each client's own update (it is not compatible with secure "
                          f"aggregation), so {option} does not apply to it; use a method that averages "
                          "(`fedbed algorithms` marks them)")
    if config.robust_aggregation is not None:
        try:
            check_robust_aggregation(config.robust_aggregation, clients_per_round(clients, config.participation_fraction),
                                     config.trimmed_fraction or DEFAULT_TRIMMED_FRACTION,
                                     config.byzantine_clients or DEFAULT_BYZANTINE_CLIENTS)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.attack is not None and (config.attacking_clients or 1) > clients:
        raise ConfigError(f"attacking_clients is {config.attacking_clients}, but the run has {clients} client(s)")


PLACEMENT_SETTINGS = frozenset({"data_root", "run_dir", "id_evaluation", "device", "client_resources", "tracker",
                                "tracker_uri"})
"""Settings that say where a run reads its data, writes its files (and, with ``tracker``, also sends
its records), scores its id holdouts and
computes (``device``), not what it computes (site-side and server-side id scores are the same sums,
:mod:`fedbed.federation.client_evaluation`; in another process with another thread count a
sample on a decision boundary may flip; another device changes the last bits likewise): left out of a sweep job's hash
(:func:`fedbed.sweep.config_hash`), and free to change when a run is resumed, so a run folder
or its data may move between machines."""

RESUMABLE_CHANGES = PLACEMENT_SETTINGS | {"rounds"}
"""Settings that may differ between a run and its resumption: :data:`PLACEMENT_SETTINGS`, and
the number of rounds (a finished run may be continued to a longer budget)."""


