"""A client's (or an evaluation set's) samples as ready-to-use float tensors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fedbed.data.base import DomainDataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_model_input(images: torch.Tensor) -> torch.Tensor:
    """Turn ``uint8 [N, C, H, W]`` into model input ``float32 [N, C, H, W]``.

    Grey images are scaled to [0, 1] (DomainBed's MNIST transform); RGB images are also
    normalised with the ImageNet channel mean and std (DomainBed's image transform).
    """
    scaled = images.float().div_(255.0)
    if scaled.shape[1] == 3:
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        scaled.sub_(mean).div_(std)
    return scaled


@dataclass(frozen=True)
class ClientData:
    """Samples held in memory, decoded once.

    Attributes:
        inputs: ``float32 [n, C, H, W]`` model input.
        targets: ``int64 [n]`` class labels (or ``float32 [n]`` regression targets).
        domains: ``int64 [n]`` domain id of each sample.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    domains: torch.Tensor

    @classmethod
    def from_dataset(cls, dataset: DomainDataset, indices: torch.Tensor) -> "ClientData":
        """Select ``indices`` of ``dataset`` and convert them with :func:`to_model_input`."""
        return cls(to_model_input(dataset.images[indices]), dataset.labels[indices], dataset.domains[indices])

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One shuffled pass (an epoch) in batches of ``batch_size`` (the last may be smaller)."""
        order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), batch_size):
            index = order[start : start + batch_size]
            yield self.inputs[index], self.targets[index]
