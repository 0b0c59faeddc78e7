"""Time the main job, ``fedbed run`` with no arguments, and print its wall time and accuracy.

Goal (README, "Run the main job"): under 90 s on 2 cores, with a clearly non-trivial ood accuracy.

    python benchmarks/main_job.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fedbed", "run", "--run-dir", str(Path(folder) / "run"), "--no-progress"],
                       check=True, capture_output=True, cwd=folder,
                       env={k: v for k, v in os.environ.items() if k != "FEDBED_DATA"})  # the embedded sample
        seconds = time.perf_counter() - began
        summary = json.loads((Path(folder) / "run" / "summary.json").read_text())
    last = summary["selection"]["last"]
    print(f"fedbed run (no arguments): {seconds:.1f} s wall, {summary['rounds']} rounds, "
          f"id {last['id_mean']:.1f}%, ood {last['ood_mean']:.1f}% (target {summary['target']}, {summary['data_source']})")


if __name__ == "__main__":
    main()
