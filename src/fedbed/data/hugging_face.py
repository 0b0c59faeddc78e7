"""Hugging Face datasets as FedBed data: ``--dataset hf:<hub name or local path>``.

Flower Datasets' domain datasets (``flwrlabs/pacs``, ``flwrlabs/office-home``, ...) are Hugging
Face datasets with one row per image and three columns: ``image`` (an ``Image`` feature),
``label`` (a ``ClassLabel``) and ``domain`` (a string naming the image's domain), as their dataset
cards' ``dataset_info`` lists them (huggingface.co/datasets/flwrlabs/pacs,
huggingface.co/datasets/flwrlabs/office-home). Those are the default columns; a run names others
with the ``image_column``, ``label_column`` and ``domain_column`` settings
(:class:`HuggingFaceColumns`).

Where the data is read from, through the ``datasets`` library (the optional extra
``pip install "fedbed[hf]"``):

- ``hf:NAME`` (``org/name`` or ``name``, not an existing path): ``datasets.load_dataset(NAME)``,
  which on a connected machine downloads the dataset into Hugging Face's cache and offline
  (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) reads that cache;
- ``hf:FOLDER``: a ``save_to_disk`` copy (``datasets.load_from_disk``: ``state.json`` or
  ``dataset_dict.json`` in it), else the ``.parquet`` files under it
  (``datasets.load_dataset("parquet", data_files=...)``); ``hf:FILE.parquet`` that one file.

Every split is used (concatenated in the dataset's order): leave-one-domain-out splits by domain.

The first run at an image size packs the dataset once into FedBed's packed layout
(:mod:`fedbed.data.images`: every image decoded to RGB and resized to ``size`` x ``size`` with
Lanczos, as a folder tree's; memory-mapped from :data:`~fedbed.data.images.MEMORY_MAPPED_FROM`
px on), in ``<HF_DATASETS_CACHE>/fedbed-packed/<name>-<key>/<name>_<size>.npz``, where ``key``
digests the dataset's reference, the columns and, for a local copy, its files' paths, sizes and
modification times (a changed copy is packed again). Later runs, and validation, read the packed
file without opening the dataset through ``datasets``. Domains: a ``ClassLabel`` domain column's
names (in its order, those that hold samples), else the column's distinct values sorted. Classes: a
``ClassLabel`` label column's names, else its distinct values sorted; a float label column is a
regression target. The data fingerprint (:attr:`fedbed.data.DomainDataset.fingerprint`) is that of
the packed arrays, equal for the same data packed from the Hub, a ``save_to_disk`` copy or parquet files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from fedbed.data.base import DataError, DatasetSpec, DomainDataset
from fedbed.data.images import (
    MEMORY_MAPPED_FROM,
    packed_header,
    save_packed,
    square_rgb,
    write_mapped_images,
)
from fedbed.data.path_datasets import DEFAULT_IMAGE_SIZE, nearest_packed_file, packed_files, read_square_packed

PREFIX = "hf:"
"""How ``--dataset`` names a Hugging Face dataset: ``hf:flwrlabs/pacs``, ``hf:./pacs_copy``."""

INSTALL = 'pip install "fedbed[hf]"'
"""How to install the ``datasets`` library FedBed reads Hugging Face datasets with."""

PACKED_FOLDER = "fedbed-packed"
"""The folder, inside the ``datasets`` library's cache (``HF_DATASETS_CACHE``), of the packed copies."""

_DECODED_AT_ONCE = 64
"""Images decoded per read from the dataset while packing."""

_SAVE_TO_DISK_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class HuggingFaceColumns:
    """The columns a Hugging Face dataset's samples are read from (the ``image_column``,
    ``label_column`` and ``domain_column`` settings; the defaults are Flower Datasets' names).

    Attributes:
        image: an ``Image`` feature.
        label: a ``ClassLabel``, strings or integers (classification), or floats (regression).
        domain: a ``ClassLabel``, strings or integers naming each sample's domain.
    """

    image: str = "image"
    label: str = "label"
    domain: str = "domain"

    @classmethod
    def from_settings(cls, image: str | None = None, label: str | None = None,
                      domain: str | None = None) -> "HuggingFaceColumns":
        """The columns named by a run's settings, an unset one (``None``) taking its default."""
        given = {"image": image, "label": label, "domain": domain}
        return cls(**{key: value for key, value in given.items() if value is not None})

    def described(self) -> str:
        """``columns IMAGE, LABEL, DOMAIN``: how messages name the columns read."""
        return f"columns {self.image}, {self.label}, {self.domain}"


