"""Image datasets in DomainBed's folder layout and in FedBed's packed layouts.

Folder layout (as DomainBed's download script writes it): ``ROOT/<Name>/<domain>/<class>/<image>``.

Packed layout, compressed: one ``.npz`` with ``images`` uint8 ``[N, H, W, 3]``, ``labels`` ``[N]``,
``domains`` ``[N]``, ``class_names`` and ``domain_names`` (``paths`` optional), as in
``shared/data/pacs``; reading it decompresses every image into memory.

Packed layout, memory-mapped (what ``fedbed data prepare`` writes, at every size): the same
``<name>_<size>.npz`` without ``images``, holding instead ``images_file``, the name of an
uncompressed ``.npy`` beside it, ``<name>_<size>.images.npy``: uint8 ``[N, C, H, W]``
(channels first, the order of :attr:`DomainDataset.images`). :func:`load_packed` maps that file
(``numpy.load(mmap_mode="c")``: copy-on-write, so an edit in place stays in the process and the
file is never written) and wraps it with ``torch.from_numpy`` without copying: the operating
system reads a page when a batch first touches it and may drop it again, so a dataset larger
than memory trains. ``fedbed data prepare`` decodes the folder tree into that file one image at
a time (:func:`write_image_folders`), so preparing needs no more memory than training.
"""

from __future__ import annotations

import weakref
import zipfile
from collections.abc import Iterable
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
            return square_rgb(image, size)
    except (UnidentifiedImageError, OSError) as error:
        raise DataError(f"cannot read image {path}: {error}") from None


def square_rgb(image: Image.Image, size: int) -> np.ndarray:
    """A decoded image (any PIL mode) as RGB, resized to ``size`` x ``size`` with Lanczos: what
    every image of a folder tree or a Hugging Face dataset becomes in the packed layout.

    Returns:
        ``uint8`` array ``[size, size, 3]``.
    """
    return np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)


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


MEMORY_MAPPED_FROM = 128
"""Side in pixels from which a dataset is packed in the memory-mapped layout by default (``fedbed
data prepare``, a Hugging Face dataset's first run; full resolution, DomainBed's 224); smaller
sides (32, 64: a few dozen MB) get one compressed ``.npz``."""

IMAGES_FILE_SUFFIX = ".images.npy"
"""The ending of a memory-mapped packed file's images: ``<name>_<size>.images.npy`` beside ``<name>_<size>.npz``."""

_FLUSH_EVERY = 1024
"""Images written between two flushes of the memory map while preparing (bounds its dirty pages)."""

_MAPPED: dict[int, tuple[weakref.ref, Path]] = {}
"""``id(tensor) -> (weak reference to it, .npy file)`` of every images tensor :func:`open_mapped_images` made."""


def images_file(path: Path) -> Path:
    """The ``.npy`` holding the images of the memory-mapped packed file ``path``
    (``pacs_224.npz`` -> ``pacs_224.images.npy``)."""
    return path.with_name(path.stem + IMAGES_FILE_SUFFIX)


def open_mapped_images(path: Path) -> torch.Tensor:
    """The images of ``path`` (a ``.npy`` of uint8 ``[N, C, H, W]``) as a tensor over a fresh
    copy-on-write memory map of the file: nothing is read until it is used.

    Raises:
        DataError: an unreadable file, or images that are not uint8 ``[N, C, H, W]``.
    """
    try:
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DataError(f"cannot map packed images {path}: {error}; run `fedbed data prepare` again") from None
    if array.dtype != np.uint8 or array.ndim != 4:
        raise DataError(f"{path}: images must be uint8 [N, C, H, W], got {array.dtype} with shape {array.shape}")
    tensor = torch.from_numpy(array)  # writable (copy-on-write): no copy, no warning
    key = id(tensor)
    _MAPPED[key] = (weakref.ref(tensor, lambda _, key=key: _MAPPED.pop(key, None)), path)
    return tensor


def mapped_file(images: torch.Tensor) -> Path | None:
    """The ``.npy`` file whose memory map ``images`` is (:func:`open_mapped_images`), or ``None``
    for a tensor held in memory (a slice or any other tensor made from a mapped one included)."""
    entry = _MAPPED.get(id(images))
    return entry[1] if entry is not None and entry[0]() is images else None


def own_copy(images: torch.Tensor) -> torch.Tensor:
    """A copy of ``images`` that the caller may edit in place without changing ``images``: a
    fresh memory map of the same file for memory-mapped images (no pixel is read), else a clone."""
    path = mapped_file(images)
    return images.clone() if path is None else open_mapped_images(path)


