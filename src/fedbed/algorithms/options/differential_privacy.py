"""Client-level differential privacy for methods that average: fixed clipping and Gaussian noise.

Each round every client's update ``Δ_k = θ_k − θ`` is clipped to L2 norm ``C``
(:func:`fedbed.federation.arrays.clip_to_norm`) and the server moves the global model by the mean of the
K clipped updates plus Gaussian noise of standard deviation ``σ C / K`` per coordinate: the
Gaussian mechanism on the sum of clipped updates (sensitivity C) divided by K (DP-FedAvg,
McMahan et al., ICLR 2018; Flower's ``DifferentialPrivacyServerSideFixedClipping`` and
``...ClientSideFixedClipping``, whose ``compute_stdv`` is ``σ C / num_sampled_clients``).
Clients weigh equally (weights n_k would let one client move the mean by more than C / K).

- ``clipping: server``: the server clips (it sees each client's update, as the robust rules do);
- ``clipping: client``: each client clips its own update before it leaves
  (:func:`fedbed.federation.transport.fit_client`, Flower's ``fixedclipping_mod``); the server
  only sums and adds noise, so the model arrays can be summed under secure aggregation. The
  server clips again, which leaves an honest client's clipped update unchanged and bounds a
  client that did not clip.

What the guarantee covers: the released global models. Each reply also carries ``num_examples``
and the client's training metrics (its loss, for example) in the clear; neither the (ε, δ)
statement nor secure aggregation covers them. The round's log keeps only what the statement
covers (the noise's standard deviation, ε and δ). ``log_client_norms: true`` is a debugging
switch: it adds every client's update norm before clipping and the clients whose update the
server clipped, which the guarantee does not cover, and the run's privacy statement says so.

The floating-point arrays of the model (parameters and BatchNorm statistics) are released this
way; integer buffers (BatchNorm's ``num_batches_tracked``) keep the server's values. The
privacy spent after T rounds, (ε, δ), comes from Opacus' Rényi-DP accountant
(``opacus.accountants.RDPAccountant``, Mironov 2017; subsampled Gaussian of Mironov et al. 2019)
with noise multiplier σ, sample rate q = clients a round / clients and T steps. The accountant
assumes Poisson sampling of clients; FedBed samples a fixed number without replacement, as Flower
and most federated DP work also account it. A round that keeps the previous model is counted
too (an upper bound).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedbed.algorithms.base.model_aggregation import ClientModels, ModelAggregation
from fedbed.federation.arrays import clip_to_norm, flatten, floating_keys, stacked_updates, unflatten
from fedbed.federation.messages import CLIPPING_NORM, Scalar

CLIPPING_SITES = ("server", "client")
"""Where the updates are clipped (see the module docstring)."""


class DifferentialPrivacy(BaseModel):
    """The run's ``differential_privacy`` settings.

    Attributes:
        clipping: ``server`` or ``client`` (see the module docstring).
        clipping_norm: ``C``, the largest L2 norm of a client's update (parameter units).
        noise_multiplier: ``σ``: the noise's standard deviation is ``σ C / K``.
        delta: ``δ`` of the (ε, δ) reported (1e-5 unless set).
        log_client_norms: ``true`` logs each client's update norm before clipping and the
            clients clipped by the server in ``rounds.jsonl`` (debugging only: not covered by the
            guarantee; the statement flags it). Unset or ``false``: not logged.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    clipping: Literal[CLIPPING_SITES] = "server"
    clipping_norm: float = Field(gt=0)
    noise_multiplier: float = Field(gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    log_client_norms: bool | None = None  # unset keeps existing runs' settings hashes


def privacy_spent(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε of the (ε, δ) guarantee after ``rounds`` rounds of the subsampled Gaussian mechanism.

    Opacus' ``RDPAccountant`` with one history entry ``(σ, q, T)``, converted at ``delta``.

    Raises:
        ValueError: ``rounds < 1`` or a sample rate outside ``(0, 1]``.
    """
    if rounds < 1 or not 0 < sample_rate <= 1:
        raise ValueError(f"privacy is accounted for rounds >= 1 and a sample rate in (0, 1], got {rounds} and {sample_rate}")
    # Imported here: opacus loads slowly and only runs with differential privacy need it.
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), float(sample_rate), int(rounds))]
    return float(accountant.get_epsilon(delta=delta))


def privacy_statement(settings: DifferentialPrivacy, sample_rate: float, rounds: int) -> dict[str, Any]:
    """What a run's privacy guarantee is after ``rounds`` rounds, for its summary and output:
    the mechanism's settings, ``epsilon``, ``delta`` and a one-line ``note``."""
    epsilon = privacy_spent(settings.noise_multiplier, sample_rate, rounds, settings.delta)
    note = (f"client-level ({epsilon:.3g}, {settings.delta:g})-differential privacy after {rounds} rounds: "
            f"updates clipped to {settings.clipping_norm:g} on the {settings.clipping}, Gaussian noise "
            f"multiplier {settings.noise_multiplier:g}, client sample rate {sample_rate:.3g}; "
            f"num_examples and client metrics travel in the clear and are not covered")
    if settings.log_client_norms:
        note += "; DEBUG: per-client update norms were logged (log_client_norms), not covered by the guarantee"
    return {**settings.model_dump(exclude_none=True), "sample_rate": sample_rate, "rounds": rounds, "epsilon": epsilon,
            "accountant": "opacus RDPAccountant", "note": note}


class FixedClippingPrivacy(ModelAggregation):
    """Clip every update to ``C``, average, add ``N(0, (σ C / K)²)`` per coordinate.

    Args:
        settings: the run's :class:`DifferentialPrivacy`.
        sample_rate: clients a round / clients (the accountant's q).
    """

    def __init__(self, settings: DifferentialPrivacy, sample_rate: float) -> None:
        self.settings, self.sample_rate = settings, sample_rate

    def client_config(self) -> dict[str, Scalar]:
        """``{clipping_norm: C}`` under client-side clipping (the client clips), else nothing."""
        return {CLIPPING_NORM: self.settings.clipping_norm} if self.settings.clipping == "client" else {}

    def aggregate(self, models: ClientModels) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The privatised mean (see :meth:`ModelAggregation.aggregate`; ``weights`` are ignored).

        Returns:
            ``(state dict, {"weights": 1/K each, "privacy": {noise_std, epsilon and delta so
            far}})``; with ``log_client_norms``, also the update norms before clipping and the
            clients whose update was clipped here.
        """
        current, clients, arrays = models.current, models.clients, models.arrays
        clipping_norm = self.settings.clipping_norm
        keys = floating_keys(current, arrays[0])
        start = flatten(current, keys)
        clipped, norms = clip_to_norm(stacked_updates(arrays, start, keys), clipping_norm)
        noise_std = self.settings.noise_multiplier * clipping_norm / len(arrays)
        noise = torch.randn(start.shape, generator=models.generator, dtype=torch.float64) * noise_std
        state = {name: tensor.detach().clone() for name, tensor in current.items()}
        state.update(unflatten(start + clipped.mean(dim=0) + noise, current, keys))
        for name in state:  # post-processing (no privacy cost): a variance the noise made negative
            if name.endswith("running_var"):  # would make BatchNorm output NaN
                state[name] = state[name].clamp(min=0.0)
        telemetry = {
            "weights": {str(c): 1.0 / len(clients) for c in clients},
            "privacy": {
                "noise_std": noise_std,
                "epsilon": privacy_spent(self.settings.noise_multiplier, self.sample_rate, models.round_number,
                                         self.settings.delta),
                "delta": self.settings.delta,
            },
        }
        if self.settings.log_client_norms:  # debugging only: outside the guarantee (module docstring)
            telemetry["privacy"].update({
                "update_norms_before_clipping": norms.tolist(),
                "clipped_here": [c for c, norm in zip(clients, norms.tolist()) if norm > clipping_norm * (1 + 1e-6)],
            })
        return state, telemetry
