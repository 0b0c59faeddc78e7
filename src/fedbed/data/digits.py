"""Digits: the five digit datasets of Digit-5 (Peng et al., ICCV 2019, "Moment Matching for
Multi-Source Domain Adaptation"; the FedDA benchmark of KD3A and MCGDM), each read from its own
common distribution files under the data root.

Domains and the files read under the data root (train, then test):

- ``mnist``: the MNIST sources of RotatedMNIST (:func:`fedbed.data.mnist.read_mnist_files`),
  grey 28x28.
- ``mnist_m``: ``mnist_m/mnist_m_{train,test}/*.png`` with ``mnist_m/mnist_m_{train,test}_labels.txt``
  (Ganin & Lempitsky's release: RGB 28x28 PNGs, lines ``<file> <label>``).
- ``usps``: ``usps/usps.bz2``, ``usps/usps.t.bz2`` (LIBSVM's copy: bz2 libsvm text, labels 1..10
  for digits 0..9, 256 features in [-1, 1], the 16x16 pixels row by row).
- ``svhn``: ``svhn/train_32x32.mat``, ``svhn/test_32x32.mat`` (SVHN's format 2: ``X`` uint8
  [32, 32, 3, N], ``y`` [N, 1], 10 for digit 0).
- ``syn``: ``syn/synth_train_32x32.mat``, ``syn/synth_test_32x32.mat`` (SynthDigits, Ganin &
  Lempitsky's synthetic digits, in SVHN's format).

The dataset is made of the domains found: any two or more of the five (a run on three is valid);
:func:`survey_digits` says which are found and which missing, and the run's data line repeats it.
MNIST's embedded 5,000-image sample is never used here: without MNIST files under the data root
the ``mnist`` domain is missing (a sample of another size would silently change the benchmark).

Per domain, at most the first :data:`DIGIT5_SIZES` images of the train and of the test file are
taken, in file order: Digit-5's 25,000 train and 9,000 test images per domain (USPS, smaller,
whole; M3SDA draws them, the first ones need no sampling seed), which keeps the dataset at about 145,000 images instead of 740,000 (SynthDigits alone has
about 480,000). Train and test are then joined, as FedBed splits each domain itself. Every domain
is resized to the run's ``image_size`` (:meth:`DomainDataset.resized`, bilinear, antialiased) and
turned into 3 channels (:meth:`DomainDataset.with_channels`: grey repeated).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedbed.data.base import DataError, DomainDataset, join_domains
from fedbed.data.images import decode_image
from fedbed.data.mnist import mnist_file_source, read_mnist_files

DIGITS_DOMAINS = ("mnist", "mnist_m", "usps", "svhn", "syn")
"""Digits' domains, in Digit-5's order of the MCGDM paper's text (mt, mm, up, sv, syn)."""

DIGIT_CLASSES = tuple(str(digit) for digit in range(10))

DIGIT5_SIZES = {"train": 25_000, "test": 9_000}
"""The most images taken from each domain's train and test files (Digit-5, Peng et al. 2019)."""

MNIST_M_SIDE = 28
"""Side in pixels of MNIST-M's images (MNIST digits blended over photo patches)."""

DOMAIN_FILES = {
    "mnist": ("MNIST/raw/*-idx?-ubyte[.gz]", "or mnist/mnist.npz"),
    "mnist_m": ("mnist_m/mnist_m_train/", "mnist_m/mnist_m_train_labels.txt", "mnist_m/mnist_m_test/",
                "mnist_m/mnist_m_test_labels.txt"),
    "usps": ("usps/usps.bz2", "usps/usps.t.bz2"),
    "svhn": ("svhn/train_32x32.mat", "svhn/test_32x32.mat"),
    "syn": ("syn/synth_train_32x32.mat", "syn/synth_test_32x32.mat"),
}
"""The files each domain is read from, relative to the data root (``mnist``: as RotatedMNIST)."""

Split = tuple[torch.Tensor, torch.Tensor]
"""``(images uint8 [n, C, H, W], labels int64 [n])`` of one file."""


