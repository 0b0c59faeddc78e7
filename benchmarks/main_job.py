"""Time the main job, ``fedbed run`` with no arguments, and print its wall time and accuracy.

Goal (README, "Run the main job"): under 90 s on 2 cores, with a clearly non-trivial ood accuracy.

    python benchmarks/main_job.py [--smoke]

``--smoke``: the main job cut to one round of two local batches (``--rounds 1 --local-steps 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import parse_arguments

SMOKE_OPTIONS = ["--rounds", "1", "--local-steps", "2"]
"""``fedbed run`` options of a smoke run: the main job's data and model, one round of two batches."""


def main() -> None:
    args = parse_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                           smoke=" ".join(["fedbed run", *SMOKE_OPTIONS]))
    options = SMOKE_OPTIONS if args.smoke else []
    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fedbed", "run", "--run-dir", str(Path(folder) / "run"), "--no-progress",
                        *options],
                       check=True, capture_output=True, cwd=folder,
                       env={k: v for k, v in os.environ.items() if k != "FEDBED_DATA"})  # the embedded sample
        seconds = time.perf_counter() - began
        summary = json.loads((Path(folder) / "run" / "summary.json").read_text())
    last = summary["selection"]["last"]
    print(f"fedbed run ({' '.join(options) or 'no arguments'}): {seconds:.1f} s wall, {summary['rounds']} rounds, "
          f"id {last['id_mean']:.1f}%, ood {last['ood_mean']:.1f}% (target {summary['target']}, {summary['data_source']})")


if __name__ == "__main__":
    main()