def is_hugging_face(name: str) -> bool:
    """Whether a ``--dataset`` value names a Hugging Face dataset (``hf:...``, any case)."""
    return name[: len(PREFIX)].lower() == PREFIX


@dataclass(frozen=True)
class HuggingFaceSource:
    """Where an ``hf:`` dataset is read from.

    Attributes:
        name: ``hf:<reference>``, the name runs record.
        reference: the hub name or path as given.
        local: the resolved path of a local copy (folder or ``.parquet`` file); ``None`` for a hub name.
        signature: for a local copy, a digest of its files' relative paths, sizes and
            modification times (empty for a hub name).
    """

    name: str
    reference: str
    local: Path | None
    signature: str

    @property
    def display_name(self) -> str:
        """:func:`hugging_face_display_name` of :attr:`name`."""
        return hugging_face_display_name(self.name)


def hugging_face_display_name(text: str) -> str:
    """The name of the ``hf:`` dataset ``text`` as a file name, without reading anything: the
    folder's name, a ``.parquet`` file's stem, or a hub name's last part (``hf:flwrlabs/pacs`` ->
    ``pacs``); a run's default folder is ``runs/<this>/...`` and the packed files are named by it."""
    reference = text[len(PREFIX):].strip()
    path = Path(reference).expanduser()
    stem = path.stem if reference.endswith(".parquet") else (path.name or path.resolve().name)
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "dataset"


def hugging_face_source(text: str) -> HuggingFaceSource:
    """Read ``hf:<reference>``: a local copy when the path exists or is written as a path (it
    starts with ``.``, ``/`` or ``~``, holds a backslash or more than one ``/``, or ends in
    ``.parquet``), else a hub name.

    Raises:
        DataError: no reference, or a path that does not exist.
    """
    reference = text[len(PREFIX):].strip()
    if not reference:
        raise DataError(f"{text!r} names no dataset; give hf:<hub name> (e.g. hf:flwrlabs/pacs) or hf:<folder> holding "
                        "a save_to_disk copy or parquet files")
    name, path = PREFIX + reference, Path(reference).expanduser()
    if path.exists():
        path = path.resolve()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        digest = hashlib.sha256()
        for file in files:
            status = file.stat()
            digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{status.st_size}\0"
                          f"{status.st_mtime_ns}\n".encode())
        return HuggingFaceSource(name, reference, path, digest.hexdigest()[:16])
    if reference.startswith((".", "/", "~")) or "\\" in reference or reference.count("/") > 1 or reference.endswith(
            ".parquet"):
        raise DataError(f"{name}: no folder or file {path}; looked for a save_to_disk copy or parquet files there: give "
                        "the folder holding them, or hf:<hub name> on a connected machine")
    return HuggingFaceSource(name, reference, None, "")