def survey_digits(data_root: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """Which Digits domains are under ``data_root`` (nothing is read, only looked for).

    A domain is found when any of its files exists (:data:`DOMAIN_FILES`; ``mnist``: when
    :func:`fedbed.data.mnist.mnist_file_source` finds IDX files or ``mnist/mnist.npz``), so a
    half-downloaded domain is read and its missing file named, not silently dropped.

    Returns:
        ``(found, missing)``, both ``{domain: files}`` in :data:`DIGITS_DOMAINS`' order: the
        files each found domain is read from, the files each missing one would be read from.
    """
    found, missing = {}, {}
    for domain, files in DOMAIN_FILES.items():
        if domain == "mnist":
            where = mnist_file_source(data_root)
        elif data_root is not None and any((data_root / name).exists() for name in files):
            where = f"{', '.join(files)} in {data_root}"
        else:
            where = None
        if where is None:
            missing[domain] = " ".join(files) if domain == "mnist" else ", ".join(files)
        else:
            found[domain] = where
    return found, missing


def _require(path: Path, expected: str) -> Path:
    if not path.exists():
        raise DataError(f"{path} is missing; expected {expected}")
    return path


def _first(splits: list[Split]) -> list[Split]:
    """The first :data:`DIGIT5_SIZES` images of the train and the test split."""
    return [(images[:limit], labels[:limit]) for (images, labels), limit in zip(splits, DIGIT5_SIZES.values())]


def _read_mnist(data_root: Path) -> list[Split]:
    parts, _ = read_mnist_files(data_root)
    return _first([(images.unsqueeze(1), labels) for images, labels in parts])


def read_mnist_m_split(labels_file: Path, image_folder: Path, limit: int) -> Split:
    """Read one split of MNIST-M's release: ``labels_file`` holds one line ``<file> <label>`` per
    image (label 0..9), ``<file>`` a PNG in ``image_folder``; only the first ``limit`` lines are
    decoded (:func:`fedbed.data.images.decode_image`, RGB, at MNIST-M's 28 pixels).

    Returns:
        ``(images uint8 [n, 3, 28, 28], labels int64 [n])``, n = min(lines, ``limit``).

    Raises:
        DataError: a missing or unreadable labels file or image, or a line that is not
            ``<file> <label>`` with a label 0..9 (its number given).
    """
    try:
        lines = [line for line in _require(labels_file, "lines '<file> <label>'").read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {labels_file}: {error}; expected text lines '<file> <label>'") from None
    names, labels = [], []
    for number, line in enumerate(lines[:limit], start=1):
        fields = line.split()
        if len(fields) != 2 or fields[1] not in DIGIT_CLASSES:
            raise DataError(f"{labels_file}, line {number}: {line!r} is not '<file> <label>' with a label 0..9")
        names.append(fields[0])
        labels.append(int(fields[1]))
    _require(image_folder, f"the PNG images named in {labels_file}")
    images = np.stack([decode_image(image_folder / name, MNIST_M_SIDE) for name in names]) if names else (
        np.zeros((0, MNIST_M_SIDE, MNIST_M_SIDE, 3), np.uint8))
    return torch.from_numpy(images).permute(0, 3, 1, 2), torch.tensor(labels, dtype=torch.int64)


def _read_mnist_m(data_root: Path) -> list[Split]:
    folder = data_root / "mnist_m"
    return [read_mnist_m_split(folder / f"mnist_m_{split}_labels.txt", folder / f"mnist_m_{split}", limit)
            for split, limit in DIGIT5_SIZES.items()]


def read_usps_file(path: Path) -> Split:
    """Read one of LIBSVM's USPS files (``usps.bz2``, ``usps.t.bz2``: libsvm text, bz2-compressed;
    labels 1..10 meaning digits 0..9, 256 features in [-1, 1], row by row the 16x16 pixels) with
    ``sklearn.datasets.load_svmlight_file``; features map linearly to 0..255 (-1 black, 1 white).

    Returns:
        ``(images uint8 [n, 1, 16, 16], labels int64 [n])`` (digits 0..9).

    Raises:
        DataError: a missing or unreadable file, a label outside 1..10 or a feature outside [-1, 1].
    """
    from sklearn.datasets import load_svmlight_file

    expected = "LIBSVM's bz2 libsvm text: '<label 1..10> <index 1..256>:<value in [-1, 1]> ...' per line"
    try:
        features, targets = load_svmlight_file(str(_require(path, expected)), n_features=256)
    except (OSError, EOFError, ValueError) as error:
        raise DataError(f"cannot read {path}: {error}; expected {expected}") from None
    pixels = features.toarray()
    if not np.isin(targets, np.arange(1, 11)).all():
        raise DataError(f"{path}: labels must be 1..10 (digits 0..9), found {sorted(set(targets.tolist()))[:12]}")
    if pixels.size and (pixels.min() < -1 - 1e-6 or pixels.max() > 1 + 1e-6):
        raise DataError(f"{path}: features must lie in [-1, 1], found {pixels.min():g}..{pixels.max():g}")
    images = np.rint((np.clip(pixels, -1, 1) + 1) * 127.5).astype(np.uint8).reshape(-1, 1, 16, 16)
    return torch.from_numpy(images), torch.from_numpy(targets.astype(np.int64) - 1)


def _read_usps(data_root: Path) -> list[Split]:
    return _first([read_usps_file(data_root / "usps" / name) for name in ("usps.bz2", "usps.t.bz2")])


def read_svhn_mat(path: Path, limit: int) -> Split:
    """Read a ``.mat`` file in SVHN's format 2 (``train_32x32.mat``, ``test_32x32.mat``, and
    SynthDigits' ``synth_{train,test}_32x32.mat``) with ``scipy.io.loadmat``: ``X`` uint8
    ``[H, W, 3, N]`` (32 x 32), ``y`` ``[N, 1]`` with labels 1..10, 10 meaning digit 0 (0 is also
    read as 0). Only the first ``limit`` images are kept.

    Returns:
        ``(images uint8 [n, 3, H, W], labels int64 [n])``, n = min(N, ``limit``).

    Raises:
        DataError: a missing or unreadable file (a MATLAB v7.3 file needs h5py, which FedBed does
            not use: save it as v7), missing ``X`` or ``y``, shapes that disagree, or labels
            outside 0..10.
    """
    from scipy.io import loadmat

    expected = "a MATLAB file with X uint8 [32, 32, 3, N] and y [N, 1] (labels 1..10, 10 for digit 0)"
    try:
        arrays = loadmat(str(_require(path, expected)), variable_names=["X", "y"])
        images, labels = arrays["X"], np.asarray(arrays["y"]).reshape(-1)
    except NotImplementedError:  # scipy's answer to a v7.3 (HDF5) file
        raise DataError(f"{path} is a MATLAB v7.3 (HDF5) file; expected {expected}, saved as MATLAB v7 or older") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"cannot read {path}: {error}; expected {expected}") from None
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[2] != 3 or images.shape[3] != len(labels):
        raise DataError(f"{path}: X is {images.dtype} {images.shape} and y has {len(labels)} labels; expected {expected}")
    if not np.isin(labels, np.arange(11)).all():
        raise DataError(f"{path}: labels must be 1..10 (10 for digit 0), found {sorted(set(labels.tolist()))[:12]}")
    images, labels = images[..., :limit], labels[:limit]
    return (torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1))),
            torch.from_numpy(labels.astype(np.int64) % 10))


