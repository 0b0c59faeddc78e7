"""Client states: kept only for methods that have them, in files for many clients, resumed exactly."""

import pytest
import torch

from fedbed.algorithms.base.local_training import SupervisedTrainer, proximal_term
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.checkpoints import EngineError
from fedbed.federation.client_states import ClientStates
from fedbed.federation.engine import run_rounds
from fedbed.run_directory import CHECKPOINT_NAME
from tests.helpers import build_federation


def run(federation, rounds, run_dir, resume=False, eval_every=0):
    return run_rounds(federation, rounds=rounds, seed=5, participation_fraction=1.0, eval_every=eval_every,
                      run_dir=run_dir, resume=resume, progress=False)


def spilled(federation, folder):
    """``federation`` with its client states in files under ``folder`` (as a run of many clients keeps them)."""
    federation.clients.states = ClientStates(federation.clients.num_clients, folder, spill_above=0)
    return federation


class RememberingTrainer(SupervisedTrainer):
    """A client with state: it keeps its last trained model and is pulled towards it the next round."""

    def batch_loss(self, model, batch, payload, state):
        loss = super().batch_loss(model, batch, payload, state)
        return loss + proximal_term(model, state["previous"], 0.5) if "previous" in state else loss

    def end_round(self, model, state):
        state["previous"] = clone_arrays(model.state_dict())


def test_a_fedavg_client_keeps_nothing_between_rounds(tmp_path):
    folder = tmp_path / "client-states"
    federation = spilled(build_federation(algorithm="fedavg"), folder)
    run(federation, 1, tmp_path)
    assert not folder.exists()  # no state written for any client
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=False)["client_states"] == {"files": {}, "next_version": 0}
    in_memory = ClientStates(3)
    in_memory.keep(1, {})
    assert in_memory.state_dict() == [{}, {}, {}] and in_memory[1] == {}
    with pytest.raises(IndexError, match="not one of the run's 3 clients"):
        in_memory[3]


def test_states_in_files_resume_bit_identically_and_stale_files_go(tmp_path):
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight_dir.mkdir(), split_dir.mkdir()
    folder = split_dir / "client-states"
    straight = build_federation(trainer_class=RememberingTrainer)  # its states in memory
    straight_evaluations = run(straight, 3, straight_dir, eval_every=3)
    first_half = spilled(build_federation(trainer_class=RememberingTrainer), folder)
    run(first_half, 2, split_dir, eval_every=3)
    index = torch.load(split_dir / CHECKPOINT_NAME, weights_only=False)["client_states"]
    assert sorted(index["files"]) == ["0", "1", "2"]
    assert all((folder / name).is_file() for name in index["files"].values())
    assert all(set(first_half.clients.states[k]) == {"previous"} for k in range(3))
    (folder / "0-99.pt").write_bytes(b"written by a round that did not finish")
    resumed = spilled(build_federation(trainer_class=RememberingTrainer), folder)
    evaluations = run(resumed, 3, split_dir, resume=True, eval_every=3)
    for (model, _), (other, _) in zip(straight.strategy.evaluation_models(), resumed.strategy.evaluation_models()):
        for key, value in model.state_dict().items():
            assert torch.equal(value, other.state_dict()[key]), key
    assert evaluations[-1]["ood_mean"] == straight_evaluations[-1]["ood_mean"]
    for client in range(3):
        for key, value in straight.clients.states[client]["previous"].items():
            assert torch.equal(value, resumed.clients.states[client]["previous"][key])
    named = set(torch.load(split_dir / CHECKPOINT_NAME, weights_only=False)["client_states"]["files"].values())
    left = {path.name for path in folder.iterdir()}
    # the checkpoint's files and, until the next checkpoint is written, the ones the one before named
    assert named <= left and len(left - named) <= 3 and "0-99.pt" not in left


def test_a_checkpoint_naming_missing_files_is_refused(tmp_path):
    states = ClientStates(2, tmp_path / "client-states", spill_above=0)
    with pytest.raises(EngineError, match="0-3.pt that the checkpoint names are missing"):
        states.load_state_dict({"files": {"0": "0-3.pt"}, "next_version": 4})
    states.load_state_dict([{"x": torch.ones(2)}, {}])  # an in-memory checkpoint's layout, now in files
    assert [path.name for path in (tmp_path / "client-states").iterdir()] == ["0-0.pt"]
    assert torch.equal(states[0]["x"], torch.ones(2)) and states[1] == {}
