"""Run logs are strict JSON even when a run diverges."""

import json
import math

import pytest
import torch

from fedbed.jsonlog import json_safe, to_json


def test_non_finite_floats_become_null_and_tensors_lists():
    record = {"loss": float("nan"), "norms": torch.tensor([1.0, float("inf")]), "pairs": (1, 2), "ok": True}
    text = to_json(record)
    assert json.loads(text) == {"loss": None, "norms": [1.0, None], "pairs": [1, 2], "ok": True}
    assert "NaN" not in text and "Infinity" not in text
    assert json_safe(-math.inf) is None and json_safe(2.5) == 2.5


def test_unknown_objects_are_refused_by_name():
    with pytest.raises(TypeError, match="object"):
        to_json({"x": object()})
