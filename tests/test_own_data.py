"""The user's own data: a path as a dataset (folder tree, packed file, prepared folder), registered
datasets and entry points, channel conversion, regression files, validation errors, ColoredMNIST."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from fedbed.cli import app
from fedbed.data import DataError, DomainDataset, dataset_spec, load_dataset, register_dataset
from fedbed.data import catalog
from fedbed.data.images import load_packed, save_packed
from fedbed.data.mnist import colored_mnist

runner = CliRunner()
QUICK = ["--rounds", "1", "--local-steps", "1", "--no-progress"]


def make_tree(root: Path, layout: dict[str, dict[str, int]], grey_domain: str | None = None) -> Path:
    """``root/<domain>/<class>/<i>.png``: a bright image for the class listed first, dark for the
    others; one domain's images saved as grey PNGs (mode L), the others as RGB JPEG-free PNGs."""
    for domain, classes in layout.items():
        for number, (class_name, count) in enumerate(classes.items()):
            folder = root / domain / class_name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                level = 200 if number == 0 else 40 + i
                mode, colour = ("L", level) if domain == grey_domain else ("RGB", (level, level // 2, 10))
                Image.new(mode, (6 + i, 5), colour).save(folder / f"{i}.png")
    return root


def write_packed(path: Path, **arrays) -> Path:
    defaults = dict(images=np.zeros((4, 4, 4, 3), np.uint8), labels=np.array([0, 1, 0, 1]),
                    domains=np.array([0, 0, 1, 1]), class_names=np.array(["cat", "dog"]),
                    domain_names=np.array(["north", "south"]))
    np.savez(path, **{**defaults, **arrays})
    return path


def run_cli(arguments: list[str]):
    return runner.invoke(app, arguments)


def test_a_folder_tree_runs_with_its_own_names_and_records_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tree(tmp_path / "My Photos", {"zoo": {"tiger": 2, "ant": 2}, "Field": {"tiger": 2, "ant": 2},
                                       "attic": {"tiger": 2, "ant": 2}}, grey_domain="attic")
    spec = dataset_spec("My Photos")
    assert (spec.name, spec.domain_names, spec.default_model) == ("My Photos", ("Field", "attic", "zoo"), "hfedf_cnn")
    result = run_cli(["run", "--dataset", "My Photos", "--target", "ZOO", *QUICK])
    assert result.exit_code == 0, result.output
    assert "data: domains (3): Field 4, attic 4, zoo 4" in result.output
    assert "data: classes (2): ant 6, tiger 6" in result.output
    run_dir = tmp_path / "runs" / "My Photos" / "fedavg" / "zoo" / "seed0"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (config["dataset"], config["target"]) == ("My Photos", "zoo")
    assert summary["dataset"] == "My Photos" and summary["dataset_path"] == "My Photos"
    dataset = load_dataset("My Photos", None)
    assert summary["data_fingerprint"] == dataset.fingerprint and dataset.input_shape == (3, 32, 32)
    grey = dataset.images[dataset.domains == dataset.domain_index("attic")]
    assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 1], grey[:, 2])  # grey decoded to 3 equal channels


