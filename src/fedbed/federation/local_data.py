"""A client's (or an evaluation set's) samples, kept as stored and turned into model input per batch.

Images stay ``uint8`` in memory (a quarter of float32's size) and are augmented
(:mod:`fedbed.data.augmentation`) and scaled (:func:`to_model_input`) one batch at a time. A
client (and an evaluation set) keeps only the indices of its images into the dataset's
(:class:`fedbed.data.images.ImageRows`), memory-mapped (:mod:`fedbed.data.images`) or in memory:
each batch gathers its own rows, and no client holds a copy of the images.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fedbed.data.augmentation import Augmentation
from fedbed.data.base import DomainDataset
from fedbed.data.images import ImageRows
from fedbed.federation.devices import HOST, moved_from_host
from fedbed.seeding import derive_seed

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INPUT_SCALINGS = ("imagenet", "unit", "symmetric")
"""How ``uint8`` pixels become model input (:func:`to_model_input`)."""


def to_model_input(images: torch.Tensor, scaling: str = "imagenet") -> torch.Tensor:
    """Turn ``uint8 [N, C, H, W]`` into model input ``float32 [N, C, H, W]``.

    Args:
        images: pixel values 0..255.
        scaling: ``imagenet`` (DomainBed's transforms: grey images scaled to [0, 1], RGB images
            also normalised with the ImageNet channel mean and std), ``unit`` ([0, 1]) or
            ``symmetric`` ([−1, 1], i.e. mean and std 0.5 per channel).

    Raises:
        ValueError: an unknown ``scaling``.
    """
    if scaling not in INPUT_SCALINGS:
        raise ValueError(f"unknown input scaling {scaling!r}; choose one of {', '.join(INPUT_SCALINGS)}")
    scaled = images.float().div_(255.0)
    if scaling == "symmetric":
        scaled.sub_(0.5).div_(0.5)
    elif scaling == "imagenet" and scaled.shape[1] == 3:
        mean = torch.tensor(IMAGENET_MEAN, device=scaled.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=scaled.device).view(1, 3, 1, 1)
        scaled.sub_(mean).div_(std)
    return scaled


@dataclass(frozen=True)
class Batch:
    """One training batch.

    Attributes:
        inputs: ``float32 [B, C, H, W]`` model input of the samples as stored (or, when the
            trainer asked for augmented inputs, of the first augmented view).
        targets: ``int64 [B]`` class labels (or ``float32 [B]`` regression targets).
        views: k augmented views ``float32 [B, C, H, W]`` of the same samples (empty without
            an augmentation).
        number: the batch's 0-based position in the round (across epochs).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    views: tuple[torch.Tensor, ...] = ()
    number: int = 0


@dataclass(frozen=True)
class UnlabeledImages:
    """Images without labels: what the server holds of the target domain under the
    ``domain_adaptation`` protocol. An object of this exact type has no labels attribute at all,
    so no code given one can read a label (:class:`ClientData` extends it with labels; the
    server receives :meth:`ClientData.without_labels`, a plain ``UnlabeledImages``).

    Attributes:
        images: ``uint8 [n, C, H, W]`` pixels, scaled on use with ``scaling``; a tensor of any
            other dtype is taken as model input already (features, synthetic test data).
        scaling: one of :data:`INPUT_SCALINGS` (keyword only).
    """

    images: torch.Tensor
    scaling: str = field(default="imagenet", kw_only=True)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def model_input(self, images: torch.Tensor) -> torch.Tensor:
        """Some of this set's images as model input (``uint8`` pixels scaled to ``float32``)."""
        return to_model_input(images, self.scaling) if images.dtype == torch.uint8 else images

    def input_chunks(self, chunk_size: int) -> Iterator[torch.Tensor]:
        """Every sample's model input in order, ``chunk_size`` at a time (for evaluation)."""
        for start in range(0, len(self), chunk_size):
            yield self.model_input(self.images[start : start + chunk_size])

    @torch.no_grad()
    def outputs_of(self, module: torch.nn.Module, chunk_size: int = 1024) -> torch.Tensor:
        """``module``'s outputs on every sample in order, in eval mode and without gradients
        (the module's mode is restored): ``[n, ...]`` on the CPU, computed batched on the device
        the module's parameters are on."""
        was_training = module.training
        module.eval()
        device = next(module.parameters(), torch.empty(0)).device
        outputs = torch.cat([module(inputs.to(device)).to(HOST) for inputs in self.input_chunks(chunk_size)])
        module.train(was_training)
        return outputs


