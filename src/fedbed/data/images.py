"""Image datasets in DomainBed's folder layout and in FedBed's packed ``.npz`` layout.

Folder layout (as DomainBed's download script writes it): ``ROOT/<Name>/<domain>/<class>/<image>``.
Packed layout: one ``.npz`` with ``images`` uint8 ``[N, H, W, 3]``, ``labels`` ``[N]``, ``domains``
``[N]``, ``class_names`` and ``domain_names`` (``paths`` optional), as in ``shared/data/pacs``.
``fedbed data prepare`` decodes a folder tree once into the packed layout so that runs never
decode JPEGs again.
"""

from __future__ import annotations

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

    Domains and classes are the sorted folder names (DomainBed's convention); every domain must
    have the same classes.

    Raises:
        DataError: if ``root`` is missing, a domain named in ``expected_domains`` is absent, the
            domains disagree on their classes, or a class folder holds no image.
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
    class_names: list[str] | None = None
    entries: list[tuple[str, str, Path]] = []
    for domain in domains:
        classes = [c.name for c in _subfolders(domain)]
        if class_names is None:
            class_names = classes
        elif classes != class_names:
            raise DataError(
                f"domain folder {domain} has classes {classes}, but {domains[0]} has {class_names}; "
                "every domain must hold the same class folders"
            )
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


def load_packed(path: Path, name: str) -> DomainDataset:
    """Load the packed ``.npz`` layout (``images`` uint8 ``[N, H, W, C]``, ``labels``, ``domains``,
    ``class_names``, ``domain_names``).

    Raises:
        DataError: if the file is unreadable or lacks one of the arrays.
    """
    try:
        with np.load(path, allow_pickle=False) as arrays:
            images = arrays["images"]
            labels = arrays["labels"].astype(np.int64)
            domains = arrays["domains"].astype(np.int64)
            class_names = tuple(str(c) for c in arrays["class_names"])
            domain_names = tuple(str(d) for d in arrays["domain_names"])
    except (OSError, KeyError, ValueError) as error:
        raise DataError(
            f"cannot read packed dataset {path}: {error}; expected arrays images, labels, domains, "
            "class_names, domain_names"
        ) from None
    if images.ndim == 3:
        images = images[..., None]
    return DomainDataset(
        name=name,
        images=torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)).permute(0, 3, 1, 2).contiguous(),
        labels=torch.from_numpy(labels),
        domains=torch.from_numpy(domains),
        class_names=class_names,
        domain_names=domain_names,
        source=f"packed {path}",
    )


def save_packed(dataset: DomainDataset, path: Path) -> None:
    """Write ``dataset`` in the packed layout, atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(
        partial,
        images=dataset.images.permute(0, 2, 3, 1).numpy(),
        labels=dataset.labels.numpy().astype(np.int16),
        domains=dataset.domains.numpy().astype(np.int8),
        class_names=np.array(dataset.class_names),
        domain_names=np.array(dataset.domain_names),
    )
    partial.replace(path)
