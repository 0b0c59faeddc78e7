"""Where a run computes and in which precision: the one place that names a device.

``device`` (a run setting): ``auto`` (the first CUDA device if there is one, else the CPU),
``cpu``, ``cuda``, ``cuda:N`` or ``mps``; :func:`resolve_device` turns it into a
:class:`torch.device` once per process (a deployment's SuperNodes each resolve their own).
Everything else receives that ``torch.device`` and never writes a device's name
(``tests/test_architecture.py`` checks it). What crosses the client/server boundary (payloads,
replies), the checkpoints and every client's state between rounds stay on the CPU
(:func:`to_host`), so a federation of many stateful clients holds one model on the device.

``precision`` (a run setting): ``fp32``, or ``bf16`` / ``fp16`` mixed precision through
:func:`torch.autocast` around the clients' forward passes and losses (:func:`autocast`), with
a gradient scaler for ``fp16`` (:func:`gradient_scaler`, torch's ``torch.amp.GradScaler``, which
exists for CPUs too, so every path runs on a CPU); the server's aggregation and the evaluation
stay in fp32. bf16 is the reduced precision a CPU computes natively; fp16 on a CPU is emulated
and slow.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any, Literal

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
"""The values of the ``device`` setting."""

PRECISIONS = ("fp32", "bf16", "fp16")
"""The values of the ``precision`` setting."""

Precision = Literal["fp32", "bf16", "fp16"]

HOST = torch.device("cpu")
"""Where payloads, replies, checkpoints and client state live."""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(ValueError):
    """A device that is not one of the ``device`` setting's values, or that this machine lacks."""


def device_refusal(name: str | None) -> str | None:
    """Why ``name`` cannot be this machine's device (one line naming what to do), or ``None``.

    Args:
        name: the ``device`` setting (``None`` means ``auto``).
    """
    name = name or "auto"
    if not DEVICE_PATTERN.match(name):
        return f"unknown device {name!r}; choose auto, cpu, cuda, cuda:N or mps"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"device {name}: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu or auto"
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            return f"device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
    if name == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return "device mps: this machine has no Apple GPU available to torch; use --device cpu or auto"
    return None


def resolve_device(name: str | None) -> torch.device:
    """The ``torch.device`` of the ``device`` setting on this machine.

    Args:
        name: ``auto`` or ``None`` (the first CUDA device, else the CPU), ``cpu``, ``cuda``,
            ``cuda:N`` or ``mps``.

    Raises:
        DeviceError: an unknown name, or a device this machine lacks (:func:`device_refusal`).
    """
    refusal = device_refusal(name)
    if refusal is not None:
        raise DeviceError(refusal)
    name = name or "auto"
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else HOST
    return torch.device(name)


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_description(device: torch.device) -> dict[str, Any]:
    """What the provenance and the summary record of the device: its type and index, its name
    (the CUDA device's, or ``cpu``), and the CUDA and cuDNN versions torch was built with (``None``
    without CUDA)."""
    description: dict[str, Any] = {"device": str(device), "device_name": "cpu",
                                   "cuda_version": torch.version.cuda, "cudnn_version": None}
    if device.type == "cuda":
        description["device_name"] = torch.cuda.get_device_name(device)
        description["cudnn_version"] = torch.backends.cudnn.version()
    elif device.type == "mps":
        description["device_name"] = "mps"
    return description


def set_deterministic(enabled: bool) -> None:
    """Turn torch's deterministic algorithms on (or back off) for this process, with what CUDA's
    cuBLAS needs for them (``CUBLAS_WORKSPACE_CONFIG``, set only if unset) and cuDNN's benchmark
    mode off. An operation without a deterministic implementation then raises instead of
    running."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.benchmark = not enabled
    torch.backends.cudnn.deterministic = enabled


def autocast(device: torch.device, precision: str | None) -> contextlib.AbstractContextManager:
    """The mixed-precision context of a client's forward pass and loss: ``torch.autocast`` to
    bfloat16 or float16 on ``device``, or nothing for ``fp32`` (``None``)."""
    if precision in (None, "fp32"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def gradient_scaler(device: torch.device, precision: str | None) -> torch.amp.GradScaler | None:
    """A gradient scaler for ``fp16`` (float16's narrow range underflows small gradients), else
    ``None``."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples, at any depth) on ``device``;
    a tensor already there is the same object."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def moved_from_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch's uint8 images) on ``device``: through pinned memory and an
    asynchronous copy to a CUDA device, as is; the same object on the CPU."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_host(value: Any) -> Any:
    """:func:`to_device` to the CPU: what a client sends and keeps between rounds."""
    return to_device(value, HOST)


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """Run a block with ``module`` on ``device`` and return it to where it was after (the
    server's models live on the CPU between evaluations)."""
    try:
        before = next(module.parameters()).device
    except StopIteration:
        before = HOST
    module.to(device)
    try:
        yield module
    finally:
        module.to(before)
