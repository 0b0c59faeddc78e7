"""MixStyle (Zhou, Yang, Qiao, Xiang, ICLR 2021): mixing instance-level feature statistics between
the samples of a batch, as a layer inserted into a featurizer (MCGDM's Baseline, Table 4).

In training mode, with probability ``p`` per batch, each sample's feature map ``[C, H, W]`` is
normalised by its own channel means and standard deviations (over H and W, detached) and
re-styled with a convex mix of its statistics and those of the sample a random permutation of
the batch assigns it (possibly itself, as in the paper's shuffle), λ ~ Beta(α, α) per sample (the paper's Algorithm 1, "random shuffle" variant). Defaults:
p = 0.5, α = 0.1, ε = 1e-6 (the paper's). In evaluation mode it is the identity. Its draws come
from torch's global generator, which the engine seeds per round and client.

Placement (:func:`insert_mixstyle`): the paper inserts it after the first three residual stages
of a ResNet; FedBed does so for ResNets, and after the two early convolution stages of hFedF's
client CNN (before its Inception modules).
"""

from __future__ import annotations

import torch
from torch import nn


class MixStyle(nn.Module):
    """The MixStyle layer on feature maps ``[B, C, H, W]`` (see the module docstring).

    Args:
        p: probability of mixing a batch.
        alpha: the Beta distribution's parameter.
        eps: added to the variance.
    """

    def __init__(self, p: float = 0.5, alpha: float = 0.1, eps: float = 1e-6) -> None:
        super().__init__()
        self.p, self.alpha, self.eps = p, alpha, eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not self.training or len(features) < 2 or float(torch.rand(())) > self.p:
            return features
        mean = features.mean(dim=(2, 3), keepdim=True).detach()
        std = (features.var(dim=(2, 3), keepdim=True) + self.eps).sqrt().detach()
        normalised = (features - mean) / std
        mix = torch.distributions.Beta(self.alpha, self.alpha).sample((len(features), 1, 1, 1)).to(device=features.device, dtype=features.dtype)
        partners = torch.randperm(len(features))
        mixed_mean = mix * mean + (1 - mix) * mean[partners]
        mixed_std = mix * std + (1 - mix) * std[partners]
        return normalised * mixed_std + mixed_mean


def insert_mixstyle(name: str, featurizer: nn.Module) -> nn.Module:
    """``featurizer`` of model ``name`` with MixStyle layers at the paper's places.

    Raises:
        ValueError: a model with no defined placement (``hfedf_cnn``, ``resnet18``, ``resnet50`` have one).
    """
    if name == "hfedf_cnn":
        layers = list(featurizer.layers)
        # After the first stage (conv, pool, ReLU) and the second (conv, conv, pool, ReLU).
        featurizer.layers = nn.Sequential(*layers[:3], MixStyle(), *layers[3:7], MixStyle(), *layers[7:])
        return featurizer
    if name in ("resnet18", "resnet50"):
        for stage in ("layer1", "layer2", "layer3"):
            setattr(featurizer, stage, nn.Sequential(getattr(featurizer, stage), MixStyle()))
        return featurizer
    raise ValueError(f"MixStyle has a placement for hfedf_cnn, resnet18 and resnet50, not {name}")
