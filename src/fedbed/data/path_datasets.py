"""A dataset given as a path (``--dataset PATH``): the user's own data in one of three layouts.

1. A folder in DomainBed's layout ``PATH/<domain>/<class>/<image>``, any domain and class names
   (both sorted), decoded to RGB and resized to ``image_size`` (default 32) with Lanczos, as
   :func:`fedbed.data.images.load_image_folders` does for the built-in datasets.
2. A packed ``.npz`` in FedBed's layout (:func:`fedbed.data.images.load_packed`): ``images`` uint8
   ``[N, H, W, C]`` or ``[N, H, W]``, ``labels`` (or float ``targets`` for regression), ``domains``,
   ``class_names``, ``domain_names``; or, as ``fedbed data prepare`` writes it, the same without
   ``images``, which are memory-mapped from the ``<stem>.images.npy`` beside it.
3. A folder holding ``<name>_<size>.npz`` files, as ``fedbed data prepare PATH --size S`` writes
   them (beside the domain folders, or under ``--output-root``); the one of the run's
   ``image_size`` is read, and it wins over decoding the folder tree, as for the built-in datasets.

The dataset's name (runs record it, and the default run folder is ``runs/<name>/...``) is the
folder's name, or the file's stem without a trailing ``_<size>`` (``photos_32.npz`` -> ``photos``).
"""

from __future__ import annotations

import re
from pathlib import Path

from fedbed.data.base import DataError, DatasetSpec, DomainDataset
from fedbed.data.images import (
    domain_folder_names,
    load_image_folders,
    load_packed,
    packed_header,
    save_packed,
    write_image_folders,
)

PACKED_SUFFIX = ".npz"
DEFAULT_IMAGE_SIZE = 32
"""Side, in pixels, a folder tree is decoded at when the run gives no ``image_size`` (hFedF's CNN)."""

_SIZE_SUFFIX = re.compile(r"_(\d+)$")
LAYOUTS = ("a folder <domain>/<class>/<image>", "a packed .npz", "a folder made by `fedbed data prepare`")


def looks_like_path(text: str) -> bool:
    """Whether a ``--dataset`` value is meant as a path: it holds a path separator, starts with
    ``.`` or ``~``, ends in ``.npz``, or names an existing file or folder."""
    return any(mark in text for mark in ("/", "\\")) or text.startswith((".", "~")) or text.endswith(
        PACKED_SUFFIX) or Path(text).exists()


def display_name(text: str) -> str:
    """The name of the dataset at path ``text``: the folder's name, or the ``.npz`` file's stem
    without a trailing ``_<size>``; ``.`` names the current folder."""
    path = Path(text).expanduser()
    if path.suffix == PACKED_SUFFIX:
        return _SIZE_SUFFIX.sub("", path.stem) or path.stem
    return path.name or path.resolve().name


def packed_files(folder: Path, name: str = "*") -> dict[int, Path]:
    """``{size: path}`` of the ``<name>_<size>.npz`` files directly in ``folder`` (any name by default)."""
    found = {}
    for path in sorted(folder.glob(f"{name}_*{PACKED_SUFFIX}")):
        match = _SIZE_SUFFIX.search(path.stem)
        if match and path.is_file() and not path.name.endswith(f".partial{PACKED_SUFFIX}"):
            found[int(match.group(1))] = path
    return found


def nearest_packed_file(packed: dict[int, Path], image_size: int) -> Path | None:
    """The packed file to read ``image_size``-px images from, among ``packed`` (``{size: path}``,
    :func:`packed_files`): the one at that side, else the smallest larger side (downsampling
    loses the least), else the largest; ``None`` when there is none. The caller resizes it
    (:meth:`DomainDataset.resized`)."""
    if not packed:
        return None
    sizes = sorted(packed)
    return packed[next((side for side in sizes if side >= image_size), sizes[-1])]


def read_square_packed(packed: Path, name: str, image_size: int) -> DomainDataset:
    """The packed file ``packed`` as dataset ``name``, resized to ``image_size`` pixels.

    Raises:
        DataError: as :func:`fedbed.data.images.load_packed`, and a file of non-square images.
    """
    dataset = load_packed(packed, name)
    if dataset.input_shape[1] != dataset.input_shape[2]:
        raise DataError(f"{packed} holds {dataset.input_shape[1]}x{dataset.input_shape[2]} images; a packed file "
                        "for a run holds square images: run `fedbed data prepare` on its folder tree")
    return dataset.resized(image_size)  # a model built for another side (LeNet: 28) reads it resized, and says so


