"""Engine: resume equality, dropped clients, model selection, target isolation."""

import json
import math

import pytest
import torch

from fedbed.algorithms import ALGORITHMS
from fedbed.algorithms.base.local_training import SupervisedTrainer
from fedbed.algorithms.fedavg import FedAvg
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.engine import EngineError, run_rounds
from fedbed.federation.evaluation import format_domain_table, mean_of_last_evaluations, select_round
from fedbed.federation.messages import Reply
from tests.helpers import build_federation


def run(federation, rounds, run_dir, resume=False):
    return run_rounds(
        federation, rounds=rounds, seed=5, participation_fraction=1.0, eval_every=1,
        run_dir=run_dir, resume=resume, progress=False,
    )


@pytest.mark.parametrize(
    "algorithm, hp",
    [("fedavg", {}), ("agrrand", {}), ("local", {}), ("fedsr", {}), ("hfedf", {"ema_warmup_rounds": 1}),
     ("fedavg", {"client_optimizer": "sgd", "client_momentum": 0.9, "client_optimizer_state": "kept"})],
)
def test_resume_equals_an_uninterrupted_run(tmp_path, algorithm, hp):
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight_dir.mkdir(), split_dir.mkdir()
    straight = build_federation(algorithm=algorithm, hp=hp)
    straight_evaluations = run(straight, 4, straight_dir)
    first_half = build_federation(algorithm=algorithm, hp=hp)
    run(first_half, 2, split_dir)
    resumed = build_federation(algorithm=algorithm, hp=hp)  # a fresh process rebuilds everything, then loads the checkpoint
    evaluations = run(resumed, 4, split_dir, resume=True)
    for (model, _), (other, _) in zip(straight.strategy.evaluation_models(), resumed.strategy.evaluation_models()):
        for key, value in model.state_dict().items():
            assert torch.equal(value, other.state_dict()[key]), key
    assert [e["round"] for e in evaluations] == [1, 2, 3, 4]
    assert [e["ood_mean"] for e in evaluations] == [e["ood_mean"] for e in straight_evaluations]
    assert len((split_dir / "rounds.jsonl").read_text().splitlines()) == 4


class FlakyTrainer(SupervisedTrainer):
    """Client 0 raises, client 1 returns NaN, client 2 behaves."""

    calls = 0

    def fit(self, payload, data, state):
        reply = super().fit(payload, data, state)
        FlakyTrainer.calls += 1
        if FlakyTrainer.calls % 3 == 1:
            raise RuntimeError("disk full")
        if FlakyTrainer.calls % 3 == 2:
            return Reply({k: v * float("nan") if v.is_floating_point() else v for k, v in reply.arrays.items()}, reply.num_examples)
        return reply


def test_failing_clients_are_dropped_with_a_reason(tmp_path):
    federation = build_federation(trainer_class=FlakyTrainer)
    run(federation, 1, tmp_path)
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["dropped"]["0"].startswith("raised RuntimeError: disk full")
    assert "non-finite" in record["dropped"]["1"]
    assert record["telemetry"]["weights"] == {"2": 1.0}
    assert all(torch.isfinite(v).all() for v in federation.strategy.global_model().state_dict().values() if v.is_floating_point())


def test_a_method_that_needs_every_client_stops_naming_the_lost_one(tmp_path):
    federation = build_federation(trainer_class=FlakyTrainer)
    federation.strategy.requires_every_client = True
    with pytest.raises(EngineError, match=r"needs every selected client, and lost client 0: raised RuntimeError: disk full; client 1: .*non-finite"):
        run(federation, 1, tmp_path)


def test_reply_checks():
    from fedbed.federation.engine import check_reply

    sent = {"w": torch.zeros(2, 2), "steps": torch.tensor(3)}
    assert check_reply(Reply({"w": torch.ones(2, 2), "steps": torch.tensor(4)}, 5), sent) is None
    assert "missing" in check_reply(Reply({"w": torch.ones(2, 2)}, 5), sent)
    assert "expected" in check_reply(Reply({"w": torch.ones(3), "steps": torch.tensor(4)}, 5), sent)
    assert "expected" in check_reply(Reply({"w": torch.ones(2, 2, dtype=torch.float64), "steps": torch.tensor(4)}, 5), sent)
    assert "positive" in check_reply(Reply({"w": torch.ones(2, 2), "steps": torch.tensor(4)}, 0), sent)


def test_selection_skips_unscored_rounds():
    log = [{"round": 1, "id_mean": float("nan"), "ood_mean": 5.0}, {"round": 2, "id_mean": 40.0, "ood_mean": 1.0}]
    assert select_round(log, "train_domain_val")["round"] == 2


