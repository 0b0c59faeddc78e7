"""Images per second for the two ways a run reads image data: decoding a DomainBed folder tree
(PIL decode + Lanczos resize, ``fedbed.data.images.load_image_folders``) and reading the packed
``.npz`` that ``fedbed data prepare`` writes (``fedbed.data.images.load_packed``).

    python benchmarks/data_loading_speed.py --folder ../shared/data/pacs-mini --size 32

``--smoke``: one repeat on a tiny synthetic PACS tree (``_common.smoke_data``) instead of ``--folder``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from _common import parse_arguments, smoke_data
from fedbed.data.images import load_image_folders, load_packed, save_packed


def best_rate(read, count: int, repeats: int) -> float:
    """The best of ``repeats`` timings of ``read()``, as images per second."""
    seconds = min(_timed(read) for _ in range(repeats))
    return count / seconds


def _timed(read) -> float:
    began = time.perf_counter()
    read()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "pacs-mini")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parse_arguments(parser, smoke="a tiny synthetic PACS tree instead of --folder", repeats=1, size=32)
    torch.set_num_threads(1)
    with smoke_data(arguments.smoke, None) as data_root:
        report(arguments.folder if data_root is None else data_root / "PACS", arguments.size, arguments.repeats)


def report(folder: Path, size: int, repeats: int) -> None:
    """Time reading the folder tree ``folder`` at ``size`` px and its packed copy; print both rates."""
    dataset = load_image_folders(folder, folder.name, size)
    count = len(dataset)
    folder_rate = best_rate(lambda: load_image_folders(folder, "x", size), count, repeats)
    with tempfile.TemporaryDirectory() as scratch:
        packed = Path(scratch) / f"data_{size}.npz"
        save_packed(dataset, packed)
        packed_rate = best_rate(lambda: load_packed(packed, "x"), count, repeats)
    print(f"{count} images from {folder} at {size}x{size}, one thread, best of {repeats}")
    print(f"folder tree (decode + resize): {folder_rate:,.0f} images/s")
    print(f"packed .npz:                   {packed_rate:,.0f} images/s ({packed_rate / folder_rate:,.0f}x)")


if __name__ == "__main__":
    main()
