"""What the benchmark scripts share: the ``--smoke`` flag and the synthetic data its runs read.

Every script under ``benchmarks/`` takes ``--smoke``: it then runs at its smallest size, in seconds,
on the embedded MNIST sample or on synthetic images, and prints its figure the usual way. A smoke
run checks that the script still works (``tests/test_benchmarks.py`` runs each one); its figure
measures nothing. A script imports this module as ``_common`` (the script's folder is first on
``sys.path`` when Python runs a script).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

SMOKE_NOTE = "smoke run (smallest size): this checks that the benchmark works; its figure measures nothing"
"""The first line a smoke run prints, so that no one quotes its figure as a measurement."""

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
"""PACS' domain folder names, which ``fedbed.data`` requires of a PACS tree."""


def parse_arguments(parser: argparse.ArgumentParser, arguments: list[str] | None = None,
                    smoke: str = "", **smallest) -> argparse.Namespace:
    """Add ``--smoke`` to ``parser``, parse ``arguments`` (the command line's when ``None``) and,
    under ``--smoke``, set each option named in ``smallest`` to its value there (whatever the
    command line gave) and print :data:`SMOKE_NOTE`.

    Args:
        parser: the script's parser, its own options added.
        arguments: the arguments to parse.
        smoke: what a smoke run does beyond the options of ``smallest`` (its data, say), for ``--help``.
        smallest: option destinations (``repeats``, ``local_steps``) and their smallest values
            (``None`` to drop an option's value, such as a data root).
    """
    settings = " ".join(f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
                        for name, value in smallest.items() if value is not None)
    parser.add_argument("--smoke", action="store_true",
                        help="run at the smallest size, in seconds, to check that the script works (the figure "
                             f"measures nothing): {'; '.join(part for part in (settings, smoke) if part)}")
    parsed = parser.parse_args(arguments)
    if parsed.smoke:
        for name, value in smallest.items():
            setattr(parsed, name, value)
        print(SMOKE_NOTE, flush=True)
    return parsed


def synthetic_pacs(data_root: Path, classes: int = 2, per_class: int = 4, side: int = 40, seed: int = 0) -> Path:
    """Write a tiny PACS in DomainBed's folder layout, ``data_root/PACS/<domain>/<class>/<n>.png``,
    of random RGB images (``classes`` classes and ``per_class`` images of each in every domain,
    ``side`` pixels square) and return ``data_root``, which ``fedbed.data.load_dataset("PACS",
    data_root, size)`` then reads (decoding and resizing the images) as it reads the real one."""
    draw = np.random.default_rng(seed)
    for domain in PACS_DOMAINS:
        for label in range(classes):
            folder = data_root / "PACS" / domain / f"class{label}"
            folder.mkdir(parents=True)
            for number in range(per_class):
                pixels = draw.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{number}.png")
    return data_root


@contextmanager
def smoke_data(smoke: bool, data_root: Path | None) -> Iterator[Path | None]:
    """The data root a script reads: under ``--smoke`` (``smoke``), a tiny synthetic PACS
    (:func:`synthetic_pacs`) in a temporary folder removed on exit; otherwise ``data_root``."""
    if not smoke:
        yield data_root
        return
    with tempfile.TemporaryDirectory(prefix="fedbed-smoke-") as folder:
        yield synthetic_pacs(Path(folder))
