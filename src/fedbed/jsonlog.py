"""Strict JSON for run logs and summaries: tensors become lists, NaN and ±inf become ``null``.

Python's ``json`` writes non-finite floats as bare ``NaN`` / ``Infinity``, which is not JSON and
which other readers (browsers, ``jq``, pandas' strict mode) reject; a diverged run must still
leave a readable log.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch


def json_safe(value: Any) -> Any:
    """``value`` with tensors turned into (nested) lists and non-finite floats into ``None``.

    Args:
        value: any mix of dicts, lists, tuples, tensors, numbers, strings and ``None``.

    Raises:
        TypeError: an object JSON cannot hold (the message names its type).
    """
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist())
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} to a JSON log")


def to_json(value: Any, indent: int | None = None) -> str:
    """Strict JSON text of ``value`` (see :func:`json_safe`); raises ``TypeError`` as it does."""
    return json.dumps(json_safe(value), indent=indent, allow_nan=False)
