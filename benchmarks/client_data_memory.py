"""Memory of a run's samples: images kept as uint8 until the batch, against float32 model input
held for every sample (what ``ClientData`` stored before images stayed uint8).

    python benchmarks/client_data_memory.py --data-root ../shared/data --image-size 64

``--smoke``: a tiny synthetic PACS (``_common.smoke_data``) at 32 px instead of the data root's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import parse_arguments, smoke_data
from fedbed.build import build_run
from fedbed.config import ExperimentConfig
from fedbed.federation.local_data import to_model_input


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", type=Path, default=None, help="holds PACS (required unless --smoke)")
    parser.add_argument("--image-size", type=int, default=64)
    args = parse_arguments(parser, smoke="a tiny synthetic PACS", image_size=32)
    if args.data_root is None and not args.smoke:
        parser.error("give --data-root (a folder holding PACS), or --smoke")
    with smoke_data(args.smoke, args.data_root) as data_root:
        report(data_root, args.image_size)


def report(data_root: Path, image_size: int) -> None:
    """Build a PACS run from ``data_root`` at ``image_size`` px and print what its samples hold."""
    built = build_run(ExperimentConfig(dataset="PACS", target="art_painting", image_size=image_size,
                                       data_root=data_root, holdout_fraction=0.1, model="resnet18"))
    sets = [built.client_data(k) for k in range(len(built.partitions))]
    sets += [built.data(indices) for indices in built.split.holdout.values()] + [built.data(built.ood_indices)]
    held = sum(s.images.numel() * s.images.element_size() for s in sets)
    as_float = sum(to_model_input(s.images, s.scaling).numel() * 4 for s in sets)
    count = sum(len(s) for s in sets)
    print(f"PACS-{image_size}: {count} samples; images held as uint8: {held / 2**20:.1f} MiB; "
          f"as float32 model input: {as_float / 2**20:.1f} MiB ({as_float / held:.1f}x)")


if __name__ == "__main__":
    main()
