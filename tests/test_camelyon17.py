"""Camelyon17 read from a tiny copy of WILDS' on-disk layout written here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedbed.config import ExperimentConfig, validate
from fedbed.data import DataError, load_dataset, prepare_dataset
from fedbed.data.camelyon17 import patch_path, read_camelyon17
from fedbed.data.catalog import locate, dataset_spec

# (patient, node, x, y, tumor, center): a dozen rows over the five hospitals
ROWS = [(4, 4, 3328, 21792, 1, 0), (4, 4, 3360, 21792, 0, 0), (10, 4, 2080, 12896, 1, 0),
        (21, 2, 7712, 14432, 0, 1), (22, 4, 3104, 15328, 1, 1), (39, 1, 1600, 20224, 0, 2),
        (40, 2, 9024, 11456, 1, 2), (46, 4, 4544, 28064, 0, 3), (60, 3, 5984, 23104, 1, 3),
        (61, 4, 3392, 15200, 0, 4), (75, 4, 8896, 4416, 1, 4), (75, 4, 8928, 4416, 0, 4)]


def colour(index: int) -> tuple[int, int, int]:
    return 10 * index, 255 - 10 * index, 7 * index


def write_layout(root: Path, rows=ROWS) -> Path:
    """``camelyon17_v1.0``: metadata.csv as WILDS writes it (unnamed index, zero-padded patients,
    slide and split columns) and one 96x96 RGB PNG per row, of a colour unique to the row."""
    folder = root / "camelyon17_v1.0"
    lines = [",patient,node,x_coord,y_coord,tumor,slide,center,split"]
    for index, (patient, node, x, y, tumor, center) in enumerate(rows):
        lines.append(f"{index},{patient:03d},{node},{x},{y},{tumor},{index % 50},{center},0")
        path = patch_path(folder, f"{patient:03d}", node, x, y)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((96, 96, 3), colour(index), np.uint8)).save(path)
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    return folder


def test_the_wilds_layout_gives_one_domain_per_hospital(tmp_path):
    write_layout(tmp_path)
    assert patch_path(tmp_path, "004", 4, 3328, 21792).relative_to(tmp_path).as_posix() == (
        "patches/patient_004_node_4/patch_patient_004_node_4_x_3328_y_21792.png")
    dataset = load_dataset("camelyon17", tmp_path)
    assert dataset.domain_names == tuple(f"hospital_{c}" for c in range(5))
    assert dataset.class_names == ("normal", "tumor") and dataset.input_shape == (3, 32, 32)
    assert dataset.labels.tolist() == [row[4] for row in ROWS]
    assert dataset.domains.tolist() == [row[5] for row in ROWS]
    assert dataset.images[:, :, 16, 16].tolist() == [list(colour(i)) for i in range(len(ROWS))]
    assert "WILDS layout" in dataset.source and "12 patches" in dataset.source
    assert validate(ExperimentConfig(dataset="Camelyon17", data_root=tmp_path)).dataset.name == "Camelyon17"
    assert ExperimentConfig(dataset="camelyon17").target == "hospital_2"  # WILDS' test hospital


def test_prepare_packs_the_patches_once_and_runs_read_the_packed_file(tmp_path):
    folder = write_layout(tmp_path)
    assert "files" in locate(dataset_spec("Camelyon17"), tmp_path, 16)
    packed = prepare_dataset("Camelyon17", tmp_path, 16)
    assert packed == tmp_path / "camelyon17" / "camelyon17_16.npz"
    for path in (folder / "patches").rglob("*.png"):
        path.unlink()  # the packed file alone serves
    dataset = load_dataset("Camelyon17", tmp_path, image_size=16)
    assert dataset.source.startswith("packed") and dataset.input_shape == (3, 16, 16)
    assert dataset.labels.tolist() == [row[4] for row in ROWS]
    assert dataset.images[:, :, 8, 8].tolist() == [list(colour(i)) for i in range(len(ROWS))]


def test_camelyon17_files_at_fault_are_named(tmp_path):
    with pytest.raises(DataError, match=r"Camelyon17 not found .*camelyon17_v1.0/metadata.csv and patches/patient_"):
        load_dataset("Camelyon17", tmp_path)
    folder = write_layout(tmp_path)
    patch_path(folder, "040", 2, 9024, 11456).unlink()
    with pytest.raises(DataError, match=r"cannot read image .*patch_patient_040_node_2_x_9024_y_11456.png"):
        read_camelyon17(folder, "Camelyon17", 8)
    metadata = folder / "metadata.csv"
    text = metadata.read_text()
    metadata.write_text(text.replace("tumor", "label", 1))
    with pytest.raises(DataError, match=r"metadata.csv lacks the column\(s\) tumor; expected a CSV with the columns"):
        read_camelyon17(folder, "Camelyon17", 8)
    metadata.write_text(text.replace(",0,0\n", ",7,0\n", 1))  # a centre 7
    with pytest.raises(DataError, match=r"column center must be a hospital 0..4, found \[7\]"):
        read_camelyon17(folder, "Camelyon17", 8)
    metadata.write_text(text.replace("3328", "x3328"))
    with pytest.raises(DataError, match=r"column x_coord must hold integers, found 'x3328'"):
        read_camelyon17(folder, "Camelyon17", 8)
    metadata.write_text("\n".join(line for line in text.splitlines() if not line.endswith(",3,0")) + "\n")
    with pytest.raises(DataError, match=r"has no patch of hospital_3; expected rows with center 0..4"):
        read_camelyon17(folder, "Camelyon17", 8)