@dataclass(frozen=True)
class ClientData(UnlabeledImages):
    """Labelled samples held in memory, decoded once.

    Attributes:
        images: as :class:`UnlabeledImages`.
        targets: ``int64 [n]`` class labels (or ``float32 [n]`` regression targets).
        domains: ``int64 [n]`` domain id of each sample.
        scaling: as :class:`UnlabeledImages`.
        holdout: the client's share of its source domains' id-validation holdouts
            (:func:`fedbed.federation.client_evaluation.holdout_shares`), given beside its
            training samples by :meth:`fedbed.build.BuiltRun.client_data` (keyword only;
            ``None`` where none was given, and on a :meth:`subset`). Training never reads it; a
            method may score models on it (FedDG-GA's ``gap_samples: holdout``).
    """

    targets: torch.Tensor
    domains: torch.Tensor
    holdout: ClientData | None = field(default=None, kw_only=True)

    @classmethod
    def from_dataset(cls, dataset: DomainDataset, indices: torch.Tensor, scaling: str = "imagenet",
                     holdout: ClientData | None = None) -> "ClientData":
        """Select ``indices`` of ``dataset``: its images are not copied, only their indices are kept
        (:class:`fedbed.data.images.ImageRows`, a view of the dataset's images, mapped or in memory)
        and a batch gathers its rows; the labels and domain ids (a few bytes a sample) are copied.
        ``holdout``: the client's id-holdout share (class docstring)."""
        return cls(ImageRows(dataset.images, indices), dataset.labels[indices], dataset.domains[indices], scaling=scaling,
                   holdout=holdout)

    def subset(self, mask: torch.Tensor | slice) -> "ClientData":
        """The samples selected by a boolean mask, an index tensor or a slice."""
        images = self.images.select(mask) if isinstance(self.images, ImageRows) else self.images[mask]
        return ClientData(images, self.targets[mask], self.domains[mask], scaling=self.scaling)

    def without_labels(self) -> UnlabeledImages:
        """The same images as :class:`UnlabeledImages` (no labels travel with them)."""
        return UnlabeledImages(self.images, scaling=self.scaling)

    def batches(self, batch_size: int, generator: torch.Generator, augmentation: Augmentation | None = None,
                augmentation_seed: int = 0, first_number: int = 0, augment_inputs: bool = False,
                device: torch.device = HOST) -> Iterator[Batch]:
        """One shuffled pass (an epoch) in batches of ``batch_size`` (the last may be smaller).

        Args:
            batch_size: samples per batch.
            generator: drives the order (only the order: augmentation draws from its own seed).
            augmentation: adds ``augmentation.views`` views to every batch.
            augmentation_seed: batch ``b``'s views are drawn with ``derive_seed(augmentation_seed, b)``.
            first_number: the ``number`` of the first batch (batches are numbered across epochs).
            augment_inputs: make ``inputs`` the first view (plain training on augmented images).
            device: where the batch goes: its ``uint8`` images move there, are augmented there
                (``torchvision.transforms.v2`` on device tensors; the random parameters are drawn
                on the CPU from the batch's seed, so a device changes no draw) and scaled there.
        """
        order = torch.randperm(len(self), generator=generator)
        for offset, start in enumerate(range(0, len(self), batch_size)):
            index = order[start : start + batch_size]
            number = first_number + offset
            images = moved_from_host(self.images[index], device)
            views: tuple[torch.Tensor, ...] = ()
            if augmentation is not None:
                raw = augmentation.apply(images, derive_seed(augmentation_seed, number))
                views = tuple(self.model_input(view) for view in raw)
            inputs = views[0] if augment_inputs and views else self.model_input(images)
            yield Batch(inputs, self.targets[index].to(device), views, number)
