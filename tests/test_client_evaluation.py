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
from fedbed.federation.evaluation import add_statistics, evaluate_models, metric_statistics, score_from_statistics
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
    assert whole == {"n": 4.0, "correct": 2.0} and score_from_statistics(whole) == 50.0
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
                             "model0/domain1/n": 2.0, "model0/domain1/correct": 2.0}
    statistics, dropped = combine_client_statistics(payloads, {0: reply, 1: "its SuperNode left the federation"})
    assert statistics == {(0, 0): {"n": 2.0, "correct": 1.0}}  # domain 1 lacks client 1's share
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