def test_prepare_a_path_then_read_the_prepared_folder_and_the_file(tmp_path):
    tree = make_tree(tmp_path / "scans", {"a": {"x": 2, "y": 1}, "b": {"x": 1, "y": 2}})
    result = run_cli(["data", "prepare", str(tree), "--size", "8"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {tree / 'scans_8.npz'}"
    out = tmp_path / "out"
    assert run_cli(["data", "prepare", str(tree), "--size", "8", "--output-root", str(out)]).exit_code == 0
    decoded = load_dataset(str(tree), None, 12)  # no scans_12.npz: the tree is decoded
    assert "image folders" in decoded.source and decoded.input_shape == (3, 12, 12)
    from_folder = load_dataset(str(tree), None, 8)  # scans_8.npz beside the domain folders wins
    only_packed = load_dataset(str(out / "scans"), None)  # a folder of packed files: its one size
    the_file = load_dataset(str(tree / "scans_8.npz"), None)
    assert "packed" in from_folder.source and from_folder.fingerprint == only_packed.fingerprint == the_file.fingerprint
    assert dataset_spec(str(tree / "scans_8.npz")).name == "scans" and dataset_spec(str(out / "scans")).default_image_size == 8
    listed = run_cli(["datasets", str(out / "scans")])
    assert listed.exit_code == 0 and "scans           domains: a, b" in listed.output and "scans_8.npz" in listed.output
    resized = load_dataset(str(tree / "scans_8.npz"), None, 16)  # a model for another side reads it resized
    assert resized.input_shape[1:] == (16, 16) and "resized from 8x8 to 16x16" in resized.source
    assert load_dataset(str(out / "scans"), None, 16).input_shape[1:] == (16, 16)


def test_grey_packed_file_and_channel_conversion(tmp_path):
    from fedbed.experiment import ExperimentConfig, run_experiment

    rng = np.random.default_rng(0)
    grey = write_packed(tmp_path / "grey_28.npz", images=rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
                        labels=np.arange(12) % 2, domains=np.arange(12) // 4,
                        domain_names=np.array(["x", "y", "z"]))
    dataset = load_dataset(str(grey), None)
    assert dataset.input_shape == (1, 28, 28) and dataset_spec(str(grey)).default_model == "mnist_cnn"
    rgb = dataset.with_channels(3)
    assert rgb.input_shape == (3, 28, 28) and all(torch.equal(rgb.images[:, c], dataset.images[:, 0]) for c in range(3))
    pixel = DomainDataset("p", torch.tensor([255, 0, 0], dtype=torch.uint8).view(1, 3, 1, 1), torch.zeros(1).long(),
                          torch.zeros(1).long(), ("c",), ("d",), "t")
    assert int(pixel.with_channels(1).images) == 76  # 0.299 * 255, ITU-R 601-2 luma
    with pytest.raises(DataError, match="cannot turn 2-channel images into 3"):
        colored_mnist(None).with_channels(3)
    summary = run_experiment(ExperimentConfig(dataset=str(grey), target="z", channels=3, rounds=1, local_steps=1,
                                              model="lenet", run_dir=tmp_path / "run"), progress=False, echo=lambda *_: None)
    assert "as 3 channel(s)" in summary["data_source"]
    weights = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    first_conv = next(v for k, v in _flat_tensors(weights) if v.dim() == 4)
    assert first_conv.shape[1] == 3  # the model was built for the converted data's 3 channels


def _flat_tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat_tensors(value, f"{prefix}.{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _flat_tensors(value, f"{prefix}.{index}")


def test_a_regression_file_is_read_and_written_with_targets(tmp_path):
    from fedbed.experiment import ExperimentConfig, run_experiment

    path = tmp_path / "ages.npz"
    np.savez(path, images=np.zeros((30, 28, 28, 1), np.uint8) + np.arange(30, dtype=np.uint8)[:, None, None, None],
             targets=np.linspace(0, 1, 30), domains=np.arange(30) % 3, class_names=np.array([], dtype=str),
             domain_names=np.array(["p", "q", "r"]))
    dataset = load_dataset(str(path), None)
    assert dataset.task == "regression" and dataset.labels.dtype == torch.float32 and dataset.class_names == ()
    save_packed(dataset, tmp_path / "again.npz")
    assert torch.equal(load_packed(tmp_path / "again.npz", "ages").labels, dataset.labels)
    lines = []
    summary = run_experiment(ExperimentConfig(dataset=str(path), target="r", rounds=1, local_steps=1,
                                              run_dir=tmp_path / "run"), progress=False, echo=lines.append)
    assert summary["dataset"] == "ages" and "data: task: regression (float targets, no classes)" in lines


def test_register_dataset_and_entry_points(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "DATASETS", dict(catalog.DATASETS))
    monkeypatch.setattr(catalog, "_plugins_loaded", False)

    def squares(data_root, image_size):
        images = torch.zeros(8, 1, image_size, image_size, dtype=torch.uint8)
        images[::2] = 255
        return DomainDataset("Squares", images, torch.arange(8) % 2, torch.arange(8) // 4, ("dark", "light"),
                             ("left", "right"), "generated")

    def register_plugin():
        register_dataset("Squares", squares, ["left", "right"], default_image_size=28, default_model="lenet")

    class EntryPoint:
        name, value = "squares", "fedbed_squares:register"

        def load(self):
            return register_plugin

    monkeypatch.setattr(catalog.importlib.metadata, "entry_points", lambda group: [EntryPoint()] if group == "fedbed.datasets" else [])
    assert dataset_spec("squares").loader is squares  # the plugin registered it on the first lookup
    assert load_dataset("SQUARES", None).input_shape == (1, 28, 28)
    listed = run_cli(["datasets"])
    assert "Squares" in listed.output and "registered: " in listed.output
    result = run_cli(["run", "--dataset", "squares", "--target", "Right", *QUICK, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["dataset"] == "Squares"
    with pytest.raises(DataError, match="already known"):
        register_dataset("pacs", squares, ["a", "b"])
    with pytest.raises(DataError, match="at least two distinct domain names"):
        register_dataset("One", squares, ["a"])
    monkeypatch.setattr(catalog, "_plugins_loaded", False)

    class Broken(EntryPoint):
        def load(self):
            raise ImportError("no module named fedbed_squares")

    monkeypatch.setattr(catalog.importlib.metadata, "entry_points", lambda group: [Broken()])
    with pytest.raises(DataError, match=r"dataset plugin squares \(fedbed_squares:register\) failed: no module"):
        dataset_spec("squares")


def bad_data(kind: str, root: Path) -> tuple[list[str], str]:
    """Data with one fault, the run's arguments for it, and the message that must name it."""
    tree = {"north": {"cat": 1, "dog": 1}, "south": {"cat": 1, "dog": 1}}
    if kind == "empty domain":
        make_tree(root / "d", tree)
        (root / "d" / "west").mkdir()
        return ["--dataset", str(root / "d"), "--target", "north"], "domain folder"
    if kind == "single domain":
        make_tree(root / "d", {"north": tree["north"]})
        return ["--dataset", str(root / "d"), "--target", "north"], "has 1 domain (north); leave-one-domain-out needs"
    if kind == "unreadable image":
        make_tree(root / "d", tree)
        (root / "d" / "south" / "dog" / "broken.jpg").write_bytes(b"not an image")
        return ["--dataset", str(root / "d"), "--target", "north"], "cannot read image"
    if kind == "unknown target":
        make_tree(root / "d", tree)
        return ["--dataset", str(root / "d"), "--target", "east"], "d has no domain 'east'; its domains are north, south"
    if kind == "missing path":
        return ["--dataset", str(root / "nowhere"), "--target", "north"], "does not exist"
    file = root / "d.npz"
    if kind == "mismatched lengths":
        write_packed(file, labels=np.array([0, 1, 0]))
        return ["--dataset", str(file), "--target", "north"], "expected 4 labels and 4 domain ids, got (3,)"
    if kind == "label out of range":
        write_packed(file, labels=np.array([0, 1, 0, 5]))
        return ["--dataset", str(file), "--target", "north"], "a label lies outside 0..1 (found 0..5)"
    if kind == "images of different sizes":
        images = np.empty(4, dtype=object)
        images[:] = [np.zeros((4, 4, 3), np.uint8), np.zeros((5, 4, 3), np.uint8)] * 2
        np.savez(file, images=images, labels=[0, 1, 0, 1], domains=[0, 0, 1, 1], class_names=["a", "b"],
                 domain_names=["north", "south"])
        return ["--dataset", str(file), "--target", "north"], "its images differ in size"
    if kind == "empty packed domain":
        write_packed(file, domain_names=np.array(["north", "south", "west"]))
        return ["--dataset", str(file), "--target", "north"], "domain(s) west hold no sample"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty domain", "single domain", "unreadable image", "unknown target", "missing path",
                                  "mismatched lengths", "label out of range", "images of different sizes",
                                  "empty packed domain"])
def test_bad_data_is_one_line_exit_2_nothing_written(kind, tmp_path):
    arguments, message = bad_data(kind, tmp_path)
    run_dir = tmp_path / "run"
    result = run_cli(["run", *arguments, *QUICK, "--run-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not run_dir.exists()


def test_a_class_missing_from_a_domain_is_a_warning_with_counts(tmp_path):
    make_tree(tmp_path / "d", {"north": {"cat": 3, "dog": 2}, "south": {"cat": 5}, "west": {"cat": 1, "dog": 3}})
    result = run_cli(["run", "--dataset", str(tmp_path / "d"), "--target", "west", *QUICK, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "warning: class 'dog' is missing from 1 of 3 domains (north 2, south 0, west 3)" in result.output


def test_target_all_runs_every_domain_of_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_packed(tmp_path / "tiny_32.npz", images=np.zeros((10, 32, 32, 3), np.uint8), labels=np.arange(10) % 2,
                 domains=np.arange(10) // 5)
    result = run_cli(["run", "--dataset", "tiny_32.npz", "--target", "all", *QUICK])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny" / "fedavg").iterdir()) == ["north", "south"]
    # Every target's run folder is checked before the first run starts: south's finished run is
    # not replaced, and north's folder is left as it was (not redone first).
    shutil.rmtree(tmp_path / "runs" / "tiny" / "fedavg" / "north")
    again = run_cli(["run", "--dataset", "tiny_32.npz", "--target", "all", *QUICK])
    assert again.exit_code == 2 and "holds a finished run with these settings" in again.output
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny" / "fedavg").iterdir()) == ["south"]


def test_colored_mnist_follows_domainbed():
    dataset = load_dataset("coloredmnist", None)
    assert dataset.domain_names == ("+90%", "+80%", "-90%") and dataset.input_shape == (2, 28, 28)
    assert dataset_spec("ColoredMNIST").default_target == "-90%"
    assert torch.bincount(dataset.domains).tolist() == [1667, 1667, 1666]
    ink = dataset.images.flatten(2).sum(2)
    assert bool(((ink[:, 0] == 0) | (ink[:, 1] == 0)).all())  # one channel only per image
    colour = (ink[:, 1] > 0).long()  # green
    for domain, agreement in enumerate((0.9, 0.8, 0.1)):
        chosen = dataset.domains == domain
        assert abs(float((colour[chosen] == dataset.labels[chosen]).float().mean()) - agreement) < 0.03
    from fedbed.data.mnist import load_mnist_images

    images, digits, _ = load_mnist_images(None)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    first = dataset.domains == 0
    assert torch.equal(dataset.images[first].amax(1), images[order][0::3])  # DomainBed's shuffle and stride
    digit_agreement = float(((digits[order][0::3] < 5).long() == dataset.labels[first]).float().mean())
    assert abs(digit_agreement - 0.75) < 0.03  # the label is the digit's half, flipped 25% of the time
