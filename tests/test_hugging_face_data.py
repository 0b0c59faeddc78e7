"""Hugging Face datasets as data (``--dataset hf:...``): a ``save_to_disk`` copy and parquet files
made from real PACS images, packed once and read packed afterwards, other column names and
splits, and the one-line refusals (a wrong column, a missing folder, a hub name not cached
offline, the library not installed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from fedbed.cli import app
from fedbed.config import ConfigError, ExperimentConfig, validate
from fedbed.data import catalog, load_dataset
from fedbed.data import hugging_face
from fedbed.data.hugging_face import HuggingFaceColumns
from fedbed.data.images import decode_image

datasets = pytest.importorskip("datasets", reason="the datasets library is the optional extra fedbed[hf] (the test "
                                                  "extra installs it)")

runner = CliRunner()
QUICK = ["--rounds", "1", "--local-steps", "1", "--no-progress"]
DOMAINS = ("art_painting", "cartoon", "photo")
CLASSES = ("dog", "elephant", "giraffe")
PER_CLASS = 3


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """The datasets library's cache in ``tmp_path``, offline, and FedBed's in-process caches empty."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    catalog._load_dataset.cache_clear()
    hugging_face.opened.cache_clear()
    yield cache
    catalog._load_dataset.cache_clear()
    hugging_face.opened.cache_clear()


def pacs_files(shared_data: Path) -> list[tuple[str, str, Path]]:
    """``(domain, class, file)`` of the first images of a few domains and classes of ``pacs-mini``."""
    return [(domain, class_name, file) for domain in DOMAINS for class_name in CLASSES
            for file in sorted((shared_data / "pacs-mini" / domain / class_name).iterdir())[:PER_CLASS]]


def pacs_rows(shared_data: Path, image="image", label="label", domain="domain",
              domains_as_class_label: tuple[str, ...] | None = None):
    """A ``datasets.Dataset`` of the :func:`pacs_files` images (their bytes embedded), labels a
    ``ClassLabel`` and domains strings (Flower Datasets' layout), or a ``ClassLabel`` of ``domains_as_class_label``."""
    files = pacs_files(shared_data)
    features = datasets.Features({
        image: datasets.Image(),
        label: datasets.ClassLabel(names=list(CLASSES)),
        domain: (datasets.ClassLabel(names=list(domains_as_class_label)) if domains_as_class_label
                 else datasets.Value("string")),
    })
    return datasets.Dataset.from_dict({
        image: [{"bytes": file.read_bytes(), "path": file.name} for _, _, file in files],
        label: [CLASSES.index(class_name) for _, class_name, _ in files],
        domain: [domains_as_class_label.index(d) if domains_as_class_label else d for d, _, _ in files],
    }, features=features)


def run_cli(arguments: list[str]):
    return runner.invoke(app, arguments)


