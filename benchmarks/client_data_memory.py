"""Memory of a run's samples: images kept as uint8 until the batch, against float32 model input
held for every sample (what ``ClientData`` stored before images stayed uint8); and the peak
memory of loading the data, building every client and drawing one epoch of batches of 32.

    python benchmarks/client_data_memory.py --data-root ../shared/data --image-size 64
    python benchmarks/client_data_memory.py --data-root ROOT --image-size 224 --memory-mapped

The data root is read as a run reads it (a compressed ``pacs_<S>.npz`` is decompressed whole into
memory). ``--memory-mapped`` first prepares the data root's PACS folder tree at ``--image-size``
into a temporary folder (``fedbed data prepare``, in a child process whose memory is not counted)
and reads that: the memory-mapped layout, whose clients keep indices and whose batches read rows.

Peak RSS (``VmHWM``) counts the pages of a memory map that the process touched: clean page cache,
which the kernel drops under memory pressure; peak anonymous memory (``RssAnon``, sampled after
the load, after building the clients and after every batch) is what the process itself holds.

``--smoke``: a tiny synthetic PACS (``_common.smoke_data``) at 32 px, memory-mapped.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import parse_arguments, smoke_data
from fedbed.build import build_run
from fedbed.config import ExperimentConfig
from fedbed.data.images import ImageRows, mapped_file

BATCH_SIZE = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, default=None, help="holds PACS (required unless --smoke)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--memory-mapped", action="store_true",
                        help="prepare the data root's PACS tree into a temporary memory-mapped copy and read that")
    args = parse_arguments(parser, smoke="a tiny synthetic PACS, memory-mapped", image_size=32, memory_mapped=True)
    if args.data_root is None and not args.smoke:
        parser.error("give --data-root (a folder holding PACS), or --smoke")
    with smoke_data(args.smoke, args.data_root) as data_root:
        if not args.memory_mapped:
            report(data_root, args.image_size)
            return
        with tempfile.TemporaryDirectory(prefix="fedbed-mapped-") as prepared:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "fedbed", "data", "prepare", "PACS", "--size", str(args.image_size),
                            "--data-root", str(data_root), "--output-root", prepared, "--memory-mapped"], check=True, stdout=subprocess.DEVNULL)
            print(f"prepared PACS-{args.image_size} memory-mapped in {time.perf_counter() - started:.1f} s (child process)")
            report(Path(prepared), args.image_size)


def memory() -> dict[str, float]:
    """MiB of ``VmHWM`` (peak RSS), ``RssAnon`` and ``RssFile`` of this process (Linux's
    ``/proc/self/status``; elsewhere the peak from ``getrusage`` alone)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return {"VmHWM": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "RssAnon": float("nan"),
                "RssFile": float("nan")}
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}


def report(data_root: Path, image_size: int) -> None:
    """Build a PACS run from ``data_root`` at ``image_size`` px, print what its samples hold, then
    draw one epoch of batches from every client and print the peak memory."""
    before = memory()
    started = time.perf_counter()
    built = build_run(ExperimentConfig(dataset="PACS", target="art_painting", image_size=image_size,
                                       data_root=data_root, holdout_fraction=0.1, model="resnet18"))
    clients = [built.client_data(k) for k in range(len(built.partitions))]
    sets = clients + [built.data(indices) for indices in built.split.holdout.values()] + [built.data(built.ood_indices)]
    built_in = time.perf_counter() - started
    peak_anon, peak_file = memory()["RssAnon"], memory()["RssFile"]
    mapped = all(isinstance(s.images, ImageRows) and mapped_file(s.images.source) is not None for s in sets)
    held = sum(s.images.numel() * s.images.element_size() for s in sets)
    as_float = sum(s.images.numel() * 4 for s in sets)  # to_model_input gives float32 of the same shape
    count = sum(len(s) for s in sets)
    where = "memory-mapped, not held" if mapped else "rows of the dataset's images, held once by the dataset"
    print(f"PACS-{image_size}: {count} samples; images as uint8 ({where}): {held / 2**20:.1f} MiB; "
          f"as float32 model input: {as_float / 2**20:.1f} MiB ({as_float / held:.1f}x)")
    started, batches = time.perf_counter(), 0
    for number, client in enumerate(clients):
        for batch in client.batches(BATCH_SIZE, torch.Generator().manual_seed(number)):
            batches += 1
            now = memory()
            peak_anon, peak_file = max(peak_anon, now["RssAnon"]), max(peak_file, now["RssFile"])
            del batch
    epoch = time.perf_counter() - started
    after = memory()
    print(f"load and build {len(clients)} clients: {built_in:.1f} s; one epoch, {batches} batches of {BATCH_SIZE}: "
          f"{epoch:.1f} s")
    print(f"peak RSS: {after['VmHWM']:.0f} MiB (before loading: {before['VmHWM']:.0f} MiB); peak anonymous: "
          f"{peak_anon:.0f} MiB; peak file-backed: {peak_file:.0f} MiB; images memory-mapped: {'yes' if mapped else 'no'}")


if __name__ == "__main__":
    main()
