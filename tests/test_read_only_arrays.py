"""Read-only payload arrays: sent to a client, never echoed, checked, averaged or measured as an
update; their bytes count in the round's communication telemetry."""

from __future__ import annotations

import json

import torch

from fedbed.algorithms.base.local_training import SupervisedTrainer
from fedbed.algorithms.mcgdm import MCGDMStrategy
from fedbed.federation.engine import check_reply, client_updates
from fedbed.federation.messages import Payload, Reply
from tests.conftest import build_federation


class ReadsTheHeads(SupervisedTrainer):
    seen: list = []

    def fit(self, payload, data, state):
        ReadsTheHeads.seen.append(sorted({name.split("/")[0] for name in payload.read_only_arrays}))
        return super().fit(payload, data, state)


def test_reply_checks_and_updates_ignore_read_only_arrays():
    sent = Payload({"w": torch.zeros(2)}, read_only_arrays={"other": torch.ones(3)})
    reply = Reply({"w": torch.ones(2)}, num_examples=4)
    assert check_reply(reply, sent.arrays) is None  # "other" is not echoed, and need not be
    order, updates = client_updates({0: sent}, {0: reply})
    assert updates.shape == (1, 2)
    assert sent.num_bytes() == 2 * 4 + 3 * 4 and reply.num_bytes() == 2 * 4


def test_a_strategy_sends_read_only_arrays_and_the_round_counts_their_bytes(tmp_path):
    from fedbed.federation.engine import run_rounds

    ReadsTheHeads.seen = []
    federation = build_federation(trainer_class=ReadsTheHeads)
    strategy = MCGDMStrategy()  # FedAvg that also sends every client's previous head read-only (MCGDM Eq. 9)
    strategy.initialize(federation.strategy.global_model(), [])
    federation.strategy = strategy
    run_rounds(federation, rounds=2, seed=0, participation_fraction=1.0, eval_every=1, run_dir=tmp_path, progress=False)
    clients = federation.clients.num_clients
    assert ReadsTheHeads.seen == [[]] * clients + [[f"head{c}" for c in range(clients)]] * clients
    first, second = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    model_bytes = sum(t.numel() * t.element_size() for t in strategy.global_model().state_dict().values())
    head_bytes = sum(t.numel() * t.element_size() for n, t in strategy.global_model().state_dict().items() if n.startswith("classifier."))
    assert first["communication"]["sent_bytes"] == {str(c): model_bytes for c in range(clients)}
    assert second["communication"]["sent_bytes"] == {str(c): model_bytes + clients * head_bytes for c in range(clients)}
    assert second["communication"]["received_bytes"] == {str(c): model_bytes for c in range(clients)}
    assert second["dropped"] == {}
