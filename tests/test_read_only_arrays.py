"""Read-only payload arrays: sent to a client, never echoed, checked, averaged or measured as an
update; their bytes count in the round's communication telemetry. A client that edits a tensor it
was sent (read-only or not) in place is dropped, and the tensor put back."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fedbed.algorithms.base.local_training import SupervisedTrainer
from fedbed.algorithms.mcgdm import MCGDMStrategy
from fedbed.federation.engine import check_reply, client_update_gram, run_rounds
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.transport import InProcessClients, PayloadSnapshot
from tests.helpers import build_federation


class ReadsTheHeads(SupervisedTrainer):
    seen: list = []

    def fit(self, payload, data, state):
        ReadsTheHeads.seen.append(sorted({name.split("/")[0] for name in payload.read_only_arrays}))
        return super().fit(payload, data, state)


def test_reply_checks_and_updates_ignore_read_only_arrays():
    sent = Payload({"w": torch.zeros(2)}, read_only_arrays={"other": torch.ones(3)})
    reply = Reply({"w": torch.ones(2)}, num_examples=4)
    assert check_reply(reply, sent.arrays) is None  # "other" is not echoed, and need not be
    order, gram = client_update_gram({0: sent}, {0: reply})
    assert order == [0] and gram.tolist() == [[2.0]]  # ||(1, 1)||² over "w" alone
    assert sent.num_bytes() == 2 * 4 + 3 * 4 and reply.num_bytes() == 2 * 4


def test_a_strategy_sends_read_only_arrays_and_the_round_counts_their_bytes(tmp_path):
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


# In-place edits of what a client is sent: in this process the trainer holds the server's tensors.


class EditsWhatItIsSent(SupervisedTrainer):
    """Client 0 edits the first tensor of ``payload.<field>`` in place with ``edit``, then trains
    honestly; every client records what it was sent (after client 0's edit, for the others)."""

    field = "read_only_arrays"
    edit = staticmethod(lambda tensor: tensor.add_(1))
    seen: list = []

    def fit(self, payload, data, state):
        arrays = getattr(payload, self.field)
        EditsWhatItIsSent.seen.append({name: tensor.clone() for name, tensor in arrays.items()})
        if payload.config["client"] == 0 and arrays:
            self.edit(next(iter(arrays.values())))
        return super().fit(payload, data, state)


def record_what_is_sent(strategy):
    """Wrap ``strategy.configure_round`` to keep every round's sent tensors and a copy of each."""
    sent = []
    configure = strategy.configure_round

    def configure_and_record(round_number, selected):
        payloads = configure(round_number, selected)
        sent.append([(tensor, tensor.clone()) for payload in payloads.values()
                     for tensor in (*payload.arrays.values(), *payload.read_only_arrays.values())])
        return payloads

    strategy.configure_round = configure_and_record
    return sent


def test_a_client_that_edits_a_read_only_array_in_place_is_dropped_and_the_server_keeps_it(tmp_path):
    EditsWhatItIsSent.seen = []
    federation = build_federation(trainer_class=EditsWhatItIsSent)
    strategy = MCGDMStrategy()  # sends its own heads of the previous round read-only, the tensors it keeps
    strategy.initialize(federation.strategy.global_model(), [])
    federation.strategy = strategy
    sent = record_what_is_sent(strategy)
    run_rounds(federation, rounds=2, seed=0, participation_fraction=1.0, eval_every=0, run_dir=tmp_path, progress=False)
    first, second = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert first["dropped"] == {}  # round 1 sends no head: nothing to edit
    assert list(second["dropped"]) == ["0"]
    assert second["dropped"]["0"].startswith("edited a read-only payload array 'head0/weight' in place")
    assert sorted(second["telemetry"]["weights"]) == ["1", "2"]
    assert all(torch.equal(tensor, before) for tensor, before in sent[1])  # the server's heads are put back
    clients = federation.clients.num_clients
    round_two = EditsWhatItIsSent.seen[clients:]
    for later in round_two[1:]:  # the clients after client 0 were sent the heads unedited
        assert all(torch.equal(later[name], round_two[0][name]) for name in round_two[0])


class RaisesForClient0(SupervisedTrainer):
    def fit(self, payload, data, state):
        if payload.config["client"] == 0:
            raise RuntimeError("gone")
        return super().fit(payload, data, state)


def test_a_client_that_edits_its_payload_arrays_in_place_is_dropped_and_the_others_are_unaffected(tmp_path):
    (tmp_path / "edits").mkdir(), (tmp_path / "fails").mkdir()
    EditsWhatItIsSent.seen = []
    EditsWhatItIsSent.field, EditsWhatItIsSent.edit = "arrays", staticmethod(lambda tensor: tensor.mul_(0))
    try:
        federation = build_federation(trainer_class=EditsWhatItIsSent)
        sent = record_what_is_sent(federation.strategy)
        run_rounds(federation, rounds=2, seed=0, participation_fraction=1.0, eval_every=0, run_dir=tmp_path / "edits",
                   progress=False)
    finally:
        EditsWhatItIsSent.field, EditsWhatItIsSent.edit = "read_only_arrays", staticmethod(lambda tensor: tensor.add_(1))
    records = [json.loads(line) for line in (tmp_path / "edits" / "rounds.jsonl").read_text().splitlines()]
    first_array = next(iter(federation.strategy.global_model().state_dict()))
    for record in records:
        assert list(record["dropped"]) == ["0"]
        assert record["dropped"]["0"].startswith(f"edited a payload array '{first_array}' in place")
    assert all(torch.equal(tensor, before) for round_sent in sent for tensor, before in round_sent)
    # The same run in which client 0 simply fails ends at the same model, bit for bit: the clients
    # after client 0 started from the arrays the server sent, not from client 0's edit.
    failing = build_federation(trainer_class=RaisesForClient0)
    run_rounds(failing, rounds=2, seed=0, participation_fraction=1.0, eval_every=0, run_dir=tmp_path / "fails",
               progress=False)
    edited_model, failed_model = federation.strategy.global_model().state_dict(), failing.strategy.global_model().state_dict()
    assert all(torch.equal(edited_model[name], failed_model[name]) for name in edited_model)


def test_an_honest_client_is_not_dropped_and_what_it_is_sent_is_unchanged(tmp_path):
    federation = build_federation(trainer_class=ReadsTheHeads)
    strategy = MCGDMStrategy()
    strategy.initialize(federation.strategy.global_model(), [])
    federation.strategy = strategy
    sent = record_what_is_sent(strategy)
    run_rounds(federation, rounds=2, seed=0, participation_fraction=1.0, eval_every=0, run_dir=tmp_path, progress=False)
    assert [json.loads(line)["dropped"] for line in (tmp_path / "rounds.jsonl").read_text().splitlines()] == [{}, {}]
    assert all(torch.equal(tensor, before) for round_sent in sent for tensor, before in round_sent)


def _alias_as_parameter_data_then_step(tensor):
    """A model whose parameter's ``.data`` is the sent tensor: the optimiser step writes the
    tensor's memory without counting a version (what ``tensor._version`` would miss)."""
    layer = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
    layer.weight.data = tensor
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(torch.ones(1, tensor.shape[1])).sum().backward()
    optimizer.step()


def _load_state_dict_into_an_aliasing_parameter(tensor):
    layer = nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
    layer.weight = nn.Parameter(tensor)
    layer.load_state_dict({"weight": torch.full_like(tensor, 7.0)})


@pytest.mark.parametrize("edit", [
    lambda tensor: tensor.add_(1),
    lambda tensor: tensor.mul_(0),
    lambda tensor: tensor.copy_(torch.zeros_like(tensor)),
    lambda tensor: tensor[0].fill_(float("nan")),
    lambda tensor: tensor.data.add_(1),  # bypasses tensor._version
    lambda tensor: tensor.numpy().__setitem__((0, 0), -1.0),  # bypasses tensor._version
    _alias_as_parameter_data_then_step,  # bypasses tensor._version
    _load_state_dict_into_an_aliasing_parameter,
], ids=["add_", "mul_", "copy_", "view fill_ nan", "data", "numpy", "parameter data alias", "load_state_dict alias"])
def test_the_snapshot_finds_every_kind_of_in_place_edit_and_puts_the_tensor_back(edit):
    sent = Payload({"w": torch.arange(1.0, 7.0).view(3, 2)}, read_only_arrays={"other": torch.ones(2)})
    original = sent.arrays["w"]
    snapshot = PayloadSnapshot([sent])
    assert snapshot.restore_edits(sent) is None
    edit(sent.arrays["w"])
    assert snapshot.restore_edits(sent).startswith("edited a payload array 'w' in place")
    assert sent.arrays["w"] is original and torch.equal(original, torch.arange(1.0, 7.0).view(3, 2))
    assert snapshot.restore_edits(sent) is None


def test_a_nan_that_was_sent_is_not_an_edit():
    sent = Payload({"w": torch.tensor([1.0, float("nan")])})
    assert PayloadSnapshot([sent]).restore_edits(sent) is None


class ReturnsWhatItWasSent:
    """Keeps and returns the very tensors it was sent, and rewrites its payload's dicts."""

    def fit(self, payload, data, state):
        state["kept"] = payload.arrays["w"]
        payload.arrays["extra"] = torch.zeros(1)
        payload.read_only_arrays.clear()
        payload.config["batch_seed"] = -1
        return Reply({"w": payload.arrays["w"], "v": payload.arrays["v"][:1]}, num_examples=1)


def test_a_reply_never_shares_memory_with_the_payload_and_dict_edits_stay_with_the_trainer():
    sent = Payload({"w": torch.ones(2), "v": torch.zeros(3)}, config={"batch_seed": 4},
                   read_only_arrays={"other": torch.ones(1)})
    clients = InProcessClients(ReturnsWhatItWasSent(), [None])
    reply = clients.fit_round({0: sent})[0]
    assert isinstance(reply, Reply)  # returning the start unchanged is no edit
    assert reply.arrays["w"] is not sent.arrays["w"] and torch.equal(reply.arrays["w"], sent.arrays["w"])
    assert reply.arrays["v"].untyped_storage().data_ptr() != sent.arrays["v"].untyped_storage().data_ptr()
    assert list(sent.arrays) == ["w", "v"] and list(sent.read_only_arrays) == ["other"]
    assert sent.config == {"batch_seed": 4}
