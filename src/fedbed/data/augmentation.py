"""Named, seeded image augmentations applied per batch (``torchvision.transforms.v2``).

An :class:`Augmentation` turns a batch of ``uint8 [B, C, H, W]`` images into ``k`` augmented
views of the same shape and dtype. Every image draws its own random parameters (a v2 transform
called on a whole batch would draw one crop for all of them), and all draws of one call come from
torch's global generator re-seeded with the call's ``seed`` inside :func:`torch.random.fork_rng`,
so the views depend on the seed alone and the caller's random stream does not move. The engine
derives that seed from (run seed, round, client, batch), so a resumed run stays bit-identical.

Named transforms (:data:`AUGMENTATIONS`); each takes the channel count and the image side:

- ``flip_crop``: random horizontal flip, then a random crop of the original side after
  reflection-padding by side/8 (4 px at 32 px: the CIFAR recipe of He et al. 2016, Sec. 4.2).
- ``randaugment``: RandAugment (Cubuk et al. 2020) with torchvision's defaults, 2 operations of
  magnitude 9 out of 31 bins (MCGDM's augmentation, ``mcgdm.md``).
- ``simclr``: SimCLR's view pipeline for small images (Chen et al. 2020, App. B.9 for CIFAR-10):
  random resized crop to the side (scale 0.08-1), horizontal flip, colour jitter of strength
  0.5 (brightness, contrast and saturation 0.4, hue 0.1) with probability 0.8, grayscale with
  probability 0.2; no Gaussian blur, as the paper drops it at 32 px. Grey images get the crop
  and the flip only.
- ``jigen``: JiGen's training protocol (Carlucci et al. 2019; the defaults of its
  ``train_jigsaw.py``): random resized crop to the side with scale (0.8, 1.0), horizontal flip
  with probability 0.5, grayscale with probability 0.1 (JiGen's ``tile_random_grayscale``, here
  on the whole image); JiGen's colour jitter is off by default (``--jitter 0``) and left out.
  FedADG's augmentation (``fedadg.md``, Sec. 6.1, "Model Training"). Grey images get the crop
  and the flip only.
- ``domainbed``: DomainBed's training augmentation (Gulrajani & Lopez-Paz 2021), the
  ``augment_transform`` of ``MultipleEnvironmentImageFolder`` in its ``domainbed/datasets.py``
  (facebookresearch/DomainBed, commit 05a8cc0), used for PACS, VLCS, OfficeHome, TerraIncognita
  and DomainNet: ``RandomResizedCrop(224, scale=(0.7, 1.0))`` (here to the images' own side, so a
  224-px image keeps 224), ``RandomHorizontalFlip()`` (p 0.5), ``ColorJitter(0.3, 0.3, 0.3, 0.3)``
  (brightness, contrast, saturation, hue), ``RandomGrayscale()`` (torchvision's default p 0.1),
  then the ImageNet normalisation FedBed's ``imagenet`` input scaling applies. Grey images get
  the crop and the flip only.
- ``amplitude_mix``: Amplitude Mix (FACT, Xu et al. 2021, Eq. 2-3; MCGDM's Table 6): each image
  keeps its Fourier phase and takes the amplitude spectrum (1 − λ) A(x_i) + λ A(x_j) of itself and
  image j of the batch, j drawn by a random permutation (an image may draw itself, as in FACT's
  shuffled batch), λ ~ U(0, 1) per image (FACT's ratio η = 1); a batch-level augmentation, since
  it mixes images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torchvision.transforms import v2


def _flip_crop(channels: int, side: int) -> v2.Transform:
    return v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(side, padding=max(1, side // 8), padding_mode="reflect")])


def _randaugment(channels: int, side: int) -> v2.Transform:
    return v2.RandAugment()


def _simclr(channels: int, side: int) -> v2.Transform:
    geometric = [v2.RandomResizedCrop(side, scale=(0.08, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    if channels != 3:
        return v2.Compose(geometric)
    colour = [v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2)]
    return v2.Compose(geometric + colour)


def _jigen(channels: int, side: int) -> v2.Transform:
    geometric = [v2.RandomResizedCrop(side, scale=(0.8, 1.0), antialias=True), v2.RandomHorizontalFlip(p=0.5)]
    return v2.Compose(geometric + ([v2.RandomGrayscale(p=0.1)] if channels == 3 else []))


def _domainbed(channels: int, side: int) -> v2.Transform:
    geometric = [v2.RandomResizedCrop(side, scale=(0.7, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    if channels != 3:
        return v2.Compose(geometric)
    return v2.Compose(geometric + [v2.ColorJitter(0.3, 0.3, 0.3, 0.3), v2.RandomGrayscale(p=0.1)])


def amplitude_mix(images: torch.Tensor, ratio: float = 1.0) -> torch.Tensor:
    """FACT's Amplitude Mix of a batch, drawing from torch's global generator.

    Args:
        images: ``uint8 [B, C, H, W]``.
        ratio: η, the upper end of λ ~ U(0, η).

    Returns:
        ``uint8 [B, C, H, W]``: per image the inverse FFT of its phase with the mixed amplitude,
        rounded and clipped to 0..255.
    """
    if len(images) < 2:
        return images.clone()
    spectrum = torch.fft.fft2(images.to(torch.float64))
    amplitude, phase = spectrum.abs(), spectrum.angle()
    partners = torch.randperm(len(images))
    mix = (torch.rand(len(images), 1, 1, 1, dtype=torch.float64) * ratio).to(images.device)  # drawn on the CPU
    mixed = (1 - mix) * amplitude + mix * amplitude[partners]
    restored = torch.fft.ifft2(torch.polar(mixed, phase)).real
    return restored.round().clamp(0, 255).to(torch.uint8)


AUGMENTATIONS: dict[str, Callable[[int, int], v2.Transform] | None] = {
    "flip_crop": _flip_crop,
    "randaugment": _randaugment,
    "simclr": _simclr,
    "jigen": _jigen,
    "domainbed": _domainbed,
    "amplitude_mix": None,
}
"""Name -> builder ``(channels, side) -> transform`` of one ``uint8 [C, H, W]`` image; ``None``
for a batch-level augmentation (:data:`BATCH_AUGMENTATIONS`)."""

BATCH_AUGMENTATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"amplitude_mix": amplitude_mix}
"""Name -> function of a whole ``uint8 [B, C, H, W]`` batch, for augmentations that mix images."""


class AugmentationError(ValueError):
    """Raised for an unknown augmentation name or an invalid number of views."""


@dataclass(frozen=True)
class Augmentation:
    """A named augmentation producing ``views`` augmented copies of each batch.

    Attributes:
        name: a key of :data:`AUGMENTATIONS`.
        views: k >= 1 views per image (SimCLR-style methods use 2).

    Raises:
        AugmentationError: unknown name or ``views < 1``.
    """

    name: str
    views: int = 1

    def __post_init__(self) -> None:
        if self.name not in AUGMENTATIONS:
            raise AugmentationError(f"unknown augmentation {self.name!r}; choose one of {', '.join(AUGMENTATIONS)}")
        if self.views < 1:
            raise AugmentationError(f"an augmentation needs at least one view, got {self.views}")

    def apply(self, images: torch.Tensor, seed: int) -> list[torch.Tensor]:
        """``views`` augmented copies of a batch.

        Args:
            images: ``uint8 [B, C, H, W]``.
            seed: the only source of randomness of this call.

        Returns:
            ``views`` tensors ``uint8 [B, C, H, W]``, each image transformed with its own draws.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.name in BATCH_AUGMENTATIONS:
                return [BATCH_AUGMENTATIONS[self.name](images) for _ in range(self.views)]
            transform = AUGMENTATIONS[self.name](int(images.shape[1]), int(images.shape[-1]))
            return [torch.stack([transform(image) for image in images]) if len(images) else images.clone()
                    for _ in range(self.views)]
