"""The dataset abstractions: :class:`DomainDataset`, the data every FedBed loader returns, and
:class:`DatasetSpec`, what FedBed knows of a dataset before reading it."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch
from torchvision.transforms.v2 import functional as TF


_HASHED_BYTES = 1 << 26
"""Bytes of a tensor hashed at a time by :attr:`DomainDataset.fingerprint` (64 MiB)."""


class DataError(ValueError):
    """Raised when a dataset cannot be found, read or understood.

    The message always names the path or value at fault and what was expected.
    """


@dataclass(frozen=True)
class DomainDataset:
    """Images from several domains with their labels.

    Attributes:
        name: dataset name as registered (e.g. ``"PACS"``, ``"RotatedMNIST"``).
        images: ``uint8`` tensor ``[N, C, H, W]``, pixel values 0..255.
        labels: ``int64`` tensor ``[N]``, indices into ``class_names`` (classification), or
            ``float32`` ``[N]`` targets when ``class_names`` is empty (regression).
        domains: ``int64`` tensor ``[N]``, indices into ``domain_names``.
        class_names: one name per class.
        domain_names: one name per domain, in DomainBed's order.
        source: a human-readable description of where the images were read from.

    Raises:
        DataError: when the tensors disagree in length, have the wrong dtype or rank,
            or hold indices outside the name lists.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    domains: torch.Tensor
    class_names: tuple[str, ...]
    domain_names: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        n = self.images.shape[0]
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DataError(
                f"{self.name}: images must be a uint8 tensor [N, C, H, W], got "
                f"{self.images.dtype} with shape {tuple(self.images.shape)}"
            )
        if self.labels.shape != (n,) or self.domains.shape != (n,):
            raise DataError(
                f"{self.name}: expected {n} labels and {n} domain ids, got "
                f"{tuple(self.labels.shape)} and {tuple(self.domains.shape)}"
            )
        if self.task == "regression":
            if not self.labels.is_floating_point():
                raise DataError(f"{self.name}: a regression dataset (no class names) needs float labels")
        elif self.labels.is_floating_point():
            raise DataError(f"{self.name}: class labels must be integers; give no class names for regression")
        elif n and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.class_names)):
            raise DataError(
                f"{self.name}: a label lies outside 0..{len(self.class_names) - 1} (found "
                f"{int(self.labels.min())}..{int(self.labels.max())}); labels index the {len(self.class_names)} class names"
            )
        if n and (int(self.domains.min()) < 0 or int(self.domains.max()) >= len(self.domain_names)):
            raise DataError(
                f"{self.name}: a domain id lies outside 0..{len(self.domain_names) - 1} (found "
                f"{int(self.domains.min())}..{int(self.domains.max())}); domain ids index the domain names"
            )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def resized(self, size: int) -> "DomainDataset":
        """This dataset with its images resized to ``size`` x ``size`` pixels
        (``torchvision.transforms.v2.functional.resize``, bilinear, antialiased: a packed 32- or
        64-px copy serves a model built for another input size), its source saying so.

        Raises:
            DataError: ``size`` < 1.
        """
        if size < 1:
            raise DataError(f"an image size must be positive, got {size}")
        if self.images.shape[-2:] == (size, size):
            return self
        from torchvision.transforms.v2 import functional

        images = functional.resize(self.images, [size, size], antialias=True)
        side = self.images.shape[-1]
        return DomainDataset(self.name, images.contiguous(), self.labels, self.domains, self.class_names, self.domain_names,
                             f"{self.source}, resized from {side}x{side} to {size}x{size} px (bilinear, antialiased)")

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the images, labels and domain ids as loaded (and the
        class and domain names): equal for the same data read on any machine from any path, and
        from either packed layout (memory-mapped or compressed), different for another file,
        another resize or another sample. Computed once per load, over ``_HASHED_BYTES`` at a
        time (the digest of the whole bytes; memory-mapped images are never all in memory)."""
        digest = hashlib.sha256()
        for tensor in (self.images, self.labels, self.domains):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            rows = max(1, _HASHED_BYTES // max(1, tensor[:1].numel() * tensor.element_size()))
            for start in range(0, len(tensor), rows):
                digest.update(tensor[start : start + rows].contiguous().numpy().tobytes())
        digest.update("\x00".join((*self.class_names, "|", *self.domain_names)).encode())
        return digest.hexdigest()[:16]

    @property
    def task(self) -> str:
        """``"classification"`` or, for a dataset without class names, ``"regression"``."""
        return "classification" if self.class_names else "regression"

    @property
    def num_classes(self) -> int:
        """Number of classes; 1 (one output) for regression."""
        return len(self.class_names) or 1

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    def domain_index(self, domain: str) -> int:
        """Return the id of ``domain``.

        Raises:
            DataError: if ``domain`` is not one of ``domain_names``.
        """
        try:
            return self.domain_names.index(domain)
        except ValueError:
            raise DataError(
                f"{self.name} has no domain {domain!r}; its domains are {', '.join(self.domain_names)}"
            ) from None

    def indices_of_domain(self, domain_id: int) -> torch.Tensor:
        """``int64`` tensor of the sample indices of one domain, in dataset order."""
        return torch.nonzero(self.domains == domain_id, as_tuple=False).flatten()

    def counts(self) -> torch.Tensor:
        """``int64 [domains, classes]``: samples per domain and class (one column for regression)."""
        if self.task == "regression":
            return torch.bincount(self.domains, minlength=len(self.domain_names)).view(-1, 1)
        flat = self.domains * len(self.class_names) + self.labels
        return torch.bincount(flat, minlength=len(self.domain_names) * len(self.class_names)).view(
            len(self.domain_names), len(self.class_names)
        )

    def overview(self) -> list[str]:
        """Lines printed at the start of a run: the domains with their sample counts, then the
        classes with theirs (in the order of ``domain_names`` and ``class_names``, i.e. sorted
        folder names for a folder tree), e.g. ``domains (2): a 40, b 38``."""
        counts = self.counts()
        lines = [f"domains ({len(self.domain_names)}): "
                 + ", ".join(f"{d} {int(n)}" for d, n in zip(self.domain_names, counts.sum(1)))]
        if self.task == "classification":
            lines.append(f"classes ({len(self.class_names)}): "
                         + ", ".join(f"{c} {int(n)}" for c, n in zip(self.class_names, counts.sum(0))))
        else:
            lines.append("task: regression (float targets, no classes)")
        return lines

    def coverage_warnings(self) -> list[str]:
        """One ``warning: ...`` line per class that some domains lack (a client of such a domain
        never sees the class; DomainBed's datasets have every class in every domain), giving its
        count in each domain. Empty for regression and for fully covered classes. Only the
        domains present count (data spread over machines holds some of them, :meth:`conformed`)."""
        if self.task == "regression":
            return []
        present = list(self.present_domains())
        counts = self.counts()[present]
        names = [self.domain_names[d] for d in present]
        warnings = []
        for class_id, class_name in enumerate(self.class_names):
            column = counts[:, class_id]
            if bool((column == 0).any()):
                per_domain = ", ".join(f"{d} {int(n)}" for d, n in zip(names, column))
                warnings.append(f"warning: class {class_name!r} is missing from {int((column == 0).sum())} of "
                                f"{len(names)} domains ({per_domain})")
        return warnings

    def present_domains(self) -> tuple[int, ...]:
        """The ids of the domains that hold at least one sample, ascending (a machine of a
        federation whose data is spread over its sites holds only some, :meth:`conformed`)."""
        return tuple(int(d) for d in torch.unique(self.domains).tolist())

    def conformed(self, domain_names: tuple[str, ...], class_names: tuple[str, ...]) -> "DomainDataset":
        """The same samples indexed by declared domain and class names: the ones every machine of
        a federation agrees on when none of them holds every domain (each site its own, the
        server the target). Domain ``d`` of this dataset becomes ``domain_names.index(d)``, and
        likewise for classes; declared domains without samples here stay empty.

        Args:
            domain_names: the federation's domains, in order (``domain_names`` setting).
            class_names: its classes, in order (``class_names`` setting); empty for regression.

        Raises:
            DataError: a domain or class of this data that is not declared, or class names
                declared for regression data (or missing for classification data).
        """
        undeclared = [d for d in self.domain_names if d not in domain_names]
        if undeclared:
            raise DataError(f"{self.name}: domain(s) {', '.join(undeclared)} are not among the declared domain_names "
                            f"({', '.join(domain_names)}); add them or remove their data")
        if self.task == "regression" and class_names:
            raise DataError(f"{self.name} is a regression dataset (float targets); leave class_names out")
        if self.task == "classification":
            if not class_names:
                raise DataError(f"{self.name} has classes ({', '.join(self.class_names)}); declare class_names so that "
                                "every machine numbers the classes alike")
            undeclared = [c for c in self.class_names if c not in class_names]
            if undeclared:
                raise DataError(f"{self.name}: class(es) {', '.join(undeclared)} are not among the declared class_names "
                                f"({', '.join(class_names)}); add them or remove their images")
        domain_ids = torch.tensor([domain_names.index(d) for d in self.domain_names], dtype=torch.int64)
        labels = self.labels
        if self.task == "classification":
            labels = torch.tensor([class_names.index(c) for c in self.class_names], dtype=torch.int64)[self.labels]
        return DomainDataset(self.name, self.images, labels, domain_ids[self.domains], tuple(class_names),
                             tuple(domain_names), f"{self.source}, indexed by the declared domain and class names")

    def with_channels(self, channels: int) -> "DomainDataset":
        """The same samples with ``channels`` colour channels (``images`` ``uint8 [N, channels, H, W]``).

        Grey to RGB repeats the grey channel three times; RGB to grey takes ITU-R 601-2 luma
        (0.299 R + 0.587 G + 0.114 B, as PIL's ``convert("L")``), both with torchvision's
        ``transforms.v2.functional``. The dataset itself is returned when it already has
        ``channels`` channels.

        Raises:
            DataError: ``channels`` is not 1 or 3, or the images have neither 1 nor 3 channels
                (e.g. ColoredMNIST's 2).
        """
        have = self.input_shape[0]
        if channels == have:
            return self
        if channels not in (1, 3) or have not in (1, 3):
            raise DataError(f"{self.name}: cannot turn {have}-channel images into {channels} channels; "
                            "channels converts grey (1) and RGB (3) into each other")
        convert = TF.grayscale_to_rgb if channels == 3 else TF.rgb_to_grayscale
        return dataclasses.replace(self, images=convert(self.images).contiguous(),
                                   source=f"{self.source}, as {channels} channel(s)")


def join_domains(name: str, parts: list[tuple[torch.Tensor, torch.Tensor]], class_names: tuple[str, ...],
                 domain_names: tuple[str, ...], source: str) -> DomainDataset:
    """One :class:`DomainDataset` from one ``(images uint8 [n, C, H, W], labels int64 [n])`` per
    domain, in the order of ``domain_names`` (all parts of one ``C, H, W``).

    Raises:
        DataError: as :class:`DomainDataset` (e.g. labels outside ``class_names``).
    """
    return DomainDataset(
        name=name,
        images=torch.cat([images for images, _ in parts]).contiguous(),
        labels=torch.cat([labels for _, labels in parts]),
        domains=torch.cat([torch.full((len(labels),), d, dtype=torch.int64) for d, (_, labels) in enumerate(parts)]),
        class_names=class_names,
        domain_names=domain_names,
        source=source,
    )


DatasetLoader = Callable[[Path | None, int], DomainDataset]
"""A dataset's loader: ``loader(data_root, image_size) -> DomainDataset``."""

FolderReader = Callable[[Path, str, int, tuple[str, ...]], DomainDataset]
"""Reads a dataset's own layout in its folder: ``reader(folder, name, image_size, domain_names)``."""

DomainSurvey = Callable[[Path | None], tuple[dict[str, str], dict[str, str]]]
"""``survey(data_root) -> (found, missing)``: for a dataset made of the domains present under the
data root, ``{domain: the files it is read from}`` of the domains found and ``{domain: the files
it would be read from}`` of the others, both in the dataset's domain order."""


@dataclass(frozen=True)
class DatasetSpec:
    """What FedBed knows of one dataset before reading it.

    Attributes:
        name: the name users type (``--dataset``) and runs record; for a dataset given as a path,
            its display name (:func:`fedbed.data.path_datasets.display_name`).
        domain_names: the domain names, in the dataset's order (DomainBed's for the built-in ones).
        folder_names: folder names under the data root that may hold the DomainBed tree
            ``<folder>/<domain>/<class>/<image>`` (empty for datasets built from MNIST).
        default_image_size: side in pixels used when the user gives none.
        default_model: model name (``fedbed.models``) used when the user gives none.
        default_target: the target domain of a run that names none; ``None`` where the dataset
            has no natural default (the run must name one).
        loader: the function that reads it, for a registered dataset
            (:func:`fedbed.data.register_dataset`) and a built-in one read from several
            distributions' files (Digits); ``None`` for the others.
        path: for a dataset given as a path, the path as typed; ``None`` otherwise.
        folder_reader: reads the dataset's own layout in the folder found under
            ``folder_names`` (Camelyon17, FMoW, PovertyMap: WILDS' metadata and images); ``None``: DomainBed's
            folder tree (:func:`fedbed.data.images.load_image_folders`).
        layout: what the folder under ``folder_names`` holds, as error messages name it.
        survey: for a dataset made of the domains found under the data root (Digits), what is
            found and missing (:data:`DomainSurvey`); ``domain_names`` then lists every domain
            it may have, and :func:`fedbed.data.catalog.with_found_domains` narrows them to
            those found. ``None``: every domain is always there.
    """

    name: str
    domain_names: tuple[str, ...]
    folder_names: tuple[str, ...] = ()
    default_image_size: int = 32
    default_model: str = "hfedf_cnn"
    default_target: str | None = None
    loader: DatasetLoader | None = None
    path: str | None = None
    folder_reader: FolderReader | None = None
    layout: str = "<domain>/<class>/<image>"
    survey: DomainSurvey | None = None

    def domain_named(self, name: str) -> str | None:
        """The domain whose name equals ``name`` ignoring case, in its canonical spelling, or ``None``."""
        return next((domain for domain in self.domain_names if domain.lower() == name.lower()), None)

    @property
    def packed_key(self) -> str:
        return self.name.lower()

    def packed_path(self, data_root: Path, image_size: int) -> Path:
        """``data_root/<name lowercased>/<name lowercased>_<size>.npz``, the prepared copy."""
        return data_root / self.packed_key / f"{self.packed_key}_{image_size}.npz"


def portable_source(source: str) -> str:
    """A source description (:attr:`DomainDataset.source`) without the folders of its paths
    (``packed ../data/pacs/pacs_32.npz`` -> ``packed pacs_32.npz``): the same data read on two
    machines, or through two data roots, is described alike."""
    return re.sub(r"(?<!\S)\S*/(\S+)", r"\1", source)
