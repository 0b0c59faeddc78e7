"""Digits (Digit-5): each domain read from tiny files written here in its real distribution format."""

from __future__ import annotations

import bz2
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image
from sklearn.datasets import dump_svmlight_file
from typer.testing import CliRunner

from fedbed.cli import app
from fedbed.config import ConfigError, ExperimentConfig, validate
from fedbed.data import DataError, dataset_spec, load_dataset, with_found_domains
from fedbed.data import digits
from fedbed.data.catalog import locate
from fedbed.sweep import SweepSpec, expand


def write_mnist(root: Path, train_labels=(1, 2, 3), test_labels=(4, 5)) -> None:
    """``mnist/mnist.npz``: each image filled with 10 x its label."""
    (root / "mnist").mkdir(parents=True)
    arrays = {}
    for split, labels in (("train", train_labels), ("test", test_labels)):
        arrays[f"{split}_images"] = np.stack([np.full((28, 28), 10 * label, np.uint8) for label in labels])
        arrays[f"{split}_labels"] = np.array(labels, np.uint8)
    np.savez(root / "mnist" / "mnist.npz", **arrays)


def write_mnist_m(root: Path, train=(7, 8), test=(9,)) -> None:
    """MNIST-M's release: PNGs whose red channel is 20 x the label, and the label files."""
    for split, labels in (("train", train), ("test", test)):
        folder = root / "mnist_m" / f"mnist_m_{split}"
        folder.mkdir(parents=True)
        lines = []
        for index, label in enumerate(labels):
            name = f"{index:08d}.png"
            pixels = np.zeros((28, 28, 3), np.uint8)
            pixels[..., 0], pixels[..., 2] = 20 * label, 200
            Image.fromarray(pixels).save(folder / name)
            lines.append(f"{name} {label}")
        (root / "mnist_m" / f"mnist_m_{split}_labels.txt").write_text("\n".join(lines) + "\n")


def write_usps(root: Path, train=(1, 10, 3), test=(2,)) -> None:
    """LIBSVM's usps.bz2 / usps.t.bz2: labels 1..10, 256 features; sample i is -1 except pixel 0 = +1."""
    (root / "usps").mkdir(parents=True)
    for name, labels in (("usps", train), ("usps.t", test)):
        features = -np.ones((len(labels), 256))
        features[:, 0] = 1.0
        plain = root / "usps" / name
        dump_svmlight_file(features, np.array(labels, float), str(plain), zero_based=False)
        (root / "usps" / f"{name}.bz2").write_bytes(bz2.compress(plain.read_bytes()))
        plain.unlink()


