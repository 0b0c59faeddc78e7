"""The engine / algorithm boundary: what every federated method provides (see DESIGN.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import ClientInfo, Payload, Reply, RoundSummary


class ServerStrategy(ABC):
    """The server side of a method: decides what each client receives and combines the replies.

    Attributes:
        requires_every_client: ``True`` for a method whose round is meaningless without a reply
            from every selected client; the engine then stops the run with one message naming the
            lost clients instead of aggregating the others (default ``False``: a lost client is
            dropped and the round goes on).
    """

    requires_every_client: bool = False

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

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class ClientTrainer(ABC):
    """The client side of a method: trains on one client's data, sees nothing else."""

    @abstractmethod
    def fit(self, payload: Payload, data: ClientData, state: dict[str, Any]) -> Reply:
        """Train locally from ``payload`` and return the reply.

        Args:
            payload: what the server sent this client this round.
            data: the client's training data only.
            state: persistent per-client dict, kept across rounds and checkpoints (e.g. a
                control variate or a discriminator); the trainer may read and write it.
        """