def test_a_rule_without_a_scored_round_chooses_none_and_says_why():
    """A site's share of the id holdouts missing from every evaluation: the run still ends with a
    summary (the table prints "–" for the round) instead of failing after its last round."""
    nan = float("nan")
    log = [{"round": r, "id": {"a": nan}, "ood": {"t": 10.0 * r}, "id_mean": nan, "ood_mean": 10.0 * r} for r in (1, 2)]
    chosen = select_round(log, "train_domain_val")
    assert chosen["round"] is None and chosen["selection"] == "train_domain_val"
    assert chosen["unavailable"] == "no evaluated round has a id_mean score to select by train_domain_val"
    assert math.isnan(chosen["ood_mean"]) and list(chosen["ood"]) == ["t"] and math.isnan(chosen["ood"]["t"])
    assert select_round(log, "oracle")["round"] == 2
    selected = {rule: select_round(log, rule) for rule in ("last", "train_domain_val")}
    table = format_domain_table(selected)
    assert table.splitlines()[-1].split() == ["train_domain_val", "–", "–", "–", "–", "–"]
    # The Flower backends print the summary read back from summary.json, where NaN is null.
    import json

    from fedbed.jsonlog import to_json

    assert format_domain_table(json.loads(to_json(selected))) == table


def test_selection_rules_on_a_synthetic_log():
    log = [
        {"round": 1, "id_mean": 50.0, "ood_mean": 90.0},
        {"round": 2, "id_mean": 70.0, "ood_mean": 10.0},
        {"round": 3, "id_mean": 70.0, "ood_mean": 20.0},
        {"round": 4, "id_mean": 60.0, "ood_mean": 30.0},
    ]
    assert select_round(log, "last")["round"] == 4
    chosen = select_round(log, "train_domain_val")
    assert chosen["round"] == 2 and chosen["selection"] == "train_domain_val"  # ties: earliest; ood ignored
    oracle = select_round(log, "oracle")
    assert oracle["round"] == 1 and oracle["selection"] == "oracle"
    with pytest.raises(ValueError):
        select_round(log, "best")


def test_the_mean_of_the_last_five_evaluations_by_hand():
    nan = float("nan")
    log = [{"round": r, "metric": "accuracy", "id": {"a": 10.0 * r, "b": nan if r == 6 else 1.0},
            "ood": {"t": float(r)}, "id_mean": 5.0 * r, "ood_mean": float(r)} for r in range(1, 7)]
    mean = mean_of_last_evaluations(log)  # rounds 2-6: ood (2+3+4+5+6)/5 = 4; id a 40; b's NaN left out
    assert mean["rounds"] == [2, 3, 4, 5, 6] and mean["round"] == 6 and mean["selection"] == "last_five_mean"
    assert mean["ood"] == {"t": 4.0} and mean["ood_mean"] == 4.0 and mean["id"] == {"a": 40.0, "b": 1.0}
    assert mean["id_mean"] == 20.0
    assert mean_of_last_evaluations(log[:2])["ood_mean"] == 1.5  # fewer than five: all of them
    with pytest.raises(ValueError, match="no evaluated round"):
        mean_of_last_evaluations([])


class DomainRecordingTrainer(SupervisedTrainer):
    seen: set = set()

    def fit(self, payload, data, state):
        DomainRecordingTrainer.seen |= set(data.domains.tolist())
        return super().fit(payload, data, state)


def test_no_target_sample_reaches_training(tmp_path, monkeypatch):
    class Recording(FedAvg):
        name = "recording"

        def create_trainer(self, hparams, context):
            return DomainRecordingTrainer(hparams, context)

    monkeypatch.setitem(ALGORITHMS, "recording", Recording)
    config = ExperimentConfig(algorithm="recording", model="lenet", target="30", rounds=1, local_steps=2, run_dir=tmp_path)
    summary = run_experiment(config, progress=False, echo=lambda *_: None)
    assert DomainRecordingTrainer.seen == {0, 1, 3, 4, 5}  # every source domain, never 30 degrees (id 2)
    assert set(summary["selection"]["train_domain_val"]["id"]) == {"0", "15", "45", "60", "75"}


def test_one_round_is_a_function_whose_record_is_the_logged_line(tmp_path):
    from fedbed.federation.engine import run_round

    alone = build_federation()
    record, evaluation = run_round(alone, 1, rounds=2, seed=5, participation_fraction=1.0, eval_every=2)
    assert evaluation is None and record["evaluation"] is None and list(tmp_path.iterdir()) == []
    run(build_federation(), 1, tmp_path)
    logged = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert list(record) == list(logged)
    assert record["dropped"] == logged["dropped"] == {} and record["metrics"] == logged["metrics"]