def write_mat(path: Path, labels, value: int = 50) -> None:
    """SVHN's format 2: X uint8 [32, 32, 3, N] (green channel = value + label), y [N, 1] (10 for 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = np.zeros((32, 32, 3, len(labels)), np.uint8)
    for index, label in enumerate(labels):
        images[:, :, 1, index] = value + label
    scipy.io.savemat(path, {"X": images, "y": np.array(labels, np.uint8).reshape(-1, 1)})


def write_svhn(root: Path, train=(10, 1, 2), test=(3, 10)) -> None:
    write_mat(root / "svhn" / "train_32x32.mat", train)
    write_mat(root / "svhn" / "test_32x32.mat", test)


def write_syn(root: Path, train=(5, 6), test=(7,)) -> None:
    write_mat(root / "syn" / "synth_train_32x32.mat", train, value=100)
    write_mat(root / "syn" / "synth_test_32x32.mat", test, value=100)


def of_domain(dataset, name):
    mask = dataset.domains == dataset.domain_index(name)
    return dataset.images[mask], dataset.labels[mask]


def test_all_five_domains_are_read_from_their_own_formats(tmp_path):
    for write in (write_mnist, write_mnist_m, write_usps, write_svhn, write_syn):
        write(tmp_path)
    dataset = load_dataset("digits", tmp_path)
    assert dataset.domain_names == ("mnist", "mnist_m", "usps", "svhn", "syn")
    assert dataset.input_shape == (3, 32, 32) and dataset.class_names == tuple("0123456789")
    assert dataset.counts().sum(1).tolist() == [5, 3, 4, 5, 3]

    images, labels = of_domain(dataset, "mnist")  # train then test; grey repeated into 3 channels
    assert labels.tolist() == [1, 2, 3, 4, 5]
    assert images[:, :, 16, 16].tolist() == [[10 * label] * 3 for label in labels.tolist()]
    images, labels = of_domain(dataset, "mnist_m")
    assert labels.tolist() == [7, 8, 9]
    assert images[:, :, 16, 16].tolist() == [[20 * label, 0, 200] for label in labels.tolist()]
    images, labels = of_domain(dataset, "usps")  # label 10 is digit 0; -1 black, +1 white
    assert labels.tolist() == [0, 9, 2, 1]
    assert images[0, :, 31, 31].tolist() == [0, 0, 0] and images[0, :, 0, 0].min() > 100
    images, labels = of_domain(dataset, "svhn")  # 10 means 0; channels first, colours kept
    assert labels.tolist() == [0, 1, 2, 3, 0]
    assert images[:, :, 5, 5].tolist() == [[0, 50 + y, 0] for y in (10, 1, 2, 3, 10)]
    images, labels = of_domain(dataset, "syn")
    assert labels.tolist() == [5, 6, 7] and images[0, 1, 0, 0] == 105
    assert "missing: none" in dataset.source and "svhn/train_32x32.mat" in dataset.source


def test_any_subset_of_two_or_more_domains_is_the_dataset(tmp_path):
    write_usps(tmp_path)
    write_svhn(tmp_path)
    write_syn(tmp_path)
    spec = with_found_domains(dataset_spec("Digits"), tmp_path)
    assert spec.domain_names == ("usps", "svhn", "syn")
    dataset = load_dataset("Digits", tmp_path, image_size=16)
    assert dataset.domain_names == spec.domain_names and dataset.input_shape == (3, 16, 16)
    assert "missing: mnist, mnist_m" in dataset.source
    assert validate(ExperimentConfig(dataset="digits", target="svhn", data_root=tmp_path)).dataset.domain_names == spec.domain_names
    with pytest.raises(ConfigError, match="no domain 'mnist'; its domains are usps, svhn, syn"):
        validate(ExperimentConfig(dataset="digits", target="mnist", data_root=tmp_path))
    with pytest.raises(ConfigError, match="no default target"):
        validate(ExperimentConfig(dataset="digits", data_root=tmp_path))
    jobs = expand(SweepSpec(base={"dataset": "Digits", "data_root": str(tmp_path)}, algorithms=["fedavg"], targets="all"),
                  tmp_path / "sweep")
    assert [job.target for job in jobs] == ["usps", "svhn", "syn"]
    listing = CliRunner().invoke(app, ["datasets", "--data-root", str(tmp_path)]).output
    assert "Digits          domains: usps, svhn, syn" in listing
    assert "mnist_m: missing (expected mnist_m/mnist_m_train/" in locate(dataset_spec("Digits"), tmp_path)


def test_one_domain_is_not_a_dataset_and_the_embedded_mnist_sample_is_not_used(tmp_path):
    write_svhn(tmp_path)
    with pytest.raises(DataError, match=r"at least two .* found svhn; missing: mnist \(expected MNIST/raw/.*usps/usps.bz2"):
        load_dataset("Digits", tmp_path)
    with pytest.raises(DataError, match="no data root given"):
        with_found_domains(dataset_spec("Digits"), None)


def test_each_domain_keeps_the_first_digit5_images_of_each_file(tmp_path, monkeypatch):
    monkeypatch.setattr(digits, "DIGIT5_SIZES", {"train": 2, "test": 1})
    write_mnist(tmp_path)
    write_mnist_m(tmp_path, train=(1, 2, 3), test=(4, 5))
    write_svhn(tmp_path)
    dataset = digits.load_digits(tmp_path, 32)
    assert [of_domain(dataset, d)[1].tolist() for d in ("mnist", "mnist_m", "svhn")] == [[1, 2, 4], [1, 2, 4], [0, 1, 3]]
    assert "at most the first 2 train and 1 test images per domain" in dataset.source


def test_digits_files_at_fault_are_named(tmp_path):
    write_mnist(tmp_path)
    write_svhn(tmp_path)
    (tmp_path / "svhn" / "test_32x32.mat").unlink()  # half a download is read, and the missing file named
    with pytest.raises(DataError, match=r"svhn/test_32x32.mat is missing; expected a MATLAB file with X uint8"):
        load_dataset("Digits", tmp_path)
    scipy.io.savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 1), np.uint8)})
    with pytest.raises(DataError, match=r"cannot read .*test_32x32.mat.*expected a MATLAB file"):
        load_dataset("Digits", tmp_path)
    write_mat(tmp_path / "svhn" / "test_32x32.mat", [11])
    with pytest.raises(DataError, match=r"test_32x32.mat: labels must be 1..10"):
        load_dataset("Digits", tmp_path)


def test_mnist_m_and_usps_errors_name_the_file_and_line(tmp_path):
    write_mnist_m(tmp_path)
    (tmp_path / "mnist_m" / "mnist_m_test_labels.txt").write_text("00000000.png 9\n00000001.png\n")
    with pytest.raises(DataError, match=r"mnist_m_test_labels.txt, line 2: '00000001.png' is not '<file> <label>'"):
        digits.read_mnist_m_split(tmp_path / "mnist_m" / "mnist_m_test_labels.txt", tmp_path / "mnist_m" / "mnist_m_test", 9)
    (tmp_path / "mnist_m" / "mnist_m_test_labels.txt").write_text("absent.png 3\n")
    with pytest.raises(DataError, match=r"cannot read image .*absent.png"):
        digits.read_mnist_m_split(tmp_path / "mnist_m" / "mnist_m_test_labels.txt", tmp_path / "mnist_m" / "mnist_m_test", 9)
    write_usps(tmp_path, train=(11,))
    with pytest.raises(DataError, match=r"usps.bz2: labels must be 1..10 \(digits 0..9\), found \[11.0\]"):
        digits.read_usps_file(tmp_path / "usps" / "usps.bz2")
    (tmp_path / "usps" / "usps.t.bz2").write_bytes(b"not bz2 at all")
    with pytest.raises(DataError, match=r"cannot read .*usps.t.bz2: .*expected LIBSVM's bz2 libsvm text"):
        digits.read_usps_file(tmp_path / "usps" / "usps.t.bz2")
    (tmp_path / "usps" / "usps.t.bz2").write_bytes(bz2.compress(b"3 1:2.5\n"))
    with pytest.raises(DataError, match=r"features must lie in \[-1, 1\], found 0..2.5"):
        digits.read_usps_file(tmp_path / "usps" / "usps.t.bz2")


def test_usps_pixels_map_linearly_from_minus_one_to_one(tmp_path):
    (tmp_path / "usps").mkdir()
    features = np.linspace(-1, 1, 256).reshape(1, 256)
    dump_svmlight_file(features, np.array([4.0]), str(tmp_path / "plain"), zero_based=False)
    (tmp_path / "usps" / "usps.bz2").write_bytes(bz2.compress((tmp_path / "plain").read_bytes()))
    images, labels = digits.read_usps_file(tmp_path / "usps" / "usps.bz2")
    assert images.shape == (1, 1, 16, 16) and labels.tolist() == [3]
    assert images[0, 0, 0, 0] == 0 and images[0, 0, 15, 15] == 255 and images[0, 0, 0, 1] == 1  # row by row
    assert torch.equal(images.flatten(), torch.from_numpy(np.rint((features[0] + 1) * 127.5).astype(np.uint8)))
