"""The memory-mapped packed layout ``fedbed data prepare`` writes: the same data as the folder tree and
the compressed ``.npz``, its images never copied whole (clients keep indices, batches read rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedbed.data import load_dataset, prepare_dataset
from fedbed.data.images import (
    ImageRows,
    images_file,
    load_image_folders,
    load_packed,
    mapped_file,
    packed_header,
    save_packed,
)
from fedbed.federation.local_data import ClientData

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")


def write_tree(root: Path, classes=("cat", "dog"), per_class=3, seed=0) -> Path:
    """A tiny PACS folder tree of random PNGs of several sizes: ``root/PACS/<domain>/<class>/<n>.png``."""
    draw = np.random.default_rng(seed)
    for domain in PACS_DOMAINS:
        for class_name in classes:
            folder = root / "PACS" / domain / class_name
            folder.mkdir(parents=True)
            for number in range(per_class):
                side = int(draw.integers(9, 20))
                Image.fromarray(draw.integers(0, 256, (side, side + 2, 3), dtype=np.uint8)).save(folder / f"{number}.png")
    return root


def mapped_region_file(tensor: torch.Tensor) -> str | None:
    """The file of the memory mapping (``/proc/self/maps``) holding ``tensor``'s first byte, or ``None``."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.fixture
def prepared(tmp_path):
    """``(tree root, prepared root)``: the tiny tree prepared at 12 px into another root."""
    root = write_tree(tmp_path / "data")
    out = tmp_path / "prepared"
    assert prepare_dataset("PACS", root, 12, out, memory_mapped=True) == out / "pacs" / "pacs_12.npz"
    return root, out


def test_prepare_writes_the_memory_mapped_layout_equal_to_decoding_the_tree(prepared, tmp_path):
    root, out = prepared
    packed = out / "pacs" / "pacs_12.npz"
    assert images_file(packed) == out / "pacs" / "pacs_12.images.npy" and images_file(packed).is_file()
    with np.load(packed) as arrays:
        assert "images" not in arrays.files and str(arrays["images_file"]) == "pacs_12.images.npy"
    assert sorted(p.name for p in (out / "pacs").iterdir()) == ["pacs_12.images.npy", "pacs_12.npz"]  # no partial left
    assert np.load(images_file(packed)).shape == (24, 3, 12, 12)  # channels first, uncompressed
    assert packed_header(packed) == (PACS_DOMAINS, (24, 12, 12, 3))

    decoded = load_image_folders(root / "PACS", "PACS", 12, PACS_DOMAINS)
    mapped = load_dataset("PACS", out, 12)
    assert mapped.source == f"packed {packed}"
    assert torch.equal(mapped.images, decoded.images) and mapped.images.is_contiguous()
    assert torch.equal(mapped.labels, decoded.labels) and torch.equal(mapped.domains, decoded.domains)
    assert (mapped.class_names, mapped.domain_names) == (decoded.class_names, decoded.domain_names)
    # The fingerprint runs record is the same whichever layout the same images were read from.
    save_packed(decoded, tmp_path / "compressed" / "pacs" / "pacs_12.npz")
    compressed = load_dataset("PACS", tmp_path / "compressed", 12)
    assert mapped_file(compressed.images) is None
    assert mapped.fingerprint == decoded.fingerprint == compressed.fingerprint
    # A memory map of the .npy, not a copy: the tensor's bytes lie in a mapping of that file.
    assert mapped_file(mapped.images) == images_file(packed)
    if sys.platform.startswith("linux"):
        assert mapped_region_file(mapped.images) == str(images_file(packed))
        assert mapped_region_file(compressed.images) != str(images_file(packed))


def test_save_packed_writes_either_layout_and_both_read_back_alike(tmp_path):
    from tests.helpers import make_dataset

    dataset = make_dataset(per_domain=5, domains=3)
    save_packed(dataset, tmp_path / "a_8.npz")
    save_packed(dataset, tmp_path / "b_8.npz", memory_mapped=True)
    compressed, mapped = load_packed(tmp_path / "a_8.npz", "x"), load_packed(tmp_path / "b_8.npz", "x")
    assert mapped_file(mapped.images) == tmp_path / "b_8.images.npy" and mapped_file(compressed.images) is None
    assert torch.equal(mapped.images, compressed.images) and mapped.fingerprint == compressed.fingerprint


