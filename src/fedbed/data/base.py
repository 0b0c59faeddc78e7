"""The one dataset abstraction every FedBed loader returns."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property

import torch


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
            raise DataError(f"{self.name}: a label lies outside 0..{len(self.class_names) - 1}")
        if n and (int(self.domains.min()) < 0 or int(self.domains.max()) >= len(self.domain_names)):
            raise DataError(f"{self.name}: a domain id lies outside 0..{len(self.domain_names) - 1}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the images, labels and domain ids as loaded (and the
        class and domain names): equal for the same data read on any machine from any path,
        different for another file, another resize or another sample. Computed once per load."""
        digest = hashlib.sha256()
        for tensor in (self.images, self.labels, self.domains):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            digest.update(tensor.contiguous().numpy().tobytes())
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


def portable_source(source: str) -> str:
    """A source description (:attr:`DomainDataset.source`) without the folders of its paths
    (``packed ../data/pacs/pacs_32.npz`` -> ``packed pacs_32.npz``): the same data read on two
    machines, or through two data roots, is described alike."""
    return re.sub(r"(?<!\S)\S*/(\S+)", r"\1", source)
