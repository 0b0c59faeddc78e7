"""id evaluation on the clients: additive metric statistics, holdout shares, equal scores."""

import json
import math

import pytest
import torch
from torch import nn

from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.client_evaluation import (
    ClientEvaluator,
    combine_client_statistics,
    evaluation_payloads,
    holdout_shares,
)
from fedbed.federation.evaluation import (
    add_statistics,
    collapse_of,
    evaluate_models,
    metric_statistics,
    score_from_statistics,
    top_class,
)
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Reply


class Fixed(nn.Module):
    """Returns the first ``width`` input features as the output (a 'model' whose outputs we choose)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.scale * inputs.flatten(1)[:, : self.width]


def samples(outputs: list[list[float]], targets: list, domains: list[int]) -> ClientData:
    return ClientData(torch.tensor(outputs).view(len(outputs), 1, 1, -1), torch.tensor(targets), torch.tensor(domains))


def test_statistics_add_up_to_the_metric_on_the_whole_set():
    # Classification, by hand: predictions 1, 0, 1, 1 against labels 1, 1, 1, 0 -> 2 of 4 correct.
    data = samples([[0, 1], [1, 0], [0, 2], [0, 3]], [1, 1, 1, 0], [0, 0, 0, 0])
    whole = metric_statistics(Fixed(2), data)
    # ... and predicted class 0 once, class 1 three times: the most-predicted class is 1, at 3/4.
    assert whole == {"n": 4.0, "correct": 2.0, "predicted_0": 1.0, "predicted_1": 3.0} and score_from_statistics(whole) == 50.0
    assert top_class(whole) == (1, 0.75)
    halves = [metric_statistics(Fixed(2), data.subset(s))
              for s in (slice(0, 1), slice(1, 4))]
    assert add_statistics(halves) == whole
    # Regression, by hand: x = (1, 2, 3), y = (1, 3, 2): n Σxy − Σx Σy = 3·13 − 36 = 3,
    # n Σxx − (Σx)² = 42 − 36 = 6 = n Σyy − (Σy)², so r = 3 / 6 = 0.5.
    regression = samples([[1.0], [2.0], [3.0]], [1.0, 3.0, 2.0], [0, 0, 0])
    assert score_from_statistics(metric_statistics(Fixed(1), regression, "regression"), "regression") == pytest.approx(0.5)
    constant = samples([[1.0], [1.0], [1.0]], [1.0, 3.0, 2.0], [0, 0, 0])
    assert math.isnan(score_from_statistics(metric_statistics(Fixed(1), constant, "regression"), "regression"))
    empty = ClientData(torch.zeros(0, 1, 1, 2), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert math.isnan(score_from_statistics(metric_statistics(Fixed(2), empty)))


def test_holdout_shares_split_each_domain_among_its_holders():
    holdout = {0: torch.arange(0, 5), 1: torch.arange(10, 14), 2: torch.arange(20, 23)}
    shares = holdout_shares(holdout, [(0, 1), (1,), (0, 2)])
    assert shares[0].tolist() == [0, 1, 2, 10, 11]  # first half of domain 0 (3 of 5), first of domain 1
    assert shares[1].tolist() == [12, 13]
    assert shares[2].tolist() == [3, 4, 20, 21, 22]
    assert sorted(torch.cat(shares).tolist()) == sorted(torch.cat(list(holdout.values())).tolist())


def test_a_lost_client_leaves_its_domains_unscored_not_half_scored():
    models = [(Fixed(2), None)]
    payloads = evaluation_payloads(models, [(0, 1), (1,)])
    assert payloads[0].config == {"model0/domains": "0,1"} and payloads[1].config == {"model0/domains": "1"}
    assert payloads[0].arrays == {} and set(payloads[0].read_only_arrays) == {"model0/scale"}
    data = samples([[0, 1], [1, 0], [0, 2], [3, 0]], [1, 1, 1, 0], [0, 0, 1, 1])
    evaluator = ClientEvaluator(lambda: Fixed(2))
    reply = evaluator.evaluate(payloads[0], data)
    assert reply.arrays == {} and reply.num_examples == 4
    assert reply.metrics == {"model0/domain0/n": 2.0, "model0/domain0/correct": 1.0,
                             "model0/domain0/predicted_0": 1.0, "model0/domain0/predicted_1": 1.0,
                             "model0/domain1/n": 2.0, "model0/domain1/correct": 2.0,
                             "model0/domain1/predicted_0": 1.0, "model0/domain1/predicted_1": 1.0}
    statistics, dropped = combine_client_statistics(payloads, {0: reply, 1: "its SuperNode left the federation"})
    # domain 1 lacks client 1's share
    assert statistics == {(0, 0): {"n": 2.0, "correct": 1.0, "predicted_0": 1.0, "predicted_1": 1.0}}
    assert dropped == {"1": "its SuperNode left the federation"}
    scores = evaluate_models(models, {0: data, 1: data}, {}, ("a", "b"), id_statistics=statistics)
    assert scores["id"]["a"] == 50.0 and math.isnan(scores["id"]["b"]) and math.isnan(scores["id_mean"])
    _, incomplete = combine_client_statistics(payloads, {0: Reply({}, 4, {}), 1: reply})
    assert "lacks the statistics" in incomplete["0"]


@pytest.mark.parametrize("algorithm", ["local", "hfedf"])  # a model per client, trained or generated
def test_scores_on_the_clients_equal_the_servers(tmp_path, algorithm):
    def run(site):
        config = ExperimentConfig(algorithm=algorithm, model="lenet", rounds=1, local_steps=2, batch_size=16, partition="domains_per_client",
                                  num_clients=3, domains_per_client=2, seed=1, id_evaluation=site, run_dir=tmp_path / site)
        run_experiment(config, progress=False, echo=lambda *_: None)
        return [json.loads(line) for line in (tmp_path / site / "rounds.jsonl").read_text().splitlines()]

    server, clients = run("server"), run("clients")
    for mine, theirs in zip(server, clients):
        assert theirs["evaluation"] == mine["evaluation"]  # exact: the shares' counts add up
        assert theirs["metrics"] == mine["metrics"] and theirs["evaluation_dropped"] == {}


def test_a_model_predicting_one_class_is_reported_as_collapsed_after_three_evaluations_in_a_row():
    """The pooled source holdouts' most-predicted class and its share are in every evaluation;
    three evaluations in a row at 90% or more of a single class mark the run as collapsed, from
    the first of them."""
    one_class = samples([[0, 1], [0, 2], [0, 3], [1, 0]], [1, 1, 0, 0], [0, 0, 1, 1])  # predicts 1, 1, 1, 0
    scores = evaluate_models([(Fixed(2), None)], {0: one_class.subset(one_class.domains == 0),
                                                 1: one_class.subset(one_class.domains == 1)}, {}, ("a", "b"))
    assert scores["top_class"] == {"id": [1, 0.75], "id_domains": {"a": [1, 1.0], "b": [0, 0.5]}, "ood": {}}

    def evaluation(round_number, cls, share):
        return {"round": round_number, "top_class": {"id": [cls, share]}}

    healthy = [evaluation(r, 3, 0.5) for r in range(1, 6)]
    assert collapse_of(healthy) is None
    two_then_break = [evaluation(1, 3, 0.95), evaluation(2, 3, 0.97), evaluation(3, 3, 0.5), evaluation(4, 3, 0.99)]
    assert collapse_of(two_then_break) is None
    jumping = [evaluation(1, 3, 0.95), evaluation(2, 4, 0.97), evaluation(3, 3, 0.99)]
    assert collapse_of(jumping) == {"round": 1, "class": 3, "share": 0.95, "evaluations": 3}  # one class at a time
    collapsed = [evaluation(1, 2, 0.4), evaluation(2, 3, 0.91), evaluation(3, 3, 0.95), evaluation(4, 3, 1.0)]
    assert collapse_of(collapsed) == {"round": 2, "class": 3, "share": 0.91, "evaluations": 3}
    assert collapse_of([{"round": 1}, {"round": 2, "top_class": None}]) is None  # records made before the counts


def test_reports_mark_the_cells_of_a_collapsed_run_and_name_it():
    from fedbed.reporting import collapse_notes, score_table

    healthy = {"selection": {"last": {"ood_mean": 50.0, "id_mean": 60.0}}, "target": "t", "seed": 0, "label": "m"}
    collapsed = {**healthy, "seed": 1, "collapse": {"round": 3, "class": 2, "share": 0.95, "evaluations": 4}}
    other = {**healthy, "label": "n"}
    rows = score_table([healthy, collapsed, other], ["m", "n"], ["t"], ["last"], "ood", "std", "label", False)
    assert rows[1] == ["m", "50.0 ± 0.0 †"] and rows[2] == ["n", "50.0"]
    assert collapse_notes([healthy, collapsed]) == [
        "† collapsed: m, target t, seed 1: class 2 predicted for 95% of the source holdouts from round 3"]


def test_a_run_whose_model_collapses_says_so_once_and_records_it(tmp_path):
    """FedAvg at a learning rate of 50 predicts one digit for every holdout image from round 1."""
    from fedbed.experiment import ExperimentConfig, run_experiment

    printed = []
    summary = run_experiment(ExperimentConfig(algorithm="fedavg", model="lenet", rounds=3, local_steps=3,
                                              hp={"client_lr": 50.0}, run_dir=tmp_path), progress=False, echo=printed.append)
    assert summary["collapse"]["round"] == 1 and summary["collapse"]["share"] >= 0.9
    warnings = [line for line in printed if line.startswith("warning: the model collapsed")]
    assert len(warnings) == 1 and f"predicts {summary['collapse']['class']} for" in warnings[0]
