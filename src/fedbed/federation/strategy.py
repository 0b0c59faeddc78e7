"""The engine / algorithm boundary: what every federated method provides.

The contract the engine enforces (docs/architecture.md, "The contract between the engine and a
method") is written into :class:`ServerStrategy` and :class:`ClientTrainer` below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from fedbed.federation.local_data import ClientData, UnlabeledImages
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary


class TooFewReplies(ValueError):
    """Raised by a strategy whose aggregation cannot work with the round's replies (a robust rule
    that needs more clients than replied): the engine keeps the previous model for the round and
    logs the message."""


class ServerStrategy(ABC):
    """The server side of a method: decides what each client receives and combines the replies.

    The engine's contract:

    - :meth:`configure_round` returns one :class:`Payload` per selected client. Its ``arrays`` are
      the model the client starts from: a reply lacking one of them, or returning one of another
      shape or dtype, or with non-finite values, or with no training example, is dropped from the
      round with the reason logged (:func:`fedbed.federation.engine.check_reply`), and the
      alignment telemetry measures ``reply − payload`` over them. Anything else the client
      should read goes into ``read_only_arrays`` (never checked, averaged or measured; its bytes
      are counted) or, for scalars, ``config``. The engine adds ``round``, ``rounds`` (the run's
      total) and ``batch_seed`` to ``config``.
    - :meth:`aggregate` receives only the replies that passed the checks.
    - Everything the strategy needs to continue goes into :meth:`state_dict`, saved after every
      round; a run resumed from it must equal an uninterrupted run bit for bit. torch's global
      generator is not checkpointed: the strategy may draw from it in :meth:`initialize` (the
      engine seeds it just before), and otherwise only from generators seeded from the run's
      seed and the round.
    - The strategy never sees a client's samples or its persistent state.

    Attributes:
        requires_every_client: ``True`` for a method whose round is meaningless without a reply
            from every selected client; the engine then stops the run with one message naming the
            lost clients instead of aggregating the others (default ``False``: a lost client is
            dropped and the round goes on).
        auxiliary_array_prefixes: names of payload ``arrays`` that are not the model (FedIIR's
            gradient slots, ``fediir_mean_gradient/``): checked like the others, but left out of
            the clients' updates that the alignment telemetry and the ``update_norm_factor``
            check measure.
    """

    requires_every_client: bool = False
    auxiliary_array_prefixes: tuple[str, ...] = ()

    @abstractmethod
    def initialize(self, model: nn.Module, clients: list[ClientInfo]) -> None:
        """Take the freshly initialised model and the clients' ids and sizes before round 1."""

    @abstractmethod
    def configure_round(self, round_number: int, selected: list[int]) -> dict[int, Payload]:
        """Return one :class:`Payload` per selected client id (round numbers start at 1)."""

    @abstractmethod
    def aggregate(self, round_number: int, replies: dict[int, Reply]) -> RoundSummary:
        """Update the server state from the replies of the clients that finished the round."""

    @abstractmethod
    def global_model(self) -> nn.Module:
        """The model evaluation sees."""

    def evaluation_models(self) -> list[tuple[nn.Module, tuple[int, ...] | None]]:
        """Models to evaluate, each with the source domains whose holdout measures its id accuracy.

        ``None`` means every source domain. The default is the global model alone; Local-only
        returns each client's model with that client's domains.
        """
        return [(self.global_model(), None)]

    def receive_adaptation_target(self, images: UnlabeledImages) -> None:
        """Under the ``domain_adaptation`` protocol, the engine hands the strategy the target
        domain's unlabelled adaptation share once, after :meth:`initialize` (a type without
        labels: the strategy cannot read one). Ignored by default: a domain-generalisation
        method trains without it."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class ClientTrainer(ABC):
    """The client side of a method: trains on one client's data, sees nothing else.

    The engine's contract:

    - :meth:`fit` returns a :class:`Reply` holding an array for every name in the payload's
      ``arrays`` (same shape and dtype), ``num_examples > 0`` and scalar metrics; never samples and
      never client state. It does not send back ``read_only_arrays``.
    - Whatever a client must remember between rounds (priors, a discriminator, a momentum
      encoder, an optimiser state) lives in the ``state`` dict, never on ``self``: in-process one
      trainer instance serves every client in turn, on Flower each node has its own instance and
      process. The engine checkpoints the states with the run (in-process) or keeps them in the
      Flower node's ``context.state``.
    - Randomness comes from the payload's ``batch_seed`` (torch's global generator is seeded with
      it before :meth:`fit`; the batch order and augmentations derive their own generators from
      it), so a client computes the same reply on every backend and after a resumption.
    """

    @abstractmethod
    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        """Train locally from ``payload`` and return the reply.

        Args:
            payload: what the server sent this client this round.
            data: the client's training data only.
            state: persistent per-client dict, kept across rounds and checkpoints (e.g. a
                control variate or a discriminator); the trainer may read and write it.
        """
