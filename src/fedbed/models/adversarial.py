"""FedADG's networks (``fedadg.md``, Sec. 4.2-4.3 and Table 8): the distribution generator G, the
discriminator D, the random projection R, the fixed reference distributions, and the model that
carries G beside the featurizer F and the classifier C so that G travels and is averaged. The
method that trains them is :mod:`fedbed.algorithms.fedadg`."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedbed.models.networks import DomainClassifier, ModelError

REFERENCES = ("generator", "gaussian", "uniform", "laplace")
"""The reference distribution: FedADG's generator G, or Table 8's fixed N(0, I), U[−1, 1], Laplace(0, 1/√2)."""


class DistributionGenerator(nn.Module):
    """G (Sec. 4.2): ``concat(z, y)`` ``[B, d_z (+ K)]`` -> linear d -> ReLU -> linear d: ``[B, d]``.

    Args:
        noise_dim: d_z.
        num_classes: K (the width of y; 0 without label conditioning).
        hidden_dim: d, the featurizer's width.
    """

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim))

    def forward(self, noise: torch.Tensor, one_hot: torch.Tensor | None) -> torch.Tensor:
        """Features ``[B, d]`` of noise ``[B, d_z]`` and one-hot labels ``[B, K]`` (or ``None``)."""
        return self.layers(noise if one_hot is None else torch.cat([noise, one_hot], dim=1))


class Discriminator(nn.Module):
    """D (Sec. 4.2): ``concat(h̄, y)`` ``[B, d_in (+ K)]`` -> linear d -> ReLU -> linear 1: ``[B]``.

    Args:
        input_dim: d_in, the width of the (projected) features h̄.
        num_classes: K (0 without label conditioning).
        hidden_dim: d, the featurizer's width (Sec. 6.1: "the first layer of discriminator have the
            same size as the hidden representation").
    """

    def __init__(self, input_dim: int, num_classes: int, hidden_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(input_dim + num_classes, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 1))

    def forward(self, features: torch.Tensor, one_hot: torch.Tensor | None) -> torch.Tensor:
        """One unbounded score per sample ``[B]`` (LSGAN: no sigmoid)."""
        return self.layers(features if one_hot is None else torch.cat([features, one_hot], dim=1)).squeeze(1)


def random_projection(input_dim: int, output_dim: int) -> torch.Tensor:
    """R ``[d_1, d_2]`` with N(0, 1/d_2) entries, from torch's global generator (Sec. 4.3, after
    Fern and Brodley 2003); ``h R`` maps ``[n, d_1]`` to ``[n, d_2]``.

    Raises:
        ValueError: ``output_dim >= input_dim`` (the paper's d_1 > d_2) or a non-positive size.
    """
    if not 0 < output_dim < input_dim:
        raise ValueError(f"a random projection reduces the dimension: need 0 < d_2 < d_1, got d_1={input_dim}, d_2={output_dim}")
    return torch.randn(input_dim, output_dim) / math.sqrt(output_dim)


def reference_sample(reference: str, shape: tuple[int, int]) -> torch.Tensor:
    """A draw ``[n, d]`` of a fixed reference distribution of Table 8 from torch's global
    generator: ``gaussian`` N(0, I), ``uniform`` U[−1, 1], ``laplace`` Laplace(0, 1/√2).

    Raises:
        ValueError: an unknown (or non-fixed) ``reference``.
    """
    if reference == "gaussian":
        return torch.randn(shape)
    if reference == "uniform":
        return torch.rand(shape) * 2.0 - 1.0
    if reference == "laplace":
        return torch.distributions.Laplace(0.0, 1.0 / math.sqrt(2.0)).sample(shape)
    raise ValueError(f"unknown fixed reference distribution {reference!r}; choose gaussian, uniform or laplace")


class FedADGModel(DomainClassifier):
    """F and C of a :class:`~fedbed.models.DomainClassifier`, plus G when the reference is
    generated, so that G travels and is averaged with F and C (state-dict prefix ``generator.``).
    ``forward`` is F then C, as for the base model.

    Args:
        base: the protocol's model; its classifier must be linear with K >= 2 outputs.
        reference: a name of :data:`REFERENCES`, or ``None`` without alignment.
        use_label_conditioning: G takes y.
        noise_dim: d_z (``None``: the featurizer's width).

    Raises:
        ModelError: the base model has no linear classifier with at least two classes (FedADG
            aligns class-conditional distributions; a regression task has no classes).
    """

    def __init__(self, base: DomainClassifier, reference: str | None, use_label_conditioning: bool = True,
                 noise_dim: int | None = None) -> None:
        classes = getattr(base.classifier, "out_features", 0)
        if not isinstance(base.classifier, nn.Linear) or classes < 2:
            raise ModelError("FedADG aligns class-conditional feature distributions: it needs a classification task "
                             "(a model whose classifier is linear with at least two classes)")
        super().__init__(base.featurizer, base.classifier, base.feature_dim)
        self.num_classes = classes
        self.reference = reference
        self.use_label_conditioning = use_label_conditioning
        self.noise_dim = noise_dim or base.feature_dim
        if reference == "generator":
            self.generator = DistributionGenerator(self.noise_dim, classes if use_label_conditioning else 0, base.feature_dim)

    def one_hot(self, labels: torch.Tensor) -> torch.Tensor | None:
        """y ``[B, K]`` (float) of labels ``[B]``, or ``None`` without label conditioning."""
        return nn.functional.one_hot(labels, self.num_classes).float() if self.use_label_conditioning else None

    def reference_features(self, labels: torch.Tensor) -> torch.Tensor | None:
        """h' ``[B, d]`` for labels ``[B]``, drawn from torch's global generator: G(z, y) with
        z ~ U[0, 1) ``[B, d_z]`` (differentiable in G), a draw of the fixed reference, or ``None``
        for a model without alignment."""
        if self.reference is None:
            return None
        if self.reference == "generator":
            return self.generator(torch.rand(len(labels), self.noise_dim, device=labels.device), self.one_hot(labels))
        return reference_sample(self.reference, (len(labels), self.feature_dim)).to(labels.device)