def _datasets_library(name: str) -> Any:
    """The ``datasets`` module.

    Raises:
        DataError: it is not installed, naming the extra that installs it.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(f"{name} is read with Hugging Face's datasets library, which is not installed: "
                        f"{INSTALL}") from None
    return datasets


def packed_folder(source: HuggingFaceSource, columns: HuggingFaceColumns) -> Path:
    """The folder of ``source``'s packed copies read through ``columns``:
    ``<HF_DATASETS_CACHE>/fedbed-packed/<display name>-<key>`` (see the module's docstring).

    Raises:
        DataError: the ``datasets`` library is not installed.
    """
    cache = Path(_datasets_library(source.name).config.HF_DATASETS_CACHE)
    identity = {"reference": str(source.local) if source.local is not None else source.reference,
                "signature": source.signature, "columns": dataclasses.astuple(columns)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return cache / PACKED_FOLDER / f"{source.display_name}-{key}"


@lru_cache(maxsize=2)
def opened(source: HuggingFaceSource) -> Any:
    """``source`` opened through the ``datasets`` library, every split concatenated in order: a
    ``datasets.Dataset`` (its rows are read lazily from Arrow files). Kept for the process's next
    call (validation opens it, the first run's packing reads it).

    Raises:
        DataError: ``datasets`` not installed, a folder holding neither a ``save_to_disk`` copy
            nor parquet files, or a dataset that cannot be loaded (offline and not in the cache,
            unknown on the Hub, unreadable files): one line saying what was looked for and what to do.
    """
    datasets = _datasets_library(source.name)
    local = source.local
    try:
        if local is None:
            loaded = datasets.load_dataset(source.reference)
        elif local.is_dir() and any((local / marker).is_file() for marker in _SAVE_TO_DISK_MARKERS):
            loaded = datasets.load_from_disk(str(local))
        else:
            files = [local] if local.is_file() else sorted(local.rglob("*.parquet"))
            if not files or any(file.suffix != ".parquet" for file in files):
                markers = " or ".join(_SAVE_TO_DISK_MARKERS)
                raise DataError(f"{source.name}: {local} holds neither a save_to_disk copy ({markers}) nor .parquet "
                                "files; save the dataset there with save_to_disk or to_parquet")
            loaded = datasets.load_dataset("parquet", data_files=[str(file) for file in files], split="train")
    except DataError:
        raise
    except Exception as error:  # datasets and the Hub fail in many ways (offline, unknown name, bad files): one line
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if local is None:
            raise DataError(f"{source.name}: cannot load {source.reference!r} from the Hugging Face Hub or its cache "
                            f"({reason}); run it once on a connected machine (HF_HUB_OFFLINE unset) to download it, or "
                            "give hf:<folder> holding a save_to_disk copy or parquet files") from None
        raise DataError(f"{source.name}: cannot read {local} with the datasets library ({reason}); give a folder "
                        "written by save_to_disk or to_parquet") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded.values())
        loaded = splits[0] if len(splits) == 1 else datasets.concatenate_datasets(splits)
    return loaded


def _checked_columns(dataset: Any, source: HuggingFaceSource, columns: HuggingFaceColumns) -> None:
    """Raise a :class:`DataError` naming the setting to change when a column is missing or the
    image column holds no images."""
    import datasets

    present = list(dataset.column_names)
    for setting, column in (("image_column", columns.image), ("label_column", columns.label),
                            ("domain_column", columns.domain)):
        if column not in present:
            raise DataError(f"{source.name} has no column {column!r} (its columns: {', '.join(present)}); set {setting} "
                            "to one of them")
    if not isinstance(dataset.features[columns.image], datasets.Image):
        images = [name for name, feature in dataset.features.items() if isinstance(feature, datasets.Image)]
        raise DataError(f"{source.name}: column {columns.image!r} holds {_kind(dataset.features[columns.image])} values, "
                        f"not images; set image_column to a column of images ({', '.join(images) or 'it has none'})")


def _kind(feature: Any) -> str:
    """A feature's kind as messages name it: a ``Value``'s dtype (``int64``), else the feature's type (``ClassLabel``)."""
    return getattr(feature, "dtype", "") if type(feature).__name__ == "Value" else type(feature).__name__


def _indexed(dataset: Any, source: HuggingFaceSource, column: str, setting: str,
             allow_floats: bool) -> tuple[tuple[str, ...], np.ndarray]:
    """``(names, ids)`` of a column: a ``ClassLabel``'s names and ids, or the sorted distinct
    values (as text) and each row's index among them; with ``allow_floats``, a float column gives
    ``((), float32 values)`` (regression targets).

    Raises:
        DataError: empty values, or a column of another kind (lists, images, floats where not allowed).
    """
    import datasets

    feature = dataset.features[column]
    values = dataset.with_format("arrow")[column]
    if values.null_count:
        raise DataError(f"{source.name}: column {column!r} has {values.null_count} empty value(s); fill them or drop "
                        "those rows")
    if isinstance(feature, datasets.ClassLabel):
        ids = values.to_numpy().astype(np.int64)
        if (ids < 0).any():
            raise DataError(f"{source.name}: column {column!r} has {int((ids < 0).sum())} row(s) of ClassLabel -1 (no "
                            "value, e.g. an unlabelled test split); drop them before saving the dataset")
        return tuple(feature.names), ids
    dtype = getattr(feature, "dtype", "")
    if allow_floats and dtype.startswith("float"):
        return (), values.to_numpy().astype(np.float32)
    if not isinstance(feature, datasets.Value) or not (dtype in ("string", "large_string", "bool") or "int" in dtype):
        raise DataError(f"{source.name}: column {column!r} holds {_kind(feature)} values; set {setting} to a column of "
                        "class labels, strings or integers")
    raw = values.to_pylist()
    distinct = sorted(set(raw))
    position = {value: index for index, value in enumerate(distinct)}
    return tuple(str(value) for value in distinct), np.array([position[value] for value in raw], dtype=np.int64)


def _answers(dataset: Any, source: HuggingFaceSource, columns: HuggingFaceColumns,
             ) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """``(labels, class names, domain ids, domain names)`` of ``dataset``: labels int64 ``[N]``
    (float32 for regression, no class names), domain ids int64 ``[N]`` into the domains that
    hold samples.

    Raises:
        DataError: as :func:`_checked_columns` and :func:`_indexed`, or fewer than two domains.
    """
    _checked_columns(dataset, source, columns)
    class_names, labels = _indexed(dataset, source, columns.label, "label_column", allow_floats=True)
    all_domains, domain_ids = _indexed(dataset, source, columns.domain, "domain_column", allow_floats=False)
    present = np.unique(domain_ids)
    if len(present) < 2:
        raise DataError(f"{source.name}: column {columns.domain!r} names {len(present)} domain; leave-one-domain-out "
                        "needs at least two: set domain_column to the column naming each image's domain")
    if len(present) > np.iinfo(np.int8).max:
        raise DataError(f"{source.name}: column {columns.domain!r} names {len(present)} domains; the packed layout holds "
                        f"at most {np.iinfo(np.int8).max}: set domain_column to the column naming each image's domain")
    remap = np.full(len(all_domains), -1, dtype=np.int64)
    remap[present] = np.arange(len(present))
    return labels, class_names, remap[domain_ids], tuple(all_domains[index] for index in present)


def _square_images(dataset: Any, source: HuggingFaceSource, column: str, size: int) -> Iterator[np.ndarray]:
    """Each row's image decoded (by ``datasets``, to PIL) and made RGB ``uint8 [size, size, 3]``
    (:func:`fedbed.data.images.square_rgb`), in row order, a few rows decoded at a time.

    Raises:
        DataError: an image that cannot be decoded, naming its rows.
    """
    images = dataset.select_columns([column])
    for start in range(0, len(images), _DECODED_AT_ONCE):
        stop = min(start + _DECODED_AT_ONCE, len(images))
        try:
            decoded = images[start:stop][column]
            squares = [square_rgb(image, size) for image in decoded]
        except Exception as error:  # PIL and datasets raise many kinds on a broken image
            raise DataError(f"{source.name}: cannot decode the images of rows {start}..{stop - 1} ({error}); fix or "
                            "drop them") from None
        yield from squares


def _pack(source: HuggingFaceSource, columns: HuggingFaceColumns, size: int, target: Path, memory_mapped: bool) -> None:
    """Decode ``source`` once into the packed layout at ``target`` (written atomically)."""
    dataset = opened(source)
    labels, class_names, domains, domain_names = _answers(dataset, source, columns)
    images = _square_images(dataset, source, columns.image, size)
    try:
        if memory_mapped:
            answer = {"targets": labels} if not class_names else {"labels": labels.astype(np.int16)}
            write_mapped_images(target, images, len(labels), size, class_names, domain_names,
                                domains=domains.astype(np.int8), **answer)
            return
        stacked = np.stack(list(images)) if len(labels) else np.zeros((0, size, size, 3), np.uint8)
        save_packed(DomainDataset(source.name, torch.from_numpy(stacked).permute(0, 3, 1, 2).contiguous(),
                                  torch.from_numpy(labels), torch.from_numpy(domains), class_names, domain_names,
                                  source.name), target)
    except OSError as error:
        raise DataError(f"cannot write the packed copy {target}: {error.strerror or error}; set HF_DATASETS_CACHE to a "
                        "folder you can write") from None


@dataclass(frozen=True)
class HuggingFaceLoader:
    """The loader (:data:`fedbed.data.base.DatasetLoader`) of one ``hf:`` dataset read through
    given columns: the packed copy at the run's image size, packed first if absent
    (:func:`pack_hugging_face`); ``data_root`` is not used.

    Attributes:
        source: where the dataset comes from.
        columns: the columns read.
        folder: the folder of its packed copies (:func:`packed_folder`).
    """

    source: HuggingFaceSource
    columns: HuggingFaceColumns
    folder: Path

    def packed_path(self, size: int) -> Path:
        """``<folder>/<display name>_<size>.npz``."""
        return self.folder / f"{self.source.display_name}_{size}.npz"

    def __call__(self, data_root: Path | None, image_size: int) -> DomainDataset:
        """The dataset at ``image_size`` px: ``images`` uint8 ``[N, 3, S, S]`` (memory-mapped from
        :data:`~fedbed.data.images.MEMORY_MAPPED_FROM` px on), named ``hf:<reference>``.

        Raises:
            DataError: as :func:`pack_hugging_face` when it must be packed, and
                :func:`fedbed.data.images.load_packed`.
        """
        target = self.packed_path(image_size)
        if not target.is_file():
            pack_hugging_face(self, image_size)
        dataset = read_square_packed(target, self.source.name, image_size)
        return dataclasses.replace(dataset, source=f"{self.source.name} ({self.columns.described()}), packed {target}")


def pack_hugging_face(loader: HuggingFaceLoader, size: int, memory_mapped: bool | None = None) -> Path:
    """Pack ``loader``'s dataset at ``size`` px into :meth:`HuggingFaceLoader.packed_path`, once:
    under a file lock in its folder, so processes that need it at the same time (a sweep's
    workers, a Flower simulation's clients) pack it once and read it alike.

    Args:
        loader: the dataset and its columns.
        size: side in pixels.
        memory_mapped: the layout; ``None``: memory-mapped from
            :data:`~fedbed.data.images.MEMORY_MAPPED_FROM` px on. Given, the copy is written
            again even if present (``fedbed data prepare``).

    Returns:
        The packed ``.npz``.

    Raises:
        DataError: as :func:`opened` and the column checks (a missing column, no images, fewer
            than two domains), an undecodable image, or a folder that cannot be written.
    """
    from filelock import FileLock  # a dependency of datasets

    target = loader.packed_path(size)
    try:
        loader.folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot create {loader.folder}: {error.strerror or error}; set HF_DATASETS_CACHE to a folder "
                        "you can write") from None
    with FileLock(str(loader.folder / ".packing.lock")):
        if memory_mapped is not None or not target.is_file():
            mapped = size >= MEMORY_MAPPED_FROM if memory_mapped is None else memory_mapped
            _pack(loader.source, loader.columns, size, target, mapped)
    return target


def hugging_face_spec(text: str, columns: HuggingFaceColumns | None = None) -> DatasetSpec:
    """What the ``hf:`` dataset ``text`` read through ``columns`` is: its domains from a packed
    copy's header when one exists (the dataset is not opened), else from the dataset opened
    through ``datasets`` (:func:`opened`; a hub name not yet in the cache is downloaded on a
    connected machine), its columns checked. Default image size 32 px and ``hfedf_cnn``, as
    for a folder tree (:func:`fedbed.data.path_datasets.path_dataset_spec`).

    Raises:
        DataError: ``datasets`` not installed (naming the extra), a path that does not exist,
            a dataset that cannot be loaded, a missing column or one of the wrong kind, fewer
            than two domains; each one line saying what was looked for and what to do.
    """
    columns = columns or HuggingFaceColumns()
    source = hugging_face_source(text)
    loader = HuggingFaceLoader(source, columns, packed_folder(source, columns))
    packed = nearest_packed_file(packed_files(loader.folder, source.display_name), DEFAULT_IMAGE_SIZE) \
        if loader.folder.is_dir() else None
    if packed is not None:
        domain_names = packed_header(packed)[0]
    else:
        domain_names = _domain_names_before_packing(source, columns)
    return DatasetSpec(source.name, domain_names, default_image_size=DEFAULT_IMAGE_SIZE, default_model="hfedf_cnn",
                       loader=loader)


@lru_cache(maxsize=8)
def _domain_names_before_packing(source: HuggingFaceSource, columns: HuggingFaceColumns) -> tuple[str, ...]:
    """The domains of a dataset not packed yet, read once per process: validation, a sweep's
    expansion and the build each look them up (a local copy's ``signature`` changes when its
    files do, so an edited copy is read again)."""
    return _answers(opened(source), source, columns)[3]


def hugging_face_loader(spec: DatasetSpec) -> HuggingFaceLoader | None:
    """The loader of ``spec`` when it is an ``hf:`` dataset, else ``None``."""
    return spec.loader if isinstance(spec.loader, HuggingFaceLoader) else None


def describe_hugging_face(loader: HuggingFaceLoader, image_size: int) -> str:
    """Where an ``hf:`` dataset is read from at ``image_size`` px (``fedbed datasets``)."""
    target = loader.packed_path(image_size)
    if target.is_file():
        return f"packed {target}"
    where = f"the Hugging Face Hub (or its cache) as {loader.source.reference}" if loader.source.local is None \
        else f"{loader.source.local}"
    return f"{where}, {loader.columns.described()} (packed into {target} at its first run)"
