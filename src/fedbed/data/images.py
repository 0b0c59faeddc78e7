"""Image datasets in DomainBed's folder layout and in FedBed's packed ``.npz`` layout.

Folder layout (as DomainBed's download script writes it): ``ROOT/<Name>/<domain>/<class>/<image>``.
Packed layout: one ``.npz`` with ``images`` uint8 ``[N, H, W, 3]``, ``labels`` ``[N]``, ``domains``
``[N]``, ``class_names`` and ``domain_names`` (``paths`` optional), as in ``shared/data/pacs``.
``fedbed data prepare`` decodes a folder tree once into the packed layout so that runs never
decode JPEGs again.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from fedbed.data.base import DataError, DomainDataset

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _subfolders(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def scan_domain_folders(root: Path, expected_domains: tuple[str, ...] | None = None) -> list[tuple[str, str, Path]]:
    """List ``(domain, class, image path)`` for every image under ``root/<domain>/<class>/``.

    Domains and classes are the sorted folder names (DomainBed's convention). A class may be
    missing from some domains (the run warns, :meth:`DomainDataset.coverage_warnings`); the
    classes are the union over the domains.

    Raises:
        DataError: if ``root`` is missing, a domain named in ``expected_domains`` is absent, a
            domain folder holds no class folder, or a class folder holds no image.
    """
    if not root.is_dir():
        raise DataError(f"dataset folder {root} does not exist; expected {root}/<domain>/<class>/<image>")
    domains = _subfolders(root)
    if not domains:
        raise DataError(f"{root} holds no domain folders; expected {root}/<domain>/<class>/<image>")
    if expected_domains is not None:
        missing = sorted(set(expected_domains) - {d.name for d in domains})
        if missing:
            raise DataError(
                f"{root} lacks the domain folder(s) {', '.join(missing)}; expected {', '.join(expected_domains)}"
            )
        domains = [root / name for name in expected_domains]
    entries: list[tuple[str, str, Path]] = []
    for domain in domains:
        classes = [c.name for c in _subfolders(domain)]
        if not classes:
            raise DataError(f"domain folder {domain} is empty; give it one folder per class holding its images, "
                            "or remove it")
        for class_name in classes:
            files = sorted(
                p for p in (domain / class_name).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            )
            if not files:
                raise DataError(
                    f"class folder {domain / class_name} holds no image; expected files ending in "
                    f"{', '.join(IMAGE_SUFFIXES)}"
                )
            entries.extend((domain.name, class_name, path) for path in files)
    return entries


def domain_folder_names(root: Path) -> tuple[str, ...]:
    """The domain folder names of a DomainBed tree ``root/<domain>/<class>/<image>``, sorted
    (hidden folders skipped); empty when ``root`` holds no folder."""
    return tuple(p.name for p in _subfolders(root))


def decode_image(path: Path, size: int) -> np.ndarray:
    """Decode one image to RGB and resize it to ``size`` x ``size`` with Lanczos.

    Returns:
        ``uint8`` array ``[size, size, 3]``.

    Raises:
        DataError: if the file cannot be decoded as an image.
    """
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as error:
        raise DataError(f"cannot read image {path}: {error}") from None


def load_image_folders(
    root: Path, name: str, size: int, expected_domains: tuple[str, ...] | None = None
) -> DomainDataset:
    """Decode a DomainBed folder tree ``root/<domain>/<class>/<image>`` into a :class:`DomainDataset`.

    Args:
        root: the dataset folder (e.g. ``DATA/PACS``).
        name: dataset name recorded in the result.
        size: side, in pixels, every image is resized to.
        expected_domains: domain folder names that must be present, in order; ``None`` takes the
            sorted folder names.

    Raises:
        DataError: as :func:`scan_domain_folders` and :func:`decode_image`.
    """
    entries = scan_domain_folders(root, expected_domains)
    domain_names = tuple(dict.fromkeys(domain for domain, _, _ in entries))
    class_names = tuple(sorted({class_name for _, class_name, _ in entries}))
    images = np.stack([decode_image(path, size) for _, _, path in entries])
    return DomainDataset(
        name=name,
        images=torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        labels=torch.tensor([class_names.index(c) for _, c, _ in entries], dtype=torch.int64),
        domains=torch.tensor([domain_names.index(d) for d, _, _ in entries], dtype=torch.int64),
        class_names=class_names,
        domain_names=domain_names,
        source=f"image folders {root} (decoded at {size}x{size})",
    )


PACKED_ARRAYS = "images, labels (or float targets for regression), domains, class_names, domain_names"
"""The arrays of the packed layout, as error messages name them."""


def packed_header(path: Path) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(domain_names, shape of images)`` of a packed file, without reading its images (the
    ``.npy`` header inside the ``.npz``, read with ``numpy.lib.format``).

    Raises:
        DataError: the file is not a readable ``.npz`` or lacks ``images`` or ``domain_names``.
    """
    try:
        with np.load(path, allow_pickle=False) as arrays:
            domain_names = tuple(str(d) for d in arrays["domain_names"])
            with arrays.zip.open("images.npy") as member:
                major, _ = np.lib.format.read_magic(member)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(member)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
        raise DataError(f"cannot read packed dataset {path}: {error}; expected arrays {PACKED_ARRAYS}") from None
    if dtype == object:
        raise DataError(_sizes_differ(path))
    if len(shape) not in (3, 4):
        raise DataError(f"{path}: images must be uint8 [N, H, W, C] or [N, H, W], got shape {shape}")
    return domain_names, tuple(int(n) for n in shape)


def _sizes_differ(path: Path) -> str:
    return (f"{path}: its images differ in size (stored as an object array); resize them to one size, e.g. save "
            "them as a folder tree and run `fedbed data prepare FOLDER --size S`")


def load_packed(path: Path, name: str) -> DomainDataset:
    """Load the packed ``.npz`` layout: ``images`` uint8 ``[N, H, W, C]`` (or ``[N, H, W]`` for
    grey), ``labels`` ``[N]`` integer indices into ``class_names`` (or, for a regression dataset,
    ``targets`` float ``[N]`` and no or empty ``class_names``), ``domains`` ``[N]`` indices into
    ``domain_names``.

    Raises:
        DataError: naming ``path``: an unreadable file, a missing array, images that are not one
            uint8 array of equal-sized images, arrays of different lengths, labels or domain ids
            outside their name lists.
    """
    try:
        with np.load(path, allow_pickle=False) as arrays:
            regression = "targets" in arrays.files and "labels" not in arrays.files
            labels = arrays["targets"].astype(np.float32) if regression else arrays["labels"]
            domains = arrays["domains"].astype(np.int64)
            class_names = () if regression else tuple(str(c) for c in arrays["class_names"])
            domain_names = tuple(str(d) for d in arrays["domain_names"])
            images = arrays["images"]
    except ValueError as error:
        if "Object arrays" in str(error):  # np.savez stores a list of differently sized images as objects
            raise DataError(_sizes_differ(path)) from None
        raise DataError(f"cannot read packed dataset {path}: {error}; expected arrays {PACKED_ARRAYS}") from None
    except (OSError, KeyError, zipfile.BadZipFile) as error:
        raise DataError(f"cannot read packed dataset {path}: {error}; expected arrays {PACKED_ARRAYS}") from None
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise DataError(f"{path}: images must be uint8 [N, H, W, C] or [N, H, W], got {images.dtype} with shape "
                        f"{images.shape}; scale them to 0..255 and cast to uint8")
    if not regression and np.issubdtype(labels.dtype, np.floating):
        raise DataError(f"{path}: labels are floats; store class indices as integers, or name the array "
                        "'targets' for a regression dataset")
    if images.ndim == 3:
        images = images[..., None]
    try:
        return DomainDataset(
            name=name,
            images=torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(),
            labels=torch.from_numpy(labels if regression else labels.astype(np.int64)),
            domains=torch.from_numpy(domains),
            class_names=class_names,
            domain_names=domain_names,
            source=f"packed {path}",
        )
    except DataError as error:
        raise DataError(f"{path}: {str(error).removeprefix(f'{name}: ')}") from None


def save_packed(dataset: DomainDataset, path: Path) -> None:
    """Write ``dataset`` in the packed layout, atomically (a temporary file renamed into place);
    a regression dataset's float targets go to ``targets`` instead of ``labels``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    if dataset.task == "regression":
        answers = {"targets": dataset.labels.numpy().astype(np.float32)}
    else:
        answers = {"labels": dataset.labels.numpy().astype(np.int16)}
    np.savez_compressed(
        partial,
        images=dataset.images.permute(0, 2, 3, 1).numpy(),
        **answers,
        domains=dataset.domains.numpy().astype(np.int8),
        class_names=np.array(dataset.class_names, dtype=str),
        domain_names=np.array(dataset.domain_names),
    )
    partial.replace(path)
