"""Which code made a run: FedBed's version and a fingerprint of its source, torch, Python, the
thread count and the CPU instruction set, recorded each time a run starts or resumes.

A change to a method's code can change its numbers while every setting stays the same, so a
finished sweep job (skipped because its settings hash matches, :func:`fedbed.sweep.config_hash`)
may hold numbers the current code no longer gives. ``fedbed report`` reads these records and
warns when the runs of one table were made by different code (:func:`source_mix`,
:func:`code_versions`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from fedbed.federation.devices import device_description
from fedbed.run_directory import PROVENANCE_NAME

UNRECORDED = "unrecorded"
"""The source fingerprint of a run whose summary holds no provenance (made before it was recorded)."""


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """The first 12 hex digits of the SHA-256 of every ``.py`` file of the installed ``fedbed``
    package (relative path and bytes, in sorted path order). Any edit to the source, docstrings
    included, changes it; equal fingerprints mean the same code."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


CPU_KERNEL_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables that cap the instruction set of torch's own CPU kernels (ATen), of
MKL's and of oneDNN's (e.g. ``avx2``, ``AVX2``, ``AVX2`` on an AVX512 machine, to remake and
continue records made on an AVX2 one); :func:`current_provenance` records those set."""

AVX2_KERNEL_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The :data:`CPU_KERNEL_CAPS` values that make an AVX512 machine compute as an AVX2 one does, in
the last bit for every record checked (README, "Results that persist")."""


def kernel_caps_prefix(caps: dict[str, str]) -> str:
    """``caps`` as the environment assignments to write before a command, e.g.
    ``"ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"`` for
    :data:`AVX2_KERNEL_CAPS`."""
    return " ".join(f"{name}={value}" for name, value in caps.items())


def current_provenance() -> dict[str, Any]:
    """``{"fedbed", "source", "torch", "python", "torch_threads", "torch_cpu_capability",
    "cpu_kernel_caps"}``: FedBed's version, its :func:`source_fingerprint`, torch's and Python's
    versions, torch's intra-op threads (float reductions, and so the last digits of a run, can
    depend on it), the instruction set torch's CPU kernels use (``"AVX2"``, ``"AVX512"``,
    ``"DEFAULT"``...) and the :data:`CPU_KERNEL_CAPS` set in the environment (name to value;
    empty when none is): the same code, seed and settings give different last bits on another
    kind of machine, and training amplifies them (``tests/test_bit_identity.py``)."""
    try:
        version = metadata.version("fedbed")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        version = "unknown"
    return {
        "fedbed": version,
        "source": source_fingerprint(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernel_caps": {name: os.environ[name] for name in CPU_KERNEL_CAPS if name in os.environ},
    }


def record_start(run_dir: Path, completed_rounds: int, data_fingerprint: str | None = None,
                 device: torch.device | None = None, init_from: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Append this start of the run to ``run_dir/provenance.jsonl`` and return every start
    recorded so far, oldest first.

    Args:
        run_dir: the run directory (exists).
        completed_rounds: rounds the run had completed before this start (0 for a new run, which
            also clears the record of an earlier run in the folder; the checkpoint's round for a
            resumed one). A resumed run without a record (begun before starts were recorded)
            gets a first start from round 0 whose source is :data:`UNRECORDED`.
        data_fingerprint: the data this start reads (:attr:`fedbed.data.DomainDataset.fingerprint`).
        device: where this start computes: its name, and the CUDA and cuDNN versions
            (:func:`fedbed.federation.devices.device_description`).
        init_from: the warm start's source (:attr:`fedbed.build.BuiltRun.warm_start`'s record:
            its run folder, method, round and model digest), recorded on every start.
    """
    path = run_dir / PROVENANCE_NAME
    if completed_rounds == 0:
        path.unlink(missing_ok=True)
    elif not path.exists():
        path.write_text(json.dumps({"after_round": 0, "source": UNRECORDED}) + "\n")
    with path.open("a") as log:
        data = {"data_fingerprint": data_fingerprint} if data_fingerprint is not None else {}
        placed = device_description(device) if device is not None else {}
        warm = {"init_from": init_from} if init_from is not None else {}
        log.write(json.dumps({"after_round": completed_rounds, **current_provenance(), **data, **placed, **warm}) + "\n")
    return read_starts(run_dir)


def read_starts(run_dir: Path) -> list[dict[str, Any]]:
    """Every start recorded in ``run_dir/provenance.jsonl``, oldest first (empty if none)."""
    path = run_dir / PROVENANCE_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_sources(summary: dict[str, Any]) -> list[str]:
    """The source fingerprints that started or resumed the run of ``summary`` (a ``summary.json``),
    each once, in start order; ``[UNRECORDED]`` for a run made before starts were recorded."""
    return list(dict.fromkeys(start["source"] for start in summary.get("provenance") or [])) or [UNRECORDED]


def source_mix(summaries: list[dict[str, Any]]) -> Counter:
    """How many of ``summaries`` each code made: the key is a run's :func:`run_sources` joined
    with ``"+"`` (``"a+b"``: begun under ``a``, resumed under ``b``). Only the source
    fingerprint counts: torch's version and thread count are recorded for the reader but not
    compared (the thread count alone can move the last digits, see :func:`current_provenance`)."""
    return Counter("+".join(run_sources(summary)) for summary in summaries)


def code_versions(summaries: list[dict[str, Any]]) -> set[str]:
    """The distinct source fingerprints (:func:`run_sources`) of ``summaries``; more than one
    means the runs, or parts of one run, were made by different code."""
    return {source for summary in summaries for source in run_sources(summary)}