class ImageRows:
    """Some rows of a dataset's images tensor, kept as their indices: what a client's data (and
    every evaluation set, :class:`fedbed.federation.local_data.ClientData`) holds instead of a copy
    of its images, whether the dataset is memory-mapped (a batch then reads just its rows from the
    file) or in memory (a thousand clients then cost their indices, not a second copy of the
    images). Indexing it (a slice, an index tensor, a boolean mask) gathers just those rows into a
    new ``uint8`` tensor (a batch's copy); :meth:`select` narrows it without reading.

    Attributes:
        source: the dataset's whole ``uint8 [N, C, H, W]`` tensor (mapped or in memory).
        rows: ``int64 [n]`` indices into ``source``.
    """

    def __init__(self, source: torch.Tensor, rows: torch.Tensor) -> None:
        self.source = source
        self.rows = torch.as_tensor(rows, dtype=torch.int64).flatten()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), *self.source.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    def __len__(self) -> int:
        return len(self.rows)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.source.element_size()

    def __getitem__(self, key: slice | torch.Tensor) -> torch.Tensor:
        return self.source[self.rows[key]]

    def select(self, key: slice | torch.Tensor) -> "ImageRows":
        """The rows ``key`` selects, still unread."""
        return ImageRows(self.source, self.rows[key])


def write_image_folders(root: Path, name: str, size: int, target: Path,
                        expected_domains: tuple[str, ...] | None = None) -> Path:
    """Decode a DomainBed folder tree into the memory-mapped packed layout at ``target``
    (``<name>_<size>.npz``), one image at a time: the images go straight into the ``.npy``
    (``numpy.lib.format.open_memmap``), so no more than a few images are held in memory. The
    result reads back equal to :func:`load_image_folders` of the same tree, fingerprint included.

    Raises:
        DataError: as :func:`scan_domain_folders` and :func:`decode_image`; ``OSError`` when
            ``target`` cannot be written.
    """
    entries = scan_domain_folders(root, expected_domains)
    domain_names = tuple(dict.fromkeys(domain for domain, _, _ in entries))
    class_names = tuple(sorted({class_name for _, class_name, _ in entries}))
    return write_mapped_images(target, (decode_image(path, size) for _, _, path in entries), len(entries), size,
                               class_names, domain_names,
                               labels=np.array([class_names.index(c) for _, c, _ in entries], dtype=np.int16),
                               domains=np.array([domain_names.index(d) for d, _, _ in entries], dtype=np.int8))


def write_mapped_images(target: Path, images: Iterable[np.ndarray], count: int, size: int,
                        class_names: tuple[str, ...], domain_names: tuple[str, ...], **answers: np.ndarray) -> Path:
    """Write the memory-mapped packed layout at ``target`` (``<name>_<size>.npz``) from images
    given one at a time: each goes straight into the ``.npy`` (``numpy.lib.format.open_memmap``),
    so no more than a few are held in memory; the ``.npz`` is written last, so a half-written
    dataset is never read.

    Args:
        target: the ``.npz`` to write.
        images: ``count`` images, each ``uint8 [size, size, 3]`` (:func:`square_rgb`).
        count: how many ``images`` yields.
        size: their side in pixels.
        class_names: one name per class (empty for regression).
        domain_names: one name per domain.
        answers: ``labels`` (int16 ``[count]``) or ``targets`` (float32, regression), and
            ``domains`` (int8 ``[count]``).

    Raises:
        DataError: ``images`` yields another number of images than ``count``; whatever reading
            an image raises (nothing is left behind); ``OSError`` when ``target`` cannot be written.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = images_file(target).with_name(target.stem + ".images.partial.npy")
    written = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=(count, 3, size, size))
    try:
        rows = 0
        for image in images:
            if rows == count:
                raise DataError(f"{target}: more than the {count} images announced")
            written[rows] = image.transpose(2, 0, 1)
            rows += 1
            if rows % _FLUSH_EVERY == 0:
                written.flush()
        if rows != count:
            raise DataError(f"{target}: {rows} images written, {count} announced")
        written.flush()
    except BaseException:
        del written
        partial.unlink(missing_ok=True)
        raise
    del written
    partial.replace(images_file(target))
    _write_small_arrays(target, class_names=class_names, domain_names=domain_names, **answers)
    return target


def _write_small_arrays(path: Path, class_names: tuple[str, ...], domain_names: tuple[str, ...],
                        **arrays: np.ndarray) -> None:
    """Write the ``.npz`` of the memory-mapped layout (everything but the images, which are
    already in place beside it), atomically: written last, so a half-written dataset is never read."""
    partial = path.with_name(path.name + ".partial.npz")
    np.savez(partial, **arrays, class_names=np.array(class_names, dtype=str), domain_names=np.array(domain_names),
             images_file=np.array(images_file(path).name))
    partial.replace(path)


PACKED_ARRAYS = "images, labels (or float targets for regression), domains, class_names, domain_names"
"""The arrays of the packed layout, as error messages name them."""


def packed_header(path: Path) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(domain_names, shape of images as [N, H, W, C])`` of a packed file, without reading its
    images (the ``.npy`` header inside the ``.npz``, read with ``numpy.lib.format``, or the header
    of the memory-mapped layout's ``.npy``).

    Raises:
        DataError: the file is not a readable ``.npz`` or lacks ``images`` or ``domain_names``.
    """
    try:
        with np.load(path, allow_pickle=False) as arrays:
            domain_names = tuple(str(d) for d in arrays["domain_names"])
            if "images" not in arrays.files and "images_file" in arrays.files:  # memory-mapped: [N, C, H, W]
                shape = np.load(path.with_name(str(arrays["images_file"])), mmap_mode="r", allow_pickle=False).shape
                if len(shape) != 4:
                    raise DataError(f"{path}: its images must be uint8 [N, C, H, W], got shape {shape}")
                return domain_names, (int(shape[0]), int(shape[2]), int(shape[3]), int(shape[1]))  # as [N, H, W, C]
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
    ``domain_names``. A file of the memory-mapped layout (``images_file`` instead of ``images``)
    gives images memory-mapped from the ``.npy`` beside it (:func:`open_mapped_images`; nothing of
    them is read here), equal, fingerprint included, to the compressed layout's of the same images.

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
            mapped = "images" not in arrays.files and "images_file" in arrays.files
            images = path.with_name(str(arrays["images_file"])) if mapped else arrays["images"]
    except ValueError as error:
        if "Object arrays" in str(error):  # np.savez stores a list of differently sized images as objects
            raise DataError(_sizes_differ(path)) from None
        raise DataError(f"cannot read packed dataset {path}: {error}; expected arrays {PACKED_ARRAYS}") from None
    except (OSError, KeyError, zipfile.BadZipFile) as error:
        raise DataError(f"cannot read packed dataset {path}: {error}; expected arrays {PACKED_ARRAYS}") from None
    if mapped:  # the source reads as the compressed layout's: the same data, described alike
        return _packed_dataset(path, name, open_mapped_images(images), labels, domains, class_names, domain_names,
                               regression, f"packed {path}")
    if images.dtype != np.uint8 or images.ndim not in (3, 4):
        raise DataError(f"{path}: images must be uint8 [N, H, W, C] or [N, H, W], got {images.dtype} with shape "
                        f"{images.shape}; scale them to 0..255 and cast to uint8")
    if images.ndim == 3:
        images = images[..., None]
    images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()
    return _packed_dataset(path, name, images, labels, domains, class_names, domain_names, regression, f"packed {path}")


