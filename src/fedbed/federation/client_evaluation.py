"""id evaluation on the clients (Flower's federated evaluation, ``@app.evaluate()``).

With ``id_evaluation: clients`` the server does not read the source domains' id-validation
holdouts. Each holdout stays with the clients that hold its domain: a domain's holdout is split
into contiguous, near-equal shares among the clients holding that domain, in client-id order
(:func:`holdout_shares`). At every evaluated round the server sends each client the models that
count towards its domains (:func:`evaluation_payloads`); the client scores them on its share and
returns sums only (:func:`fedbed.federation.evaluation.metric_statistics`: sample and correct
counts and the count of samples predicted as each class, or the sums of Pearson's r); the server adds the shares up (:func:`combine_client_statistics`).
The sums are exact, so a domain's id accuracy equals the one the server would compute on the
whole holdout. The ood score stays on the server: the target domain belongs to no client.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fedbed.federation.devices import HOST
from fedbed.federation.evaluation import IdStatistics, add_statistics, metric_statistics
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload, Reply

ID_EVALUATION_SITES = ("server", "clients")
"""Where the id holdouts are scored: on the server (default) or on the clients holding them."""


def holdout_shares(holdout: dict[int, torch.Tensor], client_domains: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Each client's share of the id-validation holdouts of the source domains it holds.

    Args:
        holdout: source domain id -> ``int64 [m_d]`` dataset indices of its holdout.
        client_domains: per client id, the source domains it holds.

    Returns:
        Per client, ``int64`` dataset indices: for every domain it holds, its contiguous part of
        that domain's holdout split into ``torch.tensor_split`` parts among the domain's holders
        (in client-id order). The shares of a domain are disjoint and cover its holdout.
    """
    shares: list[list[torch.Tensor]] = [[] for _ in client_domains]
    for domain, indices in holdout.items():
        holders = [k for k, domains in enumerate(client_domains) if domain in domains]
        for k, part in zip(holders, torch.tensor_split(indices, len(holders)) if holders else []):
            shares[k].append(part)
    return [torch.cat(parts).sort().values if parts else torch.empty(0, dtype=torch.int64) for parts in shares]


def evaluation_payloads(models: list[tuple[nn.Module, tuple[int, ...] | None]],
                        client_domains: Sequence[tuple[int, ...]]) -> dict[int, Payload]:
    """What each client receives to score its holdout share.

    Args:
        models: the strategy's ``evaluation_models()``: ``(model, domains)``, a model counting
            towards the id score of ``domains`` (all if ``None``).
        client_domains: per client id, the source domains it holds.

    Returns:
        Per client holding at least one scored domain: read-only arrays
        ``model{j}/<state-dict name>`` of every model ``j`` that counts towards one of its domains
        (the client scores them and sends none back), and config
        ``model{j}/domains`` (comma-separated domain ids to score it on). The arrays are one copy
        of each model, shared by every payload (a thousand clients do not make a thousand copies;
        :class:`ClientEvaluator` loads them into its own model and never edits them).
    """
    copies = [{f"model{j}/{name}": t.detach().clone() for name, t in model.state_dict().items()}
              for j, (model, _) in enumerate(models)]
    payloads: dict[int, Payload] = {}
    for client, domains in enumerate(client_domains):
        arrays: dict[str, torch.Tensor] = {}
        config: dict[str, str] = {}
        for j, (model, counted) in enumerate(models):
            scored = [d for d in domains if counted is None or d in counted]
            if scored:
                arrays.update(copies[j])
                config[f"model{j}/domains"] = ",".join(map(str, scored))
        if config:
            payloads[client] = Payload(arrays={}, config=config, read_only_arrays=arrays)
    return payloads


def _scored(payload: Payload) -> list[tuple[int, list[int]]]:
    """``(model index, domain ids)`` pairs that ``payload`` asks its client to score."""
    return [(int(key.removeprefix("model").removesuffix("/domains")), [int(d) for d in str(value).split(",")])
            for key, value in payload.config.items() if key.startswith("model") and key.endswith("/domains")]


@dataclass
class ClientEvaluator:
    """The client half of id evaluation: loads each received model into one local instance and
    scores it on the client's holdout share.

    Attributes:
        model_factory: builds the method's model (the architecture the server's models share).
        task: ``"classification"`` or ``"regression"``.
        device: where the client scores (the run's device; batched there).
    """

    model_factory: Callable[[], nn.Module]
    task: str = "classification"
    device: torch.device = HOST
    _model: nn.Module | None = field(default=None, repr=False)

    def evaluate(self, payload: Payload, holdout: ClientData) -> Reply:
        """Score every model of ``payload`` on this client's holdout share.

        Returns:
            A reply without arrays; ``num_examples`` = the share's size; metrics
            ``model{j}/domain{d}/<statistic>`` per model and domain of the payload's config.

        Raises:
            RuntimeError: the arrays do not fit the model (the payload is not from this run).
        """
        if self._model is None:
            with torch.random.fork_rng():  # building the model must not move the training draws
                self._model = self.model_factory().to(self.device)
        metrics: dict[str, float] = {}
        for j, domains in _scored(payload):
            prefix = f"model{j}"
            state = {name.removeprefix(prefix + "/"): t for name, t in payload.read_only_arrays.items()
                     if name.startswith(prefix + "/")}
            self._model.load_state_dict(state)
            for domain in domains:
                part = holdout.domains == domain
                share = holdout.subset(part)
                for statistic, amount in metric_statistics(self._model, share, self.task).items():
                    metrics[f"{prefix}/domain{domain}/{statistic}"] = amount
        return Reply(arrays={}, num_examples=len(holdout), metrics=metrics)


def combine_client_statistics(payloads: dict[int, Payload],
                              outcomes: dict[int, Reply | str]) -> tuple[IdStatistics, dict[str, str]]:
    """Add up the clients' statistics per (model, domain).

    Args:
        payloads: what :func:`evaluation_payloads` sent.
        outcomes: per client, its reply or the reason it has none.

    Returns:
        ``(statistics, dropped)``: ``(model index, domain id) -> summed statistics`` for every
        pair whose shares all came back (a pair missing a share is left out, so its score is
        ``nan`` rather than a score on part of the holdout), and ``client id -> reason`` for
        every client without a usable reply.
    """
    parts: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    incomplete: set[tuple[int, int]] = set()
    dropped: dict[str, str] = {}
    for client, payload in payloads.items():
        expected = [(j, d) for j, domains in _scored(payload) for d in domains]
        outcome = outcomes.get(client, "no reply")
        if isinstance(outcome, Reply):
            missing = [pair for pair in expected if f"model{pair[0]}/domain{pair[1]}/n" not in outcome.metrics]
            if missing:
                outcome = f"its reply lacks the statistics of (model, domain) {missing}"
        if isinstance(outcome, str):
            dropped[str(client)] = outcome
            incomplete.update(expected)
            continue
        for j, d in expected:
            prefix = f"model{j}/domain{d}/"
            parts[(j, d)].append({k.removeprefix(prefix): v for k, v in outcome.metrics.items() if k.startswith(prefix)})
    return {pair: add_statistics(p) for pair, p in parts.items() if pair not in incomplete}, dropped