def test_clients_keep_indices_and_batches_read_only_their_rows(prepared):
    root, out = prepared
    mapped = load_dataset("PACS", out, 12)
    in_memory = load_image_folders(root / "PACS", "PACS", 12, PACS_DOMAINS)
    indices = torch.tensor([3, 0, 7, 20, 11, 5, 16])
    client = ClientData.from_dataset(mapped, indices, "unit")
    reference = ClientData.from_dataset(in_memory, indices, "unit")
    assert isinstance(client.images, ImageRows) and client.images.source is mapped.images
    # in memory too a client keeps a view of the dataset's images, never a copy
    assert isinstance(reference.images, ImageRows) and reference.images.source is in_memory.images
    assert len(client) == 7 and client.images.shape == reference.images.shape and client.images.dtype == torch.uint8
    assert torch.equal(client.images[torch.arange(7)], in_memory.images[indices])
    subset = client.subset(client.targets == 1)
    assert isinstance(subset.images, ImageRows) and subset.images.source is mapped.images  # narrowed, still unread
    assert torch.equal(subset.images[:], reference.subset(reference.targets == 1).images[:])
    assert isinstance(client.without_labels().images, ImageRows)
    batches = list(client.batches(3, torch.Generator().manual_seed(4)))
    expected = list(reference.batches(3, torch.Generator().manual_seed(4)))
    assert [len(b.targets) for b in batches] == [3, 3, 1]
    assert all(torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) for a, b in zip(batches, expected))
    assert all(torch.equal(a, b) for a, b in zip(client.input_chunks(4), reference.input_chunks(4)))


def test_each_load_maps_the_file_afresh_and_an_edit_in_place_stays_in_memory(prepared):
    _, out = prepared
    npy = out / "pacs" / "pacs_12.images.npy"
    on_disk = npy.read_bytes()
    first = load_dataset("PACS", out, 12)
    pixels = first.images.clone()
    first.images[:] = 0  # copy-on-write: the process's pages change, the file does not
    second = load_dataset("PACS", out, 12)
    assert torch.equal(second.images, pixels) and mapped_file(second.images) == npy
    assert npy.read_bytes() == on_disk


def test_a_run_reads_either_layout_to_the_same_results(tmp_path):
    from fedbed.experiment import ExperimentConfig, run_experiment

    root = write_tree(tmp_path / "data", per_class=2)
    prepare_dataset("PACS", root, 28, tmp_path / "mapped", memory_mapped=True)
    save_packed(load_image_folders(root / "PACS", "PACS", 28, PACS_DOMAINS), tmp_path / "compressed" / "pacs" / "pacs_28.npz")
    summaries, logs = [], []
    for name in ("mapped", "compressed"):
        run_dir = tmp_path / "runs" / name
        summaries.append(run_experiment(ExperimentConfig(dataset="PACS", target="photo", data_root=tmp_path / name,
                                                         model="lenet", rounds=1, local_steps=1, batch_size=4,
                                                         augmentation="domainbed", run_dir=run_dir),
                                        progress=False, echo=lambda *_: None))
        logs.append([json.loads(line)["metrics"] for line in (run_dir / "rounds.jsonl").read_text().splitlines()])
    assert summaries[0]["data_fingerprint"] == summaries[1]["data_fingerprint"]
    assert summaries[0]["data_source"] == f"packed {tmp_path / 'mapped' / 'pacs' / 'pacs_28.npz'}"
    assert logs[0] == logs[1]


def test_prepare_chooses_the_layout_by_size_unless_told(tmp_path):
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.data.catalog import MEMORY_MAPPED_FROM

    root = write_tree(tmp_path / "data", per_class=1)
    small = prepare_dataset("PACS", root, 8)
    large = prepare_dataset("PACS", root, MEMORY_MAPPED_FROM)
    assert not images_file(small).exists() and images_file(large).is_file()
    assert mapped_file(load_packed(large, "PACS").images) == images_file(large)
    result = CliRunner().invoke(app, ["data", "prepare", str(root / "PACS"), "--size", "8", "--memory-mapped"])
    assert result.exit_code == 0, result.output
    assert images_file(root / "PACS" / "PACS_8.npz").is_file()
