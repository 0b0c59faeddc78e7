"""Linear evaluation of a representation: the ``linear_probe`` evaluation protocol.

The model's featurizer is frozen; a linear classifier is trained on the features of a seeded
labelled share of a domain's samples and tested on the rest of that domain (FedGaLA,
``fedgala.md`` Sec. 4 "Evaluation" and App. B.3: 10% or 30% labelled, 100 epochs of Adam with
learning rate 3e-3; the linear evaluation of SimCLR, Chen et al. 2020, Sec. 4). On the target
domain this reads target labels, which every output of a run using it states; on the source
domains' id holdouts it does not, so model selection by ``train_domain_val`` stays target-free.

The paper trains the probe on the encoder's raw features. Its ResNet-18 ends in batch
normalisation, which keeps their scale near one; an encoder without normalisation layers (hFedF's
client CNN) gives features whose scale ranges from about 0.02 per dimension untrained to 20
after self-supervised training, and 100 epochs of Adam at 3e-3 then under-train the probe on the
small features and train it unstably on the large ones. ``standardize_features`` z-scores
each feature with the labelled share's mean and standard deviation first: the probe's function
class is unchanged (an affine map of the features followed by a linear layer is a linear layer),
only its optimisation's conditioning is (``docs/results/pacs32-fedgala.md`` measures both).
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from fedbed.federation.local_data import ClientData
from fedbed.seeding import seeded_generator

PROBE_PURPOSE = 0x9B0BE
"""Mixed into the probe's seeds so its draws differ from every other draw of the run."""


class LinearProbe(BaseModel):
    """Settings of the linear probe (defaults: FedGaLA App. B.3).

    Attributes:
        labelled_fraction: share of each evaluated domain's samples whose labels train the probe
            (FedGaLA: 0.1 and 0.3); the rest measures its accuracy.
        epochs: passes over the labelled share (100).
        learning_rate: Adam's learning rate (3e-3).
        batch_size: samples per probe step.
        repeats: probes trained per evaluation, each on its own seeded share; the score is their
            mean (the paper repeats over a few seeds and reports mean ± std).
        standardize_features: z-score each feature dimension with the labelled share's mean and
            standard deviation (floored at 1e-6) before training and testing the probe (see the
            module docstring); unset or false: the raw features, as the paper.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    labelled_fraction: float = Field(0.1, gt=0, lt=1)
    epochs: int = Field(100, gt=0)
    learning_rate: float = Field(3e-3, gt=0)
    batch_size: int = Field(256, gt=0)
    repeats: int = Field(1, gt=0)
    standardize_features: bool | None = None

    def split(self, size: int, seed: int, domain: int, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(labelled indices, test indices)`` of a domain's ``size`` samples: a seeded draw of
        ``ceil(fraction * size)`` (at least one, leaving at least one) for the probe, the rest
        for its test. The same every round, so evaluations of different rounds compare alike.

        Raises:
            ValueError: fewer than two samples.
        """
        if size < 2:
            raise ValueError(f"a linear probe needs at least two samples of a domain, got {size}")
        order = torch.randperm(size, generator=seeded_generator(seed, PROBE_PURPOSE, domain, repeat))
        labelled = min(size - 1, max(1, math.ceil(self.labelled_fraction * size)))
        return order[:labelled], order[labelled:]

    def accuracy(self, model: nn.Module, data: ClientData, num_classes: int, seed: int, domain: int) -> float:
        """Accuracy (percent) of linear probes on ``model.featurizer``'s features of ``data``,
        the mean of :meth:`scores` over :attr:`repeats`; arguments and errors as there."""
        scores = self.scores(model, data, num_classes, seed, domain)
        return sum(scores) / len(scores)

    def scores(self, model: nn.Module, data: ClientData, num_classes: int, seed: int, domain: int) -> list[float]:
        """Accuracy (percent) of each of the :attr:`repeats` linear probes on
        ``model.featurizer``'s features of ``data``, each trained on its own seeded share.

        Args:
            model: a :class:`~fedbed.models.DomainClassifier` (its ``featurizer`` maps
                ``[B, C, H, W]`` to ``[B, d]``); left unchanged.
            data: one domain's samples (labels ``[n]``).
            num_classes: width of the probe's output.
            seed: the run's seed; with ``domain`` and the repeat it fixes the share and the probe's
                initialisation and batch order.
            domain: the domain's id.

        Raises:
            ValueError: fewer than two samples, or a model without a featurizer.
        """
        if not hasattr(model, "featurizer"):
            raise ValueError("the linear probe needs a model with a featurizer (a DomainClassifier)")
        features = data.outputs_of(model.featurizer)
        scores = []
        for repeat in range(self.repeats):
            labelled, test = self.split(len(data), seed, domain, repeat)
            inputs = self.probe_inputs(features, labelled)
            probe = self._train(inputs[labelled], data.targets[labelled], num_classes,
                                seeded_generator(seed, PROBE_PURPOSE, domain, repeat, 1))
            with torch.no_grad():
                predicted = probe(inputs[test]).argmax(dim=1)
            scores.append(100.0 * float((predicted == data.targets[test]).float().mean()))
        return scores

    def probe_inputs(self, features: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
        """The probe's inputs: ``features`` ``[n, d]`` as they are, or, with
        :attr:`standardize_features`, z-scored per dimension with the mean and standard deviation
        of the ``labelled`` rows (never the test rows'), the deviation floored at 1e-6."""
        if not self.standardize_features:
            return features
        share = features[labelled]
        deviation = share.std(dim=0) if len(labelled) > 1 else torch.ones(features.shape[1])
        return (features - share.mean(dim=0)) / deviation.clamp_min(1e-6)

    def _train(self, features: torch.Tensor, labels: torch.Tensor, num_classes: int, generator: torch.Generator) -> nn.Linear:
        """A linear classifier ``[d] -> [num_classes]`` trained with Adam on frozen features."""
        with torch.random.fork_rng():  # nn.Linear's own initialisation must not move the run's draws
            probe = nn.Linear(features.shape[1], num_classes)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(features.shape[1])
            probe.weight.copy_(torch.rand(probe.weight.shape, generator=generator) * 2 * bound - bound)
            probe.bias.zero_()
        optimizer = torch.optim.Adam(probe.parameters(), lr=self.learning_rate)
        for _ in range(self.epochs):
            order = torch.randperm(len(labels), generator=generator)
            for start in range(0, len(labels), self.batch_size):
                index = order[start : start + self.batch_size]
                loss = nn.functional.cross_entropy(probe(features[index]), labels[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return probe


__all__ = ["LinearProbe", "PROBE_PURPOSE"]
