"""The seed papers' main settings (``docs/configs/paper/*.yaml``): every file validates with
FedBed's loader as ``fedbed run --config FILE --target T`` reads it (the target its own comment
names), against a tiny PACS folder tree and a tiny packed Camelyon17 made here, with
``pretrained: imagenet`` satisfied offline by a test-made torchvision cache entry; every setting
carries a comment; and each runs one round of one local step on the CPU at 32 px with a
finite training loss."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedbed.config import config_from_mapping, load_config_file, override_settings, validate
from fedbed.experiment import run_experiment
from fedbed.models.backbones import ALLOW_DOWNLOADS
from tests.test_digits import write_mnist, write_mnist_m, write_svhn, write_syn, write_usps
from tests.test_pretrained import cache_imagenet_resnet18

PAPER_CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs" / "paper"
CONFIGS = sorted(PAPER_CONFIGS.glob("*.yaml"))
PAPERS = ("ppdg", "mcgdm", "fedadg", "fedgala", "hfedf")
PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
DIGIT_LABELS = {  # every digit in each domain's train part, in each format's own labels
    write_mnist: {"train_labels": tuple(range(10)), "test_labels": (0, 1, 2, 3)},
    write_mnist_m: {"train": tuple(range(10)), "test": (0, 1, 2, 3)},
    write_usps: {"train": tuple(range(1, 11)), "test": (1, 2, 3, 4)},  # LIBSVM's USPS: 1..10, 10 is digit 0
    write_svhn: {"train": tuple(range(1, 11)), "test": (1, 2, 3, 10)},  # SVHN's format: 10 is digit 0
    write_syn: {"train": tuple(range(1, 11)), "test": (1, 2, 3, 10)},
}


def needs_timm(path: Path) -> list:
    """DenseNet-121 (PPDG's Camelyon17 setting) is timm's: skip without the extra."""
    if "timm:" in path.read_text():
        return [pytest.mark.skipif(not _has_timm(), reason='timm not installed (pip install "fedbed[timm]")')]
    return []


def _has_timm() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


PARAMS = [pytest.param(path, id=path.stem, marks=needs_timm(path)) for path in CONFIGS]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """``ROOT/PACS/<domain>/<class>/<i>.png`` (DomainBed's layout, two classes, ten images each),
    ``ROOT/camelyon17/camelyon17_32.npz`` (FedBed's packed layout, five hospitals) and the five
    Digits domains in their own formats (``tests/test_digits.py``'s writers)."""
    root = tmp_path_factory.mktemp("paper_data")
    for d, domain in enumerate(PACS_DOMAINS):
        for c, name in enumerate(("dog", "horse")):
            folder = root / "PACS" / domain / name
            folder.mkdir(parents=True)
            for i in range(10):
                Image.new("RGB", (36, 36), (20 * i, 60 + 120 * c, 40 * d)).save(folder / f"{i}.png")
    for write, labels in DIGIT_LABELS.items():  # Digit-5's five domains
        write(root, **labels)
    count = 60
    rng = np.random.default_rng(0)
    (root / "camelyon17").mkdir()
    np.savez(root / "camelyon17" / "camelyon17_32.npz", images=rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8),
             labels=np.arange(count) % 2, domains=np.arange(count) % 5, class_names=np.array(["normal", "tumor"]),
             domain_names=np.array([f"hospital_{i}" for i in range(5)]))
    return root


@pytest.fixture
def imagenet_cache(tmp_path, monkeypatch):
    """A torch hub cache holding a (randomly initialised) torchvision ResNet-18 under the file
    name of its ImageNet weights; downloads not allowed."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv(ALLOW_DOWNLOADS, raising=False)
    cache_imagenet_resnet18()


def file_settings(path: Path) -> dict:
    """The file's settings with the target its own command comment names (``--target T``)."""
    command = re.search(rf"fedbed run --config docs/configs/paper/{re.escape(path.name)} --target (\S+)", path.read_text())
    assert command, f"{path.name} names its command, fedbed run --config docs/configs/paper/{path.name} --target T"
    return {**load_config_file(path), "target": command.group(1)}


def test_one_config_and_one_fedavg_config_per_seed_paper():
    assert {path.stem for path in CONFIGS} >= {name for paper in PAPERS for name in (paper, f"{paper}-fedavg")}


@pytest.mark.parametrize("path", PARAMS)
def test_every_setting_is_commented_and_the_device_is_auto(path):
    text = path.read_text()
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{path.name}: setting without its source: {line!r}"
    assert load_config_file(path)["device"] == "auto"


@pytest.mark.parametrize("path", PARAMS)
def test_each_paper_config_validates_offline(path, data_root, imagenet_cache):
    settings = file_settings(path)
    validated = validate(config_from_mapping({**settings, "data_root": data_root}))
    config = validated.config
    assert config.device == "auto" and config.target == settings["target"]
    for key, value in settings.items():
        if key in ("hp", "linear_probe", "target"):
            continue
        assert getattr(config, key) == value, f"{path.name}: {key} is {getattr(config, key)!r}, the file says {value!r}"
    for key, value in settings.get("hp", {}).items():
        assert getattr(validated.hparams, key) == value, f"{path.name}: hp {key}"


@pytest.mark.parametrize("path", PARAMS)
def test_each_paper_config_runs_one_round_of_one_step_on_the_cpu(path, data_root, imagenet_cache, tmp_path):
    settings = file_settings(path)
    small = override_settings(settings, {"image_size": 32, "rounds": 1, "local_steps": 1, "batch_size": 4,
                                         "eval_every": 1, "device": "cpu", "data_root": data_root,
                                         "run_dir": tmp_path / "run"})
    if "linear_probe" in small:
        small["linear_probe"] = {**small["linear_probe"], "epochs": 1}
    if small["algorithm"] == "fedadg":  # one unit of each phase, not E0 + E1 = 10
        small["hp"] = {**small["hp"], "classification_epochs": 1, "alignment_epochs": 1}
    run_experiment(config_from_mapping(small), progress=False, echo=lambda *_, **__: None)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    losses = {key: value for key, value in rounds[-1]["metrics"].items() if "loss" in key}
    assert losses and all(math.isfinite(value) for value in losses.values()), losses
