"""The federated engine: the rounds of a run, the reply checks, evaluation.

One round (:func:`run_round`): sample clients -> ``configure_round`` -> each selected client's
``fit`` through a :class:`~fedbed.federation.transport.ClientTransport` (in this process one after
another, or on Flower) -> reply checks (:func:`checked_replies`: the transport's reasons, e.g. a
client that raised or edited its payload in place, then :func:`check_reply` per reply, then
:func:`outlying_updates` across the round) -> alignment telemetry of the client updates (for every
method: pairwise cosines, conflicting pairs, norms) -> ``aggregate`` (skipped when no reply is
left, and undone when it leaves a non-finite model: the round then keeps the previous model and
its log line says why) -> evaluation every ``eval_every`` rounds. :func:`run_rounds` loops over
the rounds: it resumes from the checkpoint, and after each round appends its line to the log and
writes the checkpoint (:mod:`fedbed.federation.run_log`, :mod:`fedbed.federation.checkpoints`).
Every random draw of round ``r`` on client ``k`` is seeded from ``(seed, r, k)``, so a run resumed
from its checkpoint equals an uninterrupted one. A stop signal that arrives while a round's log
line and checkpoint are written takes effect once both are on disk
(:func:`~fedbed.federation.run_log.signals_deferred`), so a stopped run's log and checkpoint end
at the same round.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fedbed.federation.alignment import alignment_telemetry_from_gram, norms_from_gram, update_gram_matrix
from fedbed.federation.arrays import floating_keys
from fedbed.federation.checkpoints import EngineError, load_checkpoint
from fedbed.federation.client_evaluation import (
    combine_client_statistics,
    evaluation_payloads,
)
from fedbed.federation.devices import HOST
from fedbed.federation.evaluation import evaluate_models
from fedbed.federation.linear_probe import LinearProbe
from fedbed.federation.local_data import ClientData, UnlabeledImages
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.federation.run_log import (
    keep_rounds_before,
    logged_evaluations,
    write_round,
)
from fedbed.federation.sampling import sample_clients
from fedbed.federation.strategy import ServerStrategy, TooFewReplies
from fedbed.federation.transport import FIT_SECONDS, ClientTransport
from fedbed.run_directory import CHECKPOINT_NAME, LOG_NAME
from fedbed.seeding import derive_seed

DEFAULT_UPDATE_NORM_FACTOR = 1000.0
"""The engine drops an update whose L2 norm exceeds this many times the (lower) median of the
round's update norms, unless the run sets ``update_norm_factor``: an honest client's update is
within a few times its peers' (one client per domain, any method here), a broken or malicious
one far beyond."""


@dataclass
class Federation:
    """Everything a run needs, already built.

    Attributes:
        strategy: the server half of the method, already initialised.
        clients: where the clients run (:class:`InProcessClients` or a Flower transport).
        holdout: source domain id -> id-validation samples.
        target: target domain id -> ood samples (evaluation only).
        domain_names: names of all domains of the dataset.
        task: ``"classification"`` or ``"regression"`` (decides the evaluation metric).
        id_evaluation: ``"server"`` scores ``holdout`` here; ``"clients"`` has each client score
            its own share of it (:mod:`fedbed.federation.client_evaluation`).
        client_domains: per client id, the source domains it holds (for ``"clients"``).
        probe: the ``linear_probe`` evaluation protocol's settings (``None``: ``argmax``).
        num_classes: classes of the task (the probe's output width).
        seed: the run's seed (the probe's shares).
        adaptation_target: ``domain_adaptation`` protocol only: the target's unlabelled
            adaptation share, also given to the strategy (``None`` otherwise).
        adaptation_labels_for_the_log: the adaptation share's labels, read only by
            :func:`adaptation_log` to log the accuracy of a strategy's pseudo-labels (never
            given to the strategy, never used by training or model selection).
        client_timeout: seconds a client's ``fit`` may take (its reply's ``fit_seconds``);
            a later reply is dropped as late. ``None``: no limit. In-process the fit is measured
            after it returns (a running fit cannot be pre-empted); on Flower the transport's
            round timeout also stops waiting for a silent node.
        device: where the server evaluates its models (they live on the CPU between evaluations).
        update_norm_factor: an update whose norm exceeds this many times the round's median
            update norm is dropped (:func:`outlying_updates`; ``inf`` turns the check off).
    """

    strategy: ServerStrategy
    clients: ClientTransport
    holdout: dict[int, ClientData]
    target: dict[int, ClientData]
    domain_names: tuple[str, ...]
    task: str = "classification"
    id_evaluation: str = "server"
    client_domains: tuple[tuple[int, ...], ...] = ()
    probe: LinearProbe | None = None
    num_classes: int = 0
    seed: int = 0
    adaptation_target: UnlabeledImages | None = None
    adaptation_labels_for_the_log: torch.Tensor | None = None
    client_timeout: float | None = None
    update_norm_factor: float = DEFAULT_UPDATE_NORM_FACTOR
    device: torch.device = HOST


def adaptation_log(pseudo_labels: list[int], labels: torch.Tensor | None) -> dict[str, Any]:
    """The round's log of a strategy's pseudo-labels of the adaptation share (``-1``: none).

    Returns:
        ``{"pseudo_labelled_fraction", "pseudo_label_accuracy_reads_target_labels"}``; the
        accuracy (percent of the pseudo-labelled images whose pseudo-label is their label) reads
        target labels and exists for the log only (``None`` without labels or pseudo-labels).
    """
    predicted = torch.tensor(pseudo_labels, dtype=torch.long)
    kept = predicted >= 0
    accuracy = None
    if labels is not None and bool(kept.any()):
        accuracy = 100.0 * float((predicted[kept] == labels[kept]).float().mean())
    return {"pseudo_labelled_fraction": float(kept.float().mean()) if len(predicted) else 0.0,
            "pseudo_label_accuracy_reads_target_labels": accuracy}


def evaluate_federation(federation: Federation) -> tuple[dict[str, Any], dict[str, str]]:
    """Evaluate the strategy's models: id on the server or on the clients, ood on the server.

    Returns:
        ``(evaluation, dropped)``: :func:`~fedbed.federation.evaluation.evaluate_models`'s result,
        and per client that could not evaluate, the reason (its domains' id scores are ``nan``).
    """
    models = federation.strategy.evaluation_models()
    id_statistics, dropped, id_domains = None, {}, None
    if federation.id_evaluation == "clients":
        payloads = evaluation_payloads(models, federation.client_domains)
        id_statistics, dropped = combine_client_statistics(payloads, federation.clients.evaluate_round(payloads))
        id_domains = sorted({d for domains in federation.client_domains for d in domains})
    evaluation = evaluate_models(models, federation.holdout, federation.target, federation.domain_names,
                                 federation.task, id_statistics, federation.probe, federation.num_classes, federation.seed,
                                 id_domains, federation.device)
    return evaluation, dropped


def check_reply(reply: Reply, expected: dict[str, torch.Tensor], client_timeout: float | None = None) -> str | None:
    """Why a reply must be dropped, or ``None`` if it is usable: the engine's one check of
    every reply, on every backend, before any method sees it.

    A reply is dropped when it came later than ``client_timeout`` seconds (its
    :data:`~fedbed.federation.transport.FIT_SECONDS` metric), lacks an array that was sent,
    returns an array that was not sent, returns an array of another shape or dtype than the one
    of the same name that was sent, holds non-finite values, or reports no training example.

    Args:
        reply: one client's reply.
        expected: the payload's ``arrays`` sent to that client.
        client_timeout: seconds; ``None``: no limit.
    """
    seconds = reply.metrics.get(FIT_SECONDS)
    if client_timeout is not None and seconds is not None and seconds > client_timeout:
        return (f"late: its fit took {seconds:.3g} s, over the client_timeout of {client_timeout:g} s "
                "(in-process, measured after the fit returned)")
    for name, sent in expected.items():
        if name not in reply.arrays:
            return f"array {name} is missing from the reply"
    for name, array in reply.arrays.items():
        if name not in expected:
            return f"array {name} was not sent (unexpected in the reply)"
        if name in expected and (array.shape != expected[name].shape or array.dtype != expected[name].dtype):
            return (f"array {name} is {array.dtype} {tuple(array.shape)}, expected "
                    f"{expected[name].dtype} {tuple(expected[name].shape)}")
        if array.is_floating_point() and not bool(torch.isfinite(array).all()):
            return f"array {name} holds non-finite values"
    if reply.num_examples <= 0:
        return f"num_examples must be positive, got {reply.num_examples}"
    return None


def client_update_gram(payloads: dict[int, Payload], replies: dict[int, Reply],
                       auxiliary_prefixes: tuple[str, ...] = ()) -> tuple[list[int], torch.Tensor] | None:
    """The Gram matrix of each replying client's update ``reply − payload``
    (:func:`~fedbed.federation.alignment.update_gram_matrix`) over the floating-point arrays both
    hold, but for those whose names start with one of ``auxiliary_prefixes`` (arrays that are not
    the model: :attr:`~fedbed.federation.strategy.ServerStrategy.auxiliary_array_prefixes`).

    The norm check and the alignment telemetry read only inner products of the updates, so the
    engine keeps this ``[K, K]`` matrix instead of the updates ``[K, P]`` (memory: K + 1 copies
    of the largest array instead of K × the model).

    Returns:
        ``(client ids, the Gram matrix [K, K] float64 of their updates, rows and columns in the
        ids' order)``, or ``None`` when there is no reply or the replies share no such array with what was sent (then no alignment
        telemetry is logged).
    """
    order = sorted(replies)
    if not order:
        return None
    keys = [key for key in floating_keys(payloads[order[0]].arrays, replies[order[0]].arrays)
            if not key.startswith(auxiliary_prefixes)]
    if not keys:
        return None
    return order, update_gram_matrix([payloads[c].arrays for c in order], [replies[c].arrays for c in order], keys)


def outlying_updates(client_ids: Sequence[int], norms: torch.Tensor, factor: float) -> dict[int, str]:
    """The clients whose update norm exceeds ``factor`` times the round's median update norm,
    each with the reason it is dropped.

    The median is the lower one (``torch.median``: of two norms, the smaller), so that of two
    clients the one far above the other is caught; a round whose median norm is 0 (most clients
    did not move) drops nothing, since no ratio is defined.

    Args:
        client_ids: the K clients, in the order of ``norms``.
        norms: ``[K]`` L2 norms of the clients' updates (parameter units).
        factor: the threshold (> 1), ``update_norm_factor``; ``inf`` drops nothing.
    """
    if len(client_ids) == 0 or math.isinf(factor):
        return {}
    median = float(norms.median())
    if median <= 0:
        return {}
    return {client: (f"update norm {float(norm):.3g} is over {factor:g} x the round's median update norm "
                     f"{median:.3g} (update_norm_factor)")
            for client, norm in zip(client_ids, norms) if float(norm) > factor * median}


def non_finite_model(strategy: ServerStrategy) -> str | None:
    """The first floating-point array of the strategy's evaluation models that holds a
    non-finite value, named, or ``None`` when every one is finite."""
    for index, (model, _) in enumerate(strategy.evaluation_models()):
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"model {index} array {name}"
    return None


def aggregate_or_keep(strategy: ServerStrategy, round_number: int, replies: dict[int, Reply]) -> tuple[RoundSummary, str | None]:
    """Aggregate the round's checked replies, or keep the previous model.

    With no reply left, the strategy is not called; when its aggregation cannot use the replies
    (:class:`~fedbed.federation.strategy.TooFewReplies`) or leaves a non-finite array in an
    evaluation model (:func:`non_finite_model`), its state from before the round is restored.

    Returns:
        ``(the strategy's summary, or an empty one; None, or why the previous model was kept)``.
    """
    if not replies:
        return RoundSummary(), "no reply passed the checks (see dropped): the global model is unchanged"
    before = copy.deepcopy(strategy.state_dict())
    try:
        summary = strategy.aggregate(round_number, replies)
    except TooFewReplies as error:
        strategy.load_state_dict(before)
        return RoundSummary(), f"the aggregation cannot use this round's replies ({error}): the global model is unchanged"
    broken = non_finite_model(strategy)
    if broken is None:
        return summary, None
    strategy.load_state_dict(before)
    return summary, f"the aggregation left non-finite values in {broken}: the previous model is restored"


def client_infos(partitions: Sequence[Any]) -> list[ClientInfo]:
    """:class:`ClientInfo` of every client from its partition (``indices`` [n_k], ``None`` when
    this machine does not hold them, and ``domains``)."""
    return [ClientInfo(k, None if p.indices is None else int(len(p.indices)), tuple(p.domains))
            for k, p in enumerate(partitions)]


def checked_replies(federation: Federation, payloads: dict[int, Payload],
                    selected: list[int]) -> tuple[dict[int, Reply], dict[str, str], tuple[list[int], torch.Tensor] | None]:
    """Fit the selected clients through the transport and drop the replies that fail the checks.

    A client with no reply (it raised, was lost, or edited what it was sent in place: the
    transport's reason, :meth:`~fedbed.federation.transport.ClientTransport.fit_round`) and a
    reply that fails :func:`check_reply` are dropped first; then, over the remaining replies,
    those whose update norm is an outlier (:func:`outlying_updates`).

    Returns:
        ``(replies kept, dropped: client id (str) -> reason, the kept replies' client ids and
        the Gram matrix of their updates`` (:func:`client_update_gram`, ``None`` without any)``)``.
    """
    replies: dict[int, Reply] = {}
    dropped: dict[str, str] = {}
    for client, outcome in sorted(federation.clients.fit_round({c: payloads[c] for c in selected}).items()):
        reason = outcome if isinstance(outcome, str) else check_reply(outcome, payloads[client].arrays,
                                                                       federation.client_timeout)
        if reason is None:
            replies[client] = outcome
        else:
            dropped[str(client)] = reason
    update_gram = client_update_gram(payloads, replies, federation.strategy.auxiliary_array_prefixes)
    if update_gram is not None:
        order, gram = update_gram
        outliers = outlying_updates(order, norms_from_gram(gram), federation.update_norm_factor)
        if outliers:
            dropped.update({str(client): reason for client, reason in outliers.items()})
            replies = {client: reply for client, reply in replies.items() if client not in outliers}
            kept = [index for index, client in enumerate(order) if client not in outliers]
            update_gram = ([order[index] for index in kept], gram[kept][:, kept]) if kept else None
    return replies, dropped, update_gram


def run_round(
    federation: Federation,
    round_number: int,
    *,
    rounds: int,
    seed: int,
    participation_fraction: float,
    eval_every: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One round: sample, configure, fit and check (:func:`checked_replies`), alignment
    telemetry, aggregate (:func:`aggregate_or_keep`), evaluate when due.

    Args:
        federation: the built run (its strategy and clients' states advance by one round).
        round_number: this round (1-based).
        rounds, seed, participation_fraction, eval_every: as for :func:`run_rounds`.

    Returns:
        ``(record, evaluation)``: the round's line of ``rounds.jsonl``, and its evaluation
        (``{"round", **scores}``, also in the record) or ``None`` when the round is not evaluated.

    Raises:
        EngineError: a method that needs every selected client lost one.
    """
    began = time.perf_counter()
    selected = sample_clients(federation.clients.num_clients, participation_fraction, seed, round_number)
    payloads = federation.strategy.configure_round(round_number, selected)
    for client in selected:
        payloads[client].config.update({"round": round_number, "rounds": rounds, "client": client,
                                        "batch_seed": derive_seed(seed, round_number, client)})
    replies, dropped, update_gram = checked_replies(federation, payloads, selected)
    if dropped and federation.strategy.requires_every_client:
        lost = "; ".join(f"client {client}: {reason}" for client, reason in sorted(dropped.items(), key=lambda item: int(item[0])))
        raise EngineError(f"round {round_number}: this method needs every selected client, and lost {lost}")
    alignment = alignment_telemetry_from_gram(update_gram[1], update_gram[0]) if update_gram is not None else None
    summary, kept_previous_model = aggregate_or_keep(federation.strategy, round_number, replies)
    pseudo_labels = summary.telemetry.pop("pseudo_labels", None)
    adaptation = adaptation_log(pseudo_labels, federation.adaptation_labels_for_the_log) if pseudo_labels is not None else None
    evaluation, evaluation_dropped = None, {}
    evaluation_began = time.perf_counter()
    if eval_every and (round_number % eval_every == 0 or round_number == rounds):
        scores, evaluation_dropped = evaluate_federation(federation)
        evaluation = {"round": round_number, **scores}
    record = {
        "round": round_number,
        "selected": selected,
        "dropped": dropped,
        "kept_previous_model": kept_previous_model,
        "metrics": summary.metrics,
        "alignment": alignment,
        "telemetry": summary.telemetry,
        "communication": {
            "sent_bytes": {str(c): payloads[c].num_bytes() for c in selected},
            "received_bytes": {str(c): reply.num_bytes() for c, reply in replies.items()},
        },
        "adaptation": adaptation,
        "evaluation": evaluation,
        "evaluation_dropped": evaluation_dropped,
        "seconds": time.perf_counter() - began,
        "evaluation_seconds": time.perf_counter() - evaluation_began,
    }
    return record, evaluation


def first_round(federation: Federation, log_path: Path, checkpoint_path: Path, resume: bool) -> int:
    """The round a run starts at: 1, with an emptied log; or, resuming, the one after its
    checkpoint's (restored into the strategy and the clients), with the log cut to the rounds
    before it (:func:`~fedbed.federation.run_log.keep_rounds_before`).

    Raises:
        EngineError: ``resume`` without a usable checkpoint.
    """
    if not resume:
        log_path.write_text("")
        return 1
    if not checkpoint_path.exists():
        raise EngineError(f"cannot resume: {checkpoint_path} does not exist; run without --resume")
    try:
        start = load_checkpoint(checkpoint_path, federation.strategy, federation.clients) + 1
    except EngineError as error:
        raise EngineError(f"cannot resume: {error}; run without --resume (--overwrite)") from None
    keep_rounds_before(log_path, start)
    return start


def run_rounds(
    federation: Federation,
    *,
    rounds: int,
    seed: int,
    participation_fraction: float,
    eval_every: int,
    run_dir: Path,
    resume: bool = False,
    progress: bool = True,
    on_start: Callable[[int], None] | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) the federated training and return the evaluation of every evaluated round.

    Args:
        federation: the built run.
        rounds: total number of rounds R (>= 1).
        seed: the run's seed (client sampling, batch order, dropout).
        participation_fraction: fraction of clients sampled per round, in (0, 1].
        eval_every: evaluate every this many rounds and after the last; 0 never evaluates
            (for timing the engine alone).
        run_dir: where the log and checkpoint go (must exist).
        resume: continue from ``run_dir/checkpoint.pt`` instead of starting over.
        progress: show a progress bar with round, loss and accuracy.
        on_start: called once before the first round with the number of rounds already
            completed (0, or the checkpoint's round when resuming; ``>= rounds`` when nothing is
            left to run).
        on_round: called with each round's record once its log line and checkpoint are written
            (an experiment tracker's hook, :class:`fedbed.tracking.RunTracking`).

    Returns:
        One dict per evaluated round: ``round``, ``id``, ``id_mean``, ``ood``, ``ood_mean``.

    A round in which no reply passes the checks, or whose aggregation leaves a non-finite model,
    keeps the previous model (and the strategy's state); its log line says so in
    ``kept_previous_model``.

    Raises:
        EngineError: a method that needs every selected client lost one, or ``resume`` without
            a usable checkpoint.
    """
    log_path, checkpoint_path = run_dir / LOG_NAME, run_dir / CHECKPOINT_NAME
    start = first_round(federation, log_path, checkpoint_path, resume)
    evaluations = logged_evaluations(log_path)
    if on_start is not None:
        on_start(start - 1)

    bar = tqdm(range(start, rounds + 1), desc="round", disable=not progress, initial=start - 1, total=rounds)
    for round_number in bar:
        record, evaluation = run_round(federation, round_number, rounds=rounds, seed=seed,
                                       participation_fraction=participation_fraction, eval_every=eval_every)
        if evaluation is not None:
            evaluations.append(evaluation)
        write_round(log_path, checkpoint_path, record, federation.strategy, federation.clients)
        if on_round is not None:
            on_round(record)
        postfix = {"loss": f"{record['metrics'].get('train_loss', float('nan')):.3f}"}
        if evaluations:
            postfix.update(id=f"{evaluations[-1]['id_mean']:.1f}", ood=f"{evaluations[-1]['ood_mean']:.1f}")
        bar.set_postfix(postfix)
    bar.close()
    return evaluations