def _packed_dataset(path: Path, name: str, images: torch.Tensor, labels: np.ndarray, domains: np.ndarray,
                    class_names: tuple[str, ...], domain_names: tuple[str, ...], regression: bool,
                    source: str) -> DomainDataset:
    if not regression and np.issubdtype(labels.dtype, np.floating):
        raise DataError(f"{path}: labels are floats; store class indices as integers, or name the array "
                        "'targets' for a regression dataset")
    try:
        return DomainDataset(
            name=name,
            images=images,
            labels=torch.from_numpy(labels if regression else labels.astype(np.int64)),
            domains=torch.from_numpy(domains),
            class_names=class_names,
            domain_names=domain_names,
            source=source,
        )
    except DataError as error:
        raise DataError(f"{path}: {str(error).removeprefix(f'{name}: ')}") from None


def save_packed(dataset: DomainDataset, path: Path, memory_mapped: bool = False) -> None:
    """Write ``dataset`` in the packed layout, atomically (temporary files renamed into place);
    a regression dataset's float targets go to ``targets`` instead of ``labels``.

    Args:
        dataset: what to write.
        path: the ``.npz``.
        memory_mapped: write the memory-mapped layout (the images uncompressed in
            :func:`images_file` beside ``path``, copied a chunk at a time) instead of one
            compressed ``.npz``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    if dataset.task == "regression":
        answers = {"targets": dataset.labels.numpy().astype(np.float32)}
    else:
        answers = {"labels": dataset.labels.numpy().astype(np.int16)}
    if memory_mapped:
        images_partial = path.with_name(path.stem + ".images.partial.npy")
        written = np.lib.format.open_memmap(images_partial, mode="w+", dtype=np.uint8, shape=tuple(dataset.images.shape))
        for start in range(0, len(dataset), _FLUSH_EVERY):
            written[start : start + _FLUSH_EVERY] = dataset.images[start : start + _FLUSH_EVERY].numpy()
        written.flush()
        del written
        images_partial.replace(images_file(path))
        _write_small_arrays(path, dataset.class_names, dataset.domain_names, **answers,
                            domains=dataset.domains.numpy().astype(np.int8))
        return
    np.savez_compressed(
        partial,
        images=dataset.images.permute(0, 2, 3, 1).numpy(),
        **answers,
        domains=dataset.domains.numpy().astype(np.int8),
        class_names=np.array(dataset.class_names, dtype=str),
        domain_names=np.array(dataset.domain_names),
    )
    partial.replace(path)
