"""hFedF (``hfedf.txt``): a hypernetwork on the server as a non-linear aggregator, with
GradAlign and EMA; and pFedHN (Shamsian et al., ICML 2021) as the hFedF paper uses it.

Each round the server generates client ``i``'s weights ``φ_i = h(θ, ν[i])`` and sends only
``φ_i`` (the hypernetwork never leaves the server); the client trains ``E`` local epochs and
returns its trained weights, from which the server forms ``Δφ_i = φ_i,after − φ_i,before``
(Algorithm 1, line 9). The server turns each ``Δφ_i`` into hypernetwork gradients by the chain
rule, ``g_θ,i = ∇_θ h(θ, ν[i])ᵀ (−Δφ_i)`` and ``g_ν,i`` likewise (vector-Jacobian products,
line 13), weights them with GradAlign (Algorithm 3), aggregates (line 16), takes an Adam step
(line 17, App. C.7) and smooths θ and ν with EMA (Algorithm 4).

Two ambiguities of the paper, decided here:

- The sign (Algorithm 1, lines 9, 13, 17): ``θ ← θ − α g`` with ``g = ∇hᵀ Δφ`` would move the
  generated weights *away* from what the clients trained, since ``Δφ ≈ −μ ∇L``. FedBed uses
  pFedHN's convention, ``g = ∇hᵀ (φ_before − φ_after)``, so that a server step moves ``h(θ, ν[i])``
  towards the client's trained weights (tested).
- GradAlign's softmax: Algorithm 3 writes ``softmax(γ_i)`` (larger weight for updates closer to
  the mean direction); Sec. 4.2 writes ``e^{−γ_i} / Σ_j e^{−γ_j}``. The default follows
  Algorithm 3; ``gradalign_softmax=negative`` gives the Sec. 4.2 form.

Evaluation: the paper evaluates generalization "on an unseen target domain" and
personalization "on a held-out subset of the local source domain data" (Fig. 2c) without
naming an embedding for the target domain. FedBed evaluates every client's generated model:
id accuracy of a source domain is that of the models of the clients holding it, on its holdout;
ood accuracy is the mean over all client models on the target (as for Local-only). pFedHN's ood
accuracy is computed the same way.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
)
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.algorithms.base.search_space import LogUniform, Uniform
from fedbed.federation.alignment import cosine_similarities
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary
from fedbed.federation.strategy import ServerStrategy
from fedbed.models.hypernetwork import HyperNetwork
from fedbed.seeding import seeded_generator


class ExponentialMovingAverage:
    """hFedF's EMA with warm-up (Algorithm 4) over a list of tensors.

    At round ``t = warmup`` the average starts as a copy of the tensors; for ``t > warmup``,
    ``avg ← α·current + (1 − α)·avg`` and the tensors are replaced by ``avg``. ``α`` weights the
    *current* value (Algorithm 4), so a smaller α smooths more (App. C.6).
    """

    def __init__(self, decay: float, warmup_rounds: int) -> None:
        self.alpha = decay
        self.warmup_rounds = warmup_rounds
        self.average: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self, tensors: list[torch.Tensor], round_number: int) -> None:
        """Apply Algorithm 4 at round ``round_number`` (in place on ``tensors``)."""
        if round_number == self.warmup_rounds or (round_number > self.warmup_rounds and self.average is None):
            self.average = [t.detach().clone() for t in tensors]
        elif round_number > self.warmup_rounds:
            for average, tensor in zip(self.average, tensors):
                average.mul_(1 - self.alpha).add_(tensor, alpha=self.alpha)
                tensor.copy_(average)


class HFedFHyperparameters(LocalTrainingHyperparameters):
    """hFedF's hyperparameters; defaults: the PACS column of ``hfedf.txt`` Table 10; search: its grids' span.

    Attributes:
        server_learning_rate: Adam's learning rate on θ and ν (1e-3).
        server_weight_decay: Adam's weight decay (1e-5).
        ema_decay: α of Algorithm 4 (0.95).
        ema_warmup_rounds: w of Algorithm 4 (the paper gives no value; FedBed's default 10).
        client_weight_decay: 1e-3 (Table 10, hFedF row).
        use_gradalign / use_ema: switch GradAlign and EMA off for the ablations of Table 3
            (without GradAlign the client gradients are averaged uniformly).
        gradalign_softmax: ``positive`` (Algorithm 3) or ``negative`` (Sec. 4.2 text).
        embeddings: ``learnable`` (default) or ``random`` (re-drawn every round, App. C.3).
    """

    client_weight_decay: float = Field(1e-3, ge=0)
    server_learning_rate: float = Field(1e-3, gt=0)
    server_weight_decay: float = Field(1e-5, ge=0)
    ema_decay: float = Field(0.95, ge=0, le=1)
    ema_warmup_rounds: int = Field(10, ge=1)
    use_gradalign: bool = True
    use_ema: bool = True
    gradalign_softmax: Literal["positive", "negative"] = "positive"
    embeddings: Literal["learnable", "random"] = "learnable"
    search_space = {  # the span of Table 10's grids; the client's settings as every method's (their range holds its grids)
        "server_learning_rate": LogUniform(1e-3, 1e-1, source="hFedF Table 10: server learning rate {1e-1, 1e-2, 1e-3}"),
        "server_weight_decay": LogUniform(1e-5, 1e-3, source="hFedF Table 10: server weight decay {1e-3, 1e-4, 1e-5}"),
        "ema_decay": Uniform(0.75, 0.95, source="hFedF Table 10: server EMA decay {0.75, 0.85, 0.95}")}


class HypernetworkStrategy(ServerStrategy):
    """The server of hFedF and pFedHN: holds the hypernetwork, sends each client its own φ_i."""

    def __init__(self, hparams: HFedFHyperparameters, seed: int) -> None:
        self.hparams = hparams
        self.seed = seed

    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        buffers = [name for name, tensor in model.named_buffers() if tensor.is_floating_point()]
        if buffers:
            raise ValueError(
                f"hypernetwork methods generate a model's parameters only; this model has statistics buffers "
                f"({', '.join(buffers[:3])}, ...): use a model without BatchNorm (hfedf_cnn, mnist_cnn, lenet)"
            )
        self.template = model
        self.clients = {c.client_id: c for c in clients}
        shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
        self.float_names = [name for name, tensor in model.state_dict().items() if tensor.is_floating_point()]
        self.hypernetwork = HyperNetwork(len(clients), {n: shapes[n] for n in self.float_names})
        self.fixed = {n: t.clone() for n, t in model.state_dict().items() if n not in self.float_names}
        self.optimizer = torch.optim.Adam(
            self.hypernetwork.parameters(), lr=self.hparams.server_learning_rate, weight_decay=self.hparams.server_weight_decay
        )
        self.ema = ExponentialMovingAverage(self.hparams.ema_decay, self.hparams.ema_warmup_rounds)
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        self.generation_seconds = 0.0

    def _redraw_embeddings(self, round_number: int) -> None:
        if self.hparams.embeddings == "random":
            with torch.no_grad():
                generator = seeded_generator(self.seed, round_number, 41)
                self.hypernetwork.embeddings.weight.copy_(
                    torch.randn(self.hypernetwork.embeddings.weight.shape, generator=generator)
                )

    @torch.no_grad()
    def generate(self, client: int) -> dict[str, torch.Tensor]:
        """φ_client as a full state dict (generated float tensors plus any fixed integer buffers)."""
        return {**{n: t.detach().clone() for n, t in self.hypernetwork(client).items()}, **copy.deepcopy(self.fixed)}

    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        began = time.perf_counter()
        self._redraw_embeddings(round_number)
        self.sent = {client: self.generate(client) for client in selected}
        self.generation_seconds = time.perf_counter() - began
        return {client: Payload(arrays={n: t.clone() for n, t in arrays.items()}) for client, arrays in self.sent.items()}

    def client_gradients(self, replies: dict[int, Reply]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Per client, ``g_θ,i`` and ``g_ν,i`` flattened: the vector-Jacobian products
        ``∇h(θ, ν[i])ᵀ (φ_before − φ_after)`` (Algorithm 1, line 13, pFedHN's sign).

        Returns:
            ``(client ids, g_θ [K, |θ|], g_ν [K, |ν|])``.
        """
        order = sorted(replies)
        body = self.hypernetwork.body_parameters()
        embeddings = self.hypernetwork.embeddings.weight
        theta_rows, nu_rows = [], []
        for client in order:
            generated = self.hypernetwork(client)
            descent = [self.sent[client][n] - replies[client].arrays[n].to(generated[n].dtype) for n in self.float_names]
            grads = torch.autograd.grad(
                [generated[n] for n in self.float_names], [*body, embeddings], grad_outputs=descent, allow_unused=True
            )
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, [*body, embeddings])]
            theta_rows.append(torch.cat([g.reshape(-1) for g in grads[:-1]]))
            nu_rows.append(grads[-1].reshape(-1))
        return order, torch.stack(theta_rows), torch.stack(nu_rows)

    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        began = time.perf_counter()
        order, g_theta, g_nu = self.client_gradients(replies)
        count = len(order)
        if self.hparams.use_gradalign:
            w_theta = gradalign_weights(g_theta, self.hparams.gradalign_softmax).to(g_theta.dtype)
            w_nu = gradalign_weights(g_nu, self.hparams.gradalign_softmax).to(g_nu.dtype)
        else:
            w_theta = w_nu = torch.full((count,), 1.0 / count, dtype=g_theta.dtype)
        theta_gradient, nu_gradient = w_theta @ g_theta, w_nu @ g_nu
        body = self.hypernetwork.body_parameters()
        offset = 0
        for parameter in body:
            parameter.grad = theta_gradient[offset : offset + parameter.numel()].view_as(parameter).clone()
            offset += parameter.numel()
        embeddings = self.hypernetwork.embeddings.weight
        embeddings.grad = None if self.hparams.embeddings == "random" else nu_gradient.view_as(embeddings).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hparams.use_ema:
            self.ema.update(list(self.hypernetwork.parameters()), round_number)
        seconds = time.perf_counter() - began + self.generation_seconds
        bytes_sent = {str(c): sum(t.numel() * t.element_size() for t in self.sent[c].values()) for c in order}
        bytes_received = {str(c): sum(t.numel() * t.element_size() for t in replies[c].arrays.values()) for c in order}
        losses = [r.metrics["loss"] for r in replies.values() if "loss" in r.metrics]
        return RoundSummary(
            metrics={"train_loss": sum(losses) / len(losses)} if losses else {},
            telemetry={
                "clients": order,
                "weights": w_theta.tolist(),
                "embedding_weights": w_nu.tolist(),
                "server_seconds": seconds,
                "bytes_sent": bytes_sent,
                "bytes_received": bytes_received,
            },
        )

    def _model_of(self, client: int) -> nn.Module:
        model = copy.deepcopy(self.template)
        model.load_state_dict(self.generate(client))
        return model

    def global_model(self) -> nn.Module:
        """The first client's generated model (there is no single global model; see :meth:`evaluation_models`)."""
        return self._model_of(min(self.clients))

    def evaluation_models(self) -> list[tuple[nn.Module, tuple[int, ...] | None]]:
        return [(self._model_of(c), self.clients[c].domains) for c in sorted(self.clients)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "hypernetwork": copy.deepcopy(self.hypernetwork.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "ema": None if self.ema.average is None else [t.clone() for t in self.ema.average],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hypernetwork.load_state_dict(state["hypernetwork"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.ema.average = state["ema"]


HFEDF_RUN_SETTINGS = {"rounds": 200, "local_epochs": 2, "batch_size": 64, "holdout_fraction": 0.1}
"""hFedF's run settings on PACS, Office-Home and VLCS (one value for all three): "trained for 200
communication rounds, with 2 local epochs per round and a batch size of 64" (Sec. 5.1, Training
details; App. C.4 fixes the 2 local epochs for every experiment); "each client retains 10% of its
source data as a validation set" (Sec. 5.1). The input size is not stated (Table 9's shapes imply
32 px), so it is not filled."""


@register_algorithm
class HFedF(SupervisedAlgorithm):
    """hFedF (``hfedf.txt``, Sec. 4, Algorithms 1-4; App. C.7-C.8)."""

    name = "hfedf"
    secure_aggregation_compatible = False  # the server needs each client's own update or model
    server_rule_refusal = "generates each client's weights on its server: there is no average for a rule to replace"
    summary = ("hFedF (Bartholet et al. 2024; hfedf.txt): server hypernetwork generates each client's weights; "
               "GradAlign + Adam + EMA on the server.")
    hyperparameters = HFedFHyperparameters
    dataset_defaults = {  # hfedf.txt Table 10, Office-Home and VLCS columns
        "OfficeHome": {"server_weight_decay": 1e-5, "ema_decay": 0.75},
        "VLCS": {"server_weight_decay": 1e-3, "ema_decay": 0.75},
    }
    dataset_run_settings = {dataset: HFEDF_RUN_SETTINGS for dataset in ("PACS", "OfficeHome", "VLCS")}

    def create_strategy(self, hparams: HFedFHyperparameters, context: AlgorithmContext) -> HypernetworkStrategy:
        return HypernetworkStrategy(hparams, context.seed)


class PFedHNHyperparameters(HFedFHyperparameters):
    """pFedHN as hFedF's baseline: no GradAlign, no EMA; PACS values of ``hfedf.txt`` Table 10
    (server learning rate 1e-2, server weight decay 1e-3, client weight decay 1e-5); searched as hFedF."""

    client_weight_decay: float = Field(1e-5, ge=0)
    server_learning_rate: float = Field(1e-2, gt=0)
    server_weight_decay: float = Field(1e-3, ge=0)
    use_gradalign: bool = False
    use_ema: bool = False
    search_space = {"ema_decay": None}  # Table 10 gives pFedHN hFedF's grids but no EMA


@register_algorithm
class PFedHN(HFedF):
    """pFedHN (Shamsian et al., ICML 2021): a hypernetwork generating each client's weights,
    updated with ``∇hᵀ (φ_before − φ_after)`` averaged over the round's clients."""

    name = "pfedhn"
    summary = "pFedHN (Shamsian et al. 2021): hypernetwork-generated client weights, plain averaged server step."
    hyperparameters = PFedHNHyperparameters
    dataset_defaults = {  # hfedf.txt Table 10, Office-Home and VLCS columns
        dataset: {"server_learning_rate": 1e-3, "server_weight_decay": 1e-4, "client_weight_decay": 1e-4}
        for dataset in ("OfficeHome", "VLCS")
    }
    dataset_run_settings = HFedF.dataset_run_settings  # hFedF trains every method it compares with so (Sec. 5.1)


def gradalign_weights(gradients: torch.Tensor, softmax_sign: str = "positive") -> torch.Tensor:
    """GradAlign (hFedF Algorithm 3): softmax of each gradient's cosine with the mean gradient.

    Args:
        gradients: ``[K, P]``, one flattened gradient per client.
        softmax_sign: ``"positive"`` — ``softmax(γ)`` as Algorithm 3; ``"negative"`` —
            ``softmax(−γ)`` as the text of Sec. 4.2.

    Returns:
        ``[K]`` float64 weights summing to 1; a zero gradient (or a zero mean) has cosine 0.
    """
    gradients = gradients.to(torch.float64)
    cosines = cosine_similarities(gradients, gradients.mean(dim=0, keepdim=True))[:, 0]
    return torch.softmax(cosines if softmax_sign == "positive" else -cosines, dim=0)


__all__ = ["HFedF", "HyperNetwork", "HypernetworkStrategy", "PFedHN"]