def path_dataset_spec(text: str, declared_domains: tuple[str, ...] | None = None) -> DatasetSpec:
    """What the dataset at path ``text`` is, read from its folder names or its packed file's
    ``domain_names`` and image header (the images are not read).

    The default image size is the packed file's side (layouts 2 and 3), else 32; the default model
    is ``hfedf_cnn`` for 32-pixel images and DomainBed's ``mnist_cnn`` (global pooling, any size)
    for other sizes.

    With ``declared_domains`` (data spread over machines, the ``domain_names`` setting) the
    dataset has those domains and the path may hold only some of them (one site's).

    Raises:
        DataError: a missing path, a file that is not a packed ``.npz``, a folder holding neither
            domain folders nor packed files, fewer than two domains, or a domain found that is
            not declared.
    """
    path = Path(text).expanduser()
    if not path.exists():
        raise DataError(f"dataset path {path} does not exist; give {', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}")
    if path.is_file():
        if path.suffix != PACKED_SUFFIX:
            raise DataError(f"dataset file {path} is not a packed {PACKED_SUFFIX}; give {', '.join(LAYOUTS[:-1])} "
                            f"or {LAYOUTS[-1]}")
        domain_names, shape = packed_header(path)
        size = shape[1]
    else:
        domain_names, size = domain_folder_names(path), DEFAULT_IMAGE_SIZE
        packed = packed_files(path)
        if not domain_names:
            if not packed:
                raise DataError(f"{path} holds neither domain folders nor a packed <name>_<size>{PACKED_SUFFIX}; "
                                f"expected {path}/<domain>/<class>/<image>")
            size = DEFAULT_IMAGE_SIZE if DEFAULT_IMAGE_SIZE in packed else min(packed)
            domain_names = packed_header(packed[size])[0]
    if declared_domains is not None:
        undeclared = [d for d in domain_names if d not in declared_domains]
        if undeclared:
            raise DataError(f"{path} holds the domain(s) {', '.join(undeclared)}, which are not among the declared "
                            f"domain_names ({', '.join(declared_domains)})")
        domain_names = tuple(declared_domains)
    if len(domain_names) < 2:
        raise DataError(f"{path} has {len(domain_names)} domain ({', '.join(domain_names) or 'none'}); "
                        "leave-one-domain-out needs at least two: one folder (or domain name) per domain; on a "
                        "machine holding only some of a federation's domains, declare them all with domain_names")
    return DatasetSpec(
        name=display_name(text),
        domain_names=tuple(domain_names),
        default_image_size=size,
        default_model="hfedf_cnn" if size == 32 else "mnist_cnn",
        path=text,
    )


def describe_path_dataset(spec: DatasetSpec, image_size: int | None = None) -> str:
    """Where :func:`load_path_dataset` would read ``spec`` from (``fedbed datasets``)."""
    path = Path(str(spec.path)).expanduser()
    size = image_size or spec.default_image_size
    if path.is_file():
        return f"packed {path}"
    if size in (packed := packed_files(path)):
        return f"packed {packed[size]}"
    return f"image folders {path} (decoded at {size}x{size} each run: `fedbed data prepare {spec.path} --size {size}`)"


def load_path_dataset(spec: DatasetSpec, image_size: int | None) -> DomainDataset:
    """Read a dataset given as a path (:func:`path_dataset_spec`).

    Returns:
        A :class:`DomainDataset` named ``spec.name``: ``images`` uint8 ``[N, C, H, W]`` (a folder
        tree gives C = 3; a packed file its own C).

    Raises:
        DataError: as :func:`fedbed.data.images.load_image_folders` and
            :func:`fedbed.data.images.load_packed`, and: a packed file of non-square images, one
            whose domains differ from the folder tree beside it, or a domain without samples. A
            packed file of another side than ``image_size`` is read resized
            (:meth:`DomainDataset.resized`).
    """
    path = Path(str(spec.path)).expanduser()
    size = image_size or spec.default_image_size
    packed = path if path.is_file() else packed_files(path).get(size)
    if packed is None and not path.is_file() and spec.domain_names != domain_folder_names(path):
        # No file at this size and no folder tree to decode: the nearest packed size, resized
        # (as for the built-in datasets, fedbed.data.catalog).
        packed = nearest_packed_file(packed_files(path), size)
    if packed is not None:
        dataset = read_square_packed(packed, spec.name, size)
        if dataset.domain_names != spec.domain_names:
            raise DataError(f"{packed} has domains {', '.join(dataset.domain_names)}, but the folders beside it are "
                            f"{', '.join(spec.domain_names)}; run `fedbed data prepare {spec.path} --size {size}` again")
    elif spec.domain_names == domain_folder_names(path):
        dataset = load_image_folders(path, spec.name, size)
    else:
        raise DataError(f"{path} holds packed files for image sizes {', '.join(map(str, sorted(packed_files(path))))} "
                        f"only; leave image_size unset or run `fedbed data prepare` at {size}")
    empty = [name for name, count in zip(dataset.domain_names, dataset.counts().sum(1)) if int(count) == 0]
    if empty:
        raise DataError(f"{packed or path}: domain(s) {', '.join(empty)} hold no sample; remove them from "
                        "domain_names or add their samples")
    return dataset


def prepare_path_dataset(text: str, image_size: int, output_root: Path | None = None, memory_mapped: bool = False) -> Path:
    """Decode the folder tree at ``text`` once into ``<folder>/<name>_<size>.npz`` (or
    ``output_root/<name>/<name>_<size>.npz``), which ``--dataset`` of the folder (or of
    ``output_root/<name>``) then reads: compressed, or with ``memory_mapped`` the memory-mapped
    layout, its images in ``<name>_<size>.images.npy`` beside it, decoded one at a time
    (:func:`fedbed.data.images.write_image_folders`).

    A tree of one domain is packed too: a site of a federation whose data is spread over its
    machines holds only its own (``domain_names``, :func:`fedbed.data.catalog.read_present_domains`).

    Raises:
        DataError: a path that is not a folder tree of domains, unreadable images, or a
            destination that cannot be written.
    """
    folder = Path(text).expanduser()
    if not folder.is_dir() or not domain_folder_names(folder):
        raise DataError(f"{folder} is not a folder tree <domain>/<class>/<image>; only a folder tree needs preparing")
    name = display_name(text)
    target = (output_root / name if output_root else folder) / f"{name}_{image_size}{PACKED_SUFFIX}"
    try:
        if memory_mapped:
            write_image_folders(folder, name, image_size, target)
        else:
            save_packed(load_image_folders(folder, name, image_size), target)
    except OSError as error:
        raise DataError(f"cannot write {target}: {error.strerror or error}; give --output-root to write elsewhere") from None
    return target
