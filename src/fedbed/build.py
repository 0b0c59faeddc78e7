"""A run built from its settings: data, split, partitions, initial model and the method's halves.

Built the same way on every machine (the seed fixes the split, the partitions and the initial
model), so the server and each Flower site can each build their own part of one run.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from fedbed.algorithms import AlgorithmContext, TrainingBudget
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy, ModelAggregation
from fedbed.algorithms.options.differential_privacy import FixedClippingPrivacy
from fedbed.algorithms.options.knowledge_vote import KnowledgeVoteAdaptation
from fedbed.algorithms.options.robust_aggregation import (
    DEFAULT_BYZANTINE_CLIENTS,
    DEFAULT_TRIMMED_FRACTION,
    RobustAggregation,
)
from fedbed.config import (
    ConfigError,
    ExperimentConfig,
    ValidatedConfig,
    as_validated,
    hugging_face_columns,
    number_of_clients,
)
from fedbed.data import (
    DataError,
    add_few_shot_target_samples,
    load_dataset,
    partition_dirichlet,
    partition_domains_per_client,
    partition_lambda_mix,
    partition_one_client_per_domain,
    partition_pooled,
    split_leave_one_domain_out,
    split_target_for_adaptation,
)
from fedbed.data.augmentation import Augmentation
from fedbed.data.base import DatasetSpec
from fedbed.data.splits import DEFAULT_DIRICHLET_ALPHA
from fedbed.federation.checkpoints import EngineError, saved_global_model
from fedbed.federation.client_evaluation import ClientEvaluator, holdout_shares
from fedbed.federation.devices import DeviceError, resolve_device, set_deterministic
from fedbed.federation import phase_timings
from fedbed.federation.engine import (
    DEFAULT_UPDATE_NORM_FACTOR,
    Federation,
    client_infos,
)
from fedbed.federation.faults import FaultyClientTrainer
from fedbed.federation.linear_probe import LinearProbe
from fedbed.federation.local_data import ClientData
from fedbed.federation.sampling import clients_per_round
from fedbed.federation.transport import ClientTransport
from fedbed.models import FIXED_INPUT_SIZES, ModelError, build_model
from fedbed.run_directory import CHECKPOINT_NAME, CONFIG_NAME
from fedbed.seeding import derive_seed


def _partitions(config: ExperimentConfig, split, pooled: bool, labels: torch.Tensor):
    if pooled:
        return partition_pooled(split)
    num_clients = number_of_clients(config, len(split.source_domains), pooled)
    if config.partition == "domains_per_client":
        return partition_domains_per_client(split, num_clients, config.domains_per_client, config.seed)
    if config.partition == "lambda_mix":
        return partition_lambda_mix(split, num_clients, config.mix_lambda, config.seed)
    if config.partition == "dirichlet":
        return partition_dirichlet(split, labels, num_clients, config.dirichlet_alpha or DEFAULT_DIRICHLET_ALPHA,
                                   config.seed)
    return partition_one_client_per_domain(split)


def matching_arrays(source: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The arrays of a warm start under ``init_from_arrays: matching``: each array of this run's
    model (``own``) that the source model has under the same name, or, for a method that wraps the
    featurizer's network as ``featurizer.backbone`` (FedSR's encoder), under the name without
    ``backbone.``; with the same shape and dtype.

    Returns:
        ``(loaded, kept)``: the source's arrays by this run's names, and the names of this run's
        arrays left at their initial values (a method's own modules: FedADG's generator and
        discriminator, FedSR's variational head and classifier on its features).
    """
    loaded: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, mine in own.items():
        theirs = source.get(name)
        if theirs is None and name.startswith("featurizer.backbone."):
            theirs = source.get("featurizer." + name.removeprefix("featurizer.backbone."))
        if theirs is not None and theirs.shape == mine.shape and theirs.dtype == mine.dtype:
            loaded[name] = theirs
        else:
            kept.append(name)
    return loaded, sorted(kept)


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
        partitions: one per client: ``indices`` [n_k] into ``dataset`` (``None`` for a client
            whose domain this machine does not hold: data spread over machines) and ``domains``.
        ood_indices: ``int64 [m]`` target samples for ood evaluation (few-shot samples and the
            domain-adaptation share removed).
        adaptation_indices: ``int64 [a]`` the target's unlabelled adaptation share under
            ``protocol: domain_adaptation`` (empty otherwise).
        evaluation_protocol: ``argmax`` or ``linear_probe`` (the config's, else the method's).
        model_name: the model actually built.
        context: what the method's halves are created with.
        initial_model: the freshly initialised model (seeded), handed to the strategy (with
            ``init_from``, loaded with :attr:`warm_start`'s arrays first).
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
    adaptation_indices: torch.Tensor
    evaluation_protocol: str

    @functools.cached_property
    def warm_start(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """With ``init_from``: the source run's global model (a state dict fitting this run's
        model) and what the records say of it: ``{"run": folder, "algorithm": its method,
        "round": the round it was saved after, "model_digest": SHA-256 of its arrays}``. Read
        on the server only (the strategy starts from it; clients receive it as the round-1
        payload). ``None`` without ``init_from``.

        Raises:
            ConfigError: an unreadable checkpoint, a method that keeps no global model, or a
                model whose arrays differ from this run's (names, shapes or dtypes): one line.
        """
        source = self.config.init_from
        if source is None:
            return None
        try:
            state, round_number = saved_global_model(source / CHECKPOINT_NAME)
        except EngineError as error:
            raise ConfigError(f"init_from: {error}") from None
        own = self.initial_model.state_dict()
        kept: list[str] = []
        if self.config.init_from_arrays == "matching":
            loaded, kept = matching_arrays(state, own)
            if not any(name.startswith("featurizer.") for name in loaded):
                raise ConfigError(f"init_from: {source}'s model shares no featurizer array with this run's "
                                  f"{self.model_name}: start from a run of the same model")
            start = {**own, **loaded}
        else:
            for name in sorted(set(own) | set(state)):
                theirs, mine = state.get(name), own.get(name)
                if theirs is None or mine is None or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                    raise ConfigError(f"init_from: {source}'s model does not fit this run's {self.model_name} (array "
                                      f"{name}: {_described(theirs)} there, {_described(mine)} here): start from a run "
                                      "of the same model and method, or set init_from_arrays: matching")
            start = state
        settings = yaml.safe_load((source / CONFIG_NAME).read_text()) if (source / CONFIG_NAME).is_file() else {}
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode())
            digest.update(state[name].detach().contiguous().numpy().tobytes())  # loaded on the host
        return start, {"run": str(source), "algorithm": settings.get("algorithm"), "round": round_number,
                       "model_digest": digest.hexdigest()[:16], **({"kept_initial": kept} if kept else {})}

    @property
    def probe(self) -> LinearProbe | None:
        """The linear probe's settings under the ``linear_probe`` protocol, else ``None``."""
        if self.evaluation_protocol != "linear_probe":
            return None
        return self.config.linear_probe or LinearProbe()

    def evaluation_statement(self) -> dict[str, Any]:
        """What the evaluation read, for the summary and every report: the protocol, whether
        target labels train anything (the linear probe's labelled share of the target), and under
        domain adaptation how the target was shared."""
        probe = self.probe
        statement: dict[str, Any] = {
            "protocol": self.evaluation_protocol,
            "data_access": self.config.protocol or "domain_generalization",
            "target_labels_read_by_evaluation": probe is not None,
        }
        if probe is not None:
            statement["linear_probe"] = probe.model_dump()
            statement["note"] = (f"linear probe: a linear classifier on the frozen featurizer is trained on a seeded "
                                 f"{probe.labelled_fraction:.0%} of each evaluated domain's samples with their labels "
                                 f"(on the target, target labels) and tested on the rest")
        if self.config.protocol == "domain_adaptation":
            statement["adaptation_samples"] = int(len(self.adaptation_indices))
            statement["target_test_samples"] = int(len(self.ood_indices))
            statement["adaptation_note"] = ("the server holds the adaptation share's images without labels; "
                                            "ood accuracy is measured on the disjoint test share")
        return statement

    @property
    def input_scaling(self) -> str:
        """The run's input scaling (``imagenet`` unless the config says otherwise)."""
        return self.config.input_scaling or "imagenet"

    def data(self, indices: torch.Tensor, holdout: ClientData | None = None) -> ClientData:
        """The dataset's samples at ``indices``, scaled as the run says (``holdout``: as
        :meth:`ClientData.from_dataset`)."""
        return ClientData.from_dataset(self.dataset, indices, self.input_scaling, holdout=holdout)

    @functools.cached_property
    def _present_domains(self) -> frozenset[int]:
        # Looked up once per run: a client's data is checked against it, and scanning the
        # dataset's domain ids for each of a thousand clients costs seconds (and, between the
        # clients' allocations, fragments the heap by hundreds of MiB).
        return frozenset(self.dataset.present_domains())

    def missing_domains(self, domains: tuple[int, ...]) -> list[str]:
        """The names of ``domains`` that this machine's data does not hold (data spread over
        machines, :meth:`fedbed.data.DomainDataset.conformed`); empty when it holds them all."""
        return [self.dataset.domain_names[d] for d in domains if d not in self._present_domains]

    def require_domains(self, domains: tuple[int, ...], what: str) -> None:
        """Check that this machine holds samples of every one of ``domains`` (ids).

        Raises:
            ConfigError: naming the missing domains and ``what`` needs them (data spread over machines).
        """
        missing = self.missing_domains(domains)
        if missing:
            raise ConfigError(f"this machine's data holds no sample of {', '.join(missing)}, which {what} needs; give it a "
                              f"data root holding {'that domain' if len(missing) == 1 else 'those domains'}")

    def require_every_domain(self) -> None:
        """Check that this machine holds every domain, as a run on one machine needs.

        Raises:
            ConfigError: a domain missing (data spread over machines is for Flower deployments).
        """
        self.require_domains(tuple(range(len(self.dataset.domain_names))), "a run on one machine (every client and the server)")

    def client_data(self, client: int) -> ClientData:
        """Training data of one client (only its partition), with its share of the id holdouts
        beside it as ``holdout`` (:class:`~fedbed.federation.local_data.ClientData`: views of the
        images, the labels copied).

        Raises:
            ConfigError: this machine does not hold the client's domain (data spread over machines).
        """
        self.require_domains(self.partitions[client].domains, f"client {client}")
        with phase_timings.timed("data", "client", client=client, what="client data"):
            return self.data(self.partitions[client].indices, holdout=self.data(self._holdout_shares[client]))

    @functools.cached_property
    def _holdout_shares(self) -> list[torch.Tensor]:
        return holdout_shares(self.split.holdout, [p.domains for p in self.partitions])

    def client_holdout(self, client: int) -> ClientData:
        """One client's share of its source domains' id-validation holdouts
        (:func:`fedbed.federation.client_evaluation.holdout_shares`, computed once per run).

        Raises:
            ConfigError: this machine does not hold the client's domain (data spread over machines).
        """
        self.require_domains(self.partitions[client].domains, f"client {client}'s id evaluation")
        with phase_timings.timed("data", "client", client=client, what="client holdout"):
            return self.data(self._holdout_shares[client])

    def evaluator(self) -> ClientEvaluator:
        """The client half of id evaluation on clients."""
        return ClientEvaluator(self.context.model_factory, self.dataset.task, self.context.device)

    def trainer(self):
        """A new instance of the method's client half; under the ``attack`` harness, wrapped so
        that the first ``attacking_clients`` clients misbehave (:mod:`fedbed.federation.faults`)."""
        with phase_timings.timed("model", "client", what="trainer"):
            trainer = self.algorithm.create_trainer(self.hparams, self.context)
        if self.config.attack is None:
            return trainer
        return FaultyClientTrainer(trainer, self.config.attack, set(range(self.config.attacking_clients or 1)))

    @property
    def sample_rate(self) -> float:
        """The share of clients selected each round (:func:`fedbed.federation.sampling.clients_per_round` / clients)."""
        return clients_per_round(len(self.partitions), self.config.participation_fraction) / len(self.partitions)

    def model_aggregation(self) -> ModelAggregation | None:
        """The run's server option in place of the method's average: robust aggregation,
        differential privacy, or ``None`` (the method's own)."""
        config = self.config
        if config.robust_aggregation is not None:
            return RobustAggregation(config.robust_aggregation, config.trimmed_fraction or DEFAULT_TRIMMED_FRACTION,
                                     config.byzantine_clients or DEFAULT_BYZANTINE_CLIENTS)
        if config.differential_privacy is not None:
            return FixedClippingPrivacy(config.differential_privacy, self.sample_rate)
        return None

    def federation(self, clients: ClientTransport) -> Federation:
        """The server side: the strategy (initialised with the initial model and the clients'
        sizes and domains), the evaluation sets, and ``clients`` as the way to reach them.

        Raises:
            ConfigError: the strategy refuses the model or the clients (e.g. BatchNorm for a
                hypernetwork).
        """
        dataset, split = self.dataset, self.split
        self.require_domains(split.target_domains, "the server (it scores the target domain)")
        if self.config.id_evaluation == "server":
            self.require_domains(split.source_domains, "the server's id evaluation (with the data spread over the sites, "
                                                "score the id holdouts there: id_evaluation: clients)")
        strategy = self.algorithm.create_strategy(self.hparams, self.context)
        aggregation = self.model_aggregation()
        if aggregation is not None:
            # validate() admits these options only for methods that average (FedAvgStrategy's seam).
            assert isinstance(strategy, FedAvgStrategy), type(strategy).__name__
            strategy.aggregation = aggregation
        if self.config.target_adaptation == "knowledge_vote":
            strategy = KnowledgeVoteAdaptation(strategy, self.context.model_factory, self.hparams, self.context.budget,
                                               self.config.seed, device=self.context.device)
        federation = Federation(
            strategy=strategy,
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
            probe=self.probe,
            num_classes=dataset.num_classes,
            seed=self.config.seed,
            adaptation_target=self.data(self.adaptation_indices).without_labels() if len(self.adaptation_indices) else None,
            adaptation_labels_for_the_log=dataset.labels[self.adaptation_indices] if len(self.adaptation_indices) else None,
            client_timeout=self.config.client_timeout,
            update_norm_factor=self.config.update_norm_factor or DEFAULT_UPDATE_NORM_FACTOR,
            device=self.context.device,
        )
        # The strategy may draw its own initial state (hFedF's hypernetwork): seeded here, so it
        # does not depend on what was built before it in this process (a Flower server builds no
        # client trainer, an in-process run does).
        torch.manual_seed(derive_seed(self.config.seed, 1))
        try:
            model = copy.deepcopy(self.initial_model)
            if self.warm_start is not None:
                model.load_state_dict(self.warm_start[0])
            federation.strategy.initialize(model, client_infos(self.partitions))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if federation.adaptation_target is not None:
            federation.strategy.receive_adaptation_target(federation.adaptation_target)
        return federation


def _described(tensor: torch.Tensor | None) -> str:
    """An array's dtype and shape, or that there is none (a warm start's refusal)."""
    return "no such array" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"


def image_size_of(config: ExperimentConfig, spec: DatasetSpec) -> int | None:
    """The image side a run reads: its ``image_size``, else the one its model takes
    (:data:`fedbed.models.FIXED_INPUT_SIZES`), else ``None`` (the dataset's default)."""
    return config.image_size or FIXED_INPUT_SIZES.get(config.model or spec.default_model)


def build_run(settings: ValidatedConfig | ExperimentConfig) -> BuiltRun:
    """Load the data, split, partition and build the initial model of validated settings
    (:func:`fedbed.config.validate`'s :class:`~fedbed.config.ValidatedConfig`, whose looked-up
    names it uses as they are: nothing is validated again). Given an :class:`ExperimentConfig`
    (the Python API, a run rebuilt from its folder), it validates it first: that run's one validation.

    Raises:
        ConfigError: invalid settings (an unvalidated config), data that cannot be found or
            read, a model that does not fit.
    """
    resolved = as_validated(settings)
    config = resolved.config
    algorithm, spec, hparams = resolved.algorithm, resolved.dataset, resolved.hparams
    try:
        model_name = config.model or spec.default_model
        declared = config.declared_names()
        if declared is not None and not declared[0]:  # a dataset known by name: its own domains
            declared = (spec.domain_names, declared[1])
        data_began = time.perf_counter()
        dataset = load_dataset(spec.path or spec.name, resolved.data_root, image_size_of(config, spec), config.channels,
                               declared, hugging_face_columns(config))
        split = split_leave_one_domain_out(dataset, (config.target,), config.holdout_fraction, config.seed,
                                           present_only=declared is not None)
        partitions = _partitions(config, split, algorithm.pooled, dataset.labels)
        ood_indices = split.target
        adaptation_indices = torch.zeros(0, dtype=torch.long)
        if config.protocol == "domain_adaptation" and (declared is None or len(split.target)):  # a site: no target
            adaptation_indices, ood_indices = split_target_for_adaptation(split.target, config.adaptation_fraction or 0.5, config.seed)
        if config.few_shot_per_client:
            partitions, ood_indices = add_few_shot_target_samples(split, partitions, config.few_shot_per_client, config.seed)

        def model_factory():
            base = build_model(model_name, dataset.input_shape, dataset.num_classes, config.pretrained_weights,
                               mixstyle=bool(config.mixstyle), pretrained=config.pretrained,
                               freeze_batchnorm=bool(config.freeze_batchnorm),
                               classifier_dropout=config.classifier_dropout or 0.0)
            return algorithm.wrap_model(base, hparams)

        phase_timings.record("data", time.perf_counter() - data_began, what="run")
        torch.manual_seed(derive_seed(config.seed, 0))
        with phase_timings.timed("model", what="initial model"):
            initial_model = model_factory()
    except (DataError, ModelError) as error:
        raise ConfigError(str(error)) from None
    budget = TrainingBudget(config.batch_size, config.local_epochs, config.local_steps)
    augmentation = Augmentation(config.augmentation) if config.augmentation else None
    try:
        device = resolve_device(config.device)
    except DeviceError as error:
        raise ConfigError(str(error)) from None
    if config.deterministic:
        set_deterministic(True)
    context = AlgorithmContext(model_factory=model_factory, budget=budget, seed=config.seed, task=dataset.task,
                               augmentation=augmentation, device=device, precision=config.precision, rounds=config.rounds)
    if resolved.evaluation_protocol == "linear_probe":
        if dataset.task != "classification":
            raise ConfigError(f"the linear_probe evaluation needs class labels; {dataset.name} is a regression task")
        # Data spread over machines: each machine checks the domains it holds (the server, which
        # probes, holds them all: linear_probe scores the id holdouts on the server).
        present = set(dataset.present_domains())
        sizes = {dataset.domain_names[d]: len(idx) for d, idx in split.holdout.items() if d in present}
        sizes.update({f"{dataset.domain_names[d]} (target)": int((dataset.domains[ood_indices] == d).sum())
                      for d in split.target_domains if d in present})
        small = {name: size for name, size in sizes.items() if size < 2}
        if small:
            raise ConfigError(f"the linear probe needs at least two samples of each evaluated domain; too few in {small}: "
                              "raise holdout_fraction or lower adaptation_fraction")
    return BuiltRun(config, algorithm, hparams, dataset, split, partitions, ood_indices, model_name, context, initial_model,
                    adaptation_indices, resolved.evaluation_protocol)


