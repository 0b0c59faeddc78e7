"""FedAvg (McMahan et al., AISTATS 2017) and Central / DeepAll."""

from __future__ import annotations

from fedbed.algorithms.base.local_training import (
    LocalTrainingHyperparameters,
    SupervisedAlgorithm,
)
from fedbed.algorithms.base.model_aggregation import FedAvgStrategy, ModelAggregation
from fedbed.algorithms.base.registry import AlgorithmContext, register_algorithm
from fedbed.federation.strategy import ServerStrategy


@register_algorithm
class FedAvg(SupervisedAlgorithm):
    """Federated averaging (McMahan et al., AISTATS 2017), aggregation weights n_k/n."""

    name = "fedavg"
    summary = "FedAvg (McMahan et al. 2017): local training, n_k/n-weighted parameter average."
    hyperparameters = LocalTrainingHyperparameters
    server_rule = True  # its average is the server rule every other one replaces
    dataset_defaults = {  # hfedf.txt Table 10 (also Central's and Local's, App. C.8.2)
        "OfficeHome": {"client_weight_decay": 1e-5},
        "VLCS": {"client_lr": 1e-4},
    }

    def create_aggregation(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> ModelAggregation:
        return ModelAggregation()

    def create_strategy(self, hparams: LocalTrainingHyperparameters, context: AlgorithmContext) -> ServerStrategy:
        return FedAvgStrategy(context.seed)


@register_algorithm
class Central(FedAvg):
    """Central / DeepAll: every source domain pooled on one client; each round is plain training.

    The non-federated reference (hFedF Sec. 5.1 "Central"; PPDG Table 4 "DeepAll"). Its
    hyperparameters are FedAvg's, as in hFedF App. C.8.2.
    """

    name = "central"
    summary = "Central / DeepAll: all source data pooled, the non-federated reference."
    pooled = True
    server_rule = False
    server_rule_refusal = "pools every source domain on one client: there is nothing to combine"