def _mat_reader(folder: str, pattern: str):
    def read(data_root: Path) -> list[Split]:
        return [read_svhn_mat(data_root / folder / pattern.format(split), limit) for split, limit in DIGIT5_SIZES.items()]
    return read


_READERS = {
    "mnist": _read_mnist,
    "mnist_m": _read_mnist_m,
    "usps": _read_usps,
    "svhn": _mat_reader("svhn", "{}_32x32.mat"),
    "syn": _mat_reader("syn", "synth_{}_32x32.mat"),
}


def load_digits(data_root: Path | None, image_size: int) -> DomainDataset:
    """Read the Digits domains found under ``data_root`` (:func:`survey_digits`).

    Each domain's train then test images (at most :data:`DIGIT5_SIZES`, the first in file order)
    are resized to ``image_size`` and turned into 3 channels, then the domains are joined.

    Returns:
        ``DomainDataset`` "Digits": ``images`` uint8 ``[N, 3, image_size, image_size]``, labels the
        digits 0..9, ``domain_names`` the domains found; its source names each domain's files and
        the missing domains.

    Raises:
        DataError: no domain found, or a domain's file missing or unreadable (named).
    """
    found, missing = survey_digits(data_root)
    if not found:
        raise DataError(f"no Digits domain under {data_root}; expected any of: "
                        + "; ".join(f"{domain}: {files}" for domain, files in missing.items()))
    parts, sources = [], []
    for domain, where in found.items():
        splits = _READERS[domain](data_root)
        images, labels = torch.cat([images for images, _ in splits]), torch.cat([labels for _, labels in splits])
        one = DomainDataset("Digits", images, labels, torch.zeros(len(labels), dtype=torch.int64), DIGIT_CLASSES,
                            (domain,), where).resized(image_size).with_channels(3)
        parts.append((one.images, one.labels))
        sources.append(f"{domain}: {one.source}")
    limits = f"at most the first {DIGIT5_SIZES['train']:,} train and {DIGIT5_SIZES['test']:,} test images per domain"
    return join_domains("Digits", parts, DIGIT_CLASSES, tuple(found),
                        f"Digits ({limits}); {'; '.join(sources)}; missing: {', '.join(missing) or 'none'}")