def one_line_refusal(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_a_save_to_disk_copy_trains_once_packed_and_a_second_run_reads_the_packed_copy(shared_data, hf_cache, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    pacs_rows(shared_data).save_to_disk(str(tmp_path / "pacs_hf"))
    result = run_cli(["run", "--dataset", "hf:pacs_hf", "--target", "photo", *QUICK])
    assert result.exit_code == 0, result.output
    assert "data: domains (3): art_painting 9, cartoon 9, photo 9" in result.output
    assert "data: classes (3): dog 9, elephant 9, giraffe 9" in result.output
    run_dir = tmp_path / "runs" / "pacs_hf" / "fedavg" / "photo" / "seed0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["dataset"], summary["target"]) == ("hf:pacs_hf", "photo")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["dataset"] == "hf:pacs_hf"
    packed = sorted(hf_cache.glob("fedbed-packed/pacs_hf-*/pacs_hf_32.npz"))
    assert len(packed) == 1 and summary["data_source"].endswith(f"packed {packed[0]}")
    # The packed pixels are the files' own, decoded as a folder tree's are.
    with np.load(packed[0]) as arrays:
        first_file = pacs_files(shared_data)[0][2]
        assert np.array_equal(arrays["images"][0], decode_image(first_file, 32))
        assert list(arrays["class_names"]) == list(CLASSES) and list(arrays["domain_names"]) == list(DOMAINS)

    # A second run (a new process's caches) opens nothing through datasets: the packed copy serves.
    catalog._load_dataset.cache_clear()
    hugging_face.opened.cache_clear()

    def refuse(*arguments, **options):
        raise AssertionError("the packed copy should be read, not the Hugging Face dataset")

    monkeypatch.setattr(datasets, "load_from_disk", refuse)
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    monkeypatch.setattr(hugging_face, "_pack", refuse)
    again = run_cli(["run", "--dataset", "hf:pacs_hf", "--target", "photo", *QUICK, "--run-dir", "second"])
    assert again.exit_code == 0, again.output
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert (second["data_fingerprint"], second["data_source"]) == (summary["data_fingerprint"], summary["data_source"])
    assert second["selection"] == summary["selection"]


def test_parquet_files_give_the_same_data_and_fedbed_data_prepare_packs_where_runs_read(shared_data, hf_cache,
                                                                                         tmp_path):
    rows = pacs_rows(shared_data)
    rows.save_to_disk(str(tmp_path / "saved"))
    rows.to_parquet(str(tmp_path / "parquet" / "data" / "train-00000-of-00001.parquet"))
    saved = load_dataset("hf:" + str(tmp_path / "saved"), None)
    from_parquet = load_dataset("hf:" + str(tmp_path / "parquet"), None, image_size=16)
    assert from_parquet.input_shape == (3, 16, 16) and saved.input_shape == (3, 32, 32)
    parquet_32 = load_dataset("hf:" + str(tmp_path / "parquet"), None)
    assert parquet_32.fingerprint == saved.fingerprint  # the same data, whichever way it was stored
    assert parquet_32.source != saved.source

    result = run_cli(["data", "prepare", "hf:" + str(tmp_path / "parquet"), "--size", "24", "--memory-mapped"])
    assert result.exit_code == 0, result.output
    written = Path(result.output.strip().removeprefix("wrote "))
    assert written.parent.parent == hf_cache / "fedbed-packed" and written.name == "parquet_24.npz"
    assert written.with_name("parquet_24.images.npy").is_file()
    mapped = load_dataset("hf:" + str(tmp_path / "parquet"), None, image_size=24)
    assert mapped.source.endswith(f"packed {written}") and len(mapped) == len(rows)
    listed = run_cli(["datasets", "hf:" + str(tmp_path / "parquet")])
    assert listed.exit_code == 0 and f"found: packed {written.with_name('parquet_32.npz')}" in listed.output


def test_other_column_names_class_label_domains_and_splits(shared_data, hf_cache, tmp_path):
    order = ("photo", "cartoon", "sketch", "art_painting")  # sketch holds no image here
    rows = pacs_rows(shared_data, image="picture", label="category", domain="style", domains_as_class_label=order)
    rows = rows.cast_column("category", datasets.Value("int64"))  # plain integers: classes named by their values
    split = rows.train_test_split(test_size=0.25, seed=0)
    split.save_to_disk(str(tmp_path / "styles"))
    dataset = "hf:" + str(tmp_path / "styles")
    config = ExperimentConfig(dataset=dataset, target="Photo", image_column="picture", label_column="category",
                              domain_column="style", rounds=1)
    resolved = validate(config)
    assert resolved.config.target == "photo"
    assert resolved.dataset.domain_names == ("photo", "cartoon", "art_painting")
    loaded = load_dataset(dataset, None, columns=HuggingFaceColumns("picture", "category", "style"))
    assert loaded.class_names == ("0", "1", "2") and len(loaded) == len(rows)  # both splits
    assert loaded.counts().tolist() == [[PER_CLASS] * 3] * 3

    with pytest.raises(ConfigError, match="column 'category' holds int64 values, not images; set image_column to a "
                                          "column of images \\(picture\\)"):
        validate(config.model_copy(update={"image_column": "category"}))


def test_a_wrong_column_is_refused_in_one_line_before_anything_is_written(shared_data, hf_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pacs_rows(shared_data).save_to_disk(str(tmp_path / "pacs_hf"))
    settings = tmp_path / "run.yaml"
    settings.write_text(yaml.safe_dump({"dataset": "hf:pacs_hf", "target": "photo", "domain_column": "style"}))
    result = run_cli(["run", "--config", str(settings), *QUICK])
    one_line_refusal(result, "hf:pacs_hf has no column 'style' (its columns: image, label, domain); set domain_column "
                             "to one of them")
    assert not (tmp_path / "runs").exists() and not hf_cache.exists()


def refusal(case: str, tmp_path: Path, monkeypatch) -> tuple[list[str], str]:
    if case == "missing folder":
        return ["--dataset", "hf:./not_here"], "hf:./not_here: no folder or file not_here; looked for a save_to_disk copy"
    if case == "empty folder":
        (tmp_path / "empty").mkdir()
        return ["--dataset", "hf:empty"], "holds neither a save_to_disk copy (state.json or dataset_dict.json) nor .parquet"
    if case == "hub name not cached offline":
        return ["--dataset", "hf:nobody/nothing"], ("hf:nobody/nothing: cannot load 'nobody/nothing' from the Hugging "
                                                    "Face Hub or its cache")
    if case == "library not installed":
        monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
        return ["--dataset", "hf:flwrlabs/pacs"], ("hf:flwrlabs/pacs is read with Hugging Face's datasets library, "
                                                   'which is not installed: pip install "fedbed[hf]"')
    settings = tmp_path / "run.yaml"
    settings.write_text(yaml.safe_dump({"dataset": "RotatedMNIST", "label_column": "digit"}))
    return ["--config", str(settings)], "label_column applies to Hugging Face datasets (dataset: hf:<hub name or folder>)"


@pytest.mark.parametrize("case", ["missing folder", "empty folder", "hub name not cached offline",
                                  "library not installed", "columns of another dataset"])
def test_data_that_cannot_be_read_is_refused_in_one_line(case, hf_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arguments, message = refusal(case, tmp_path, monkeypatch)
    one_line_refusal(run_cli(["run", *arguments, "--target", "photo", *QUICK]), message)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("change, message", [
    ({"domain": [0.5, 0.5, 1.5, 1.5]}, "column 'domain' holds float64 values; set domain_column to a column of class "
                                       "labels, strings or integers"),
    ({"domain": ["photo"] * 4}, "column 'domain' names 1 domain; leave-one-domain-out needs at least two"),
    ({"label": [0, -1, 1, -1]}, "column 'label' has 2 row(s) of ClassLabel -1 (no value, e.g. an unlabelled test split)"),
])
def test_columns_of_the_wrong_kind_are_refused_at_validation(change, message, shared_data, hf_cache, tmp_path):
    files = [file for _, _, file in pacs_files(shared_data)[:4]]
    values = {"image": [{"bytes": file.read_bytes(), "path": file.name} for file in files],
              "label": [0, 1, 0, 1], "domain": ["photo", "photo", "sketch", "sketch"], **change}
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=["dog", "cat"]),
                                 domain=datasets.Value("float64" if isinstance(values["domain"][0], float) else "string"))
    datasets.Dataset.from_dict(values, features=features).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError) as refused:
        validate(ExperimentConfig(dataset="hf:" + str(tmp_path / "bad"), target="photo"))
    assert message in str(refused.value) and "\n" not in str(refused.value)
