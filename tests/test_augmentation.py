"""Augmentation views and input scaling: seeded, shape-preserving, applied per batch, resumable."""

from __future__ import annotations

import json

import pytest
import torch

from fedbed.data.augmentation import AUGMENTATIONS, Augmentation, AugmentationError
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.local_data import ClientData, to_model_input


def rgb_images(count=6, side=32, seed=0):
    return torch.randint(0, 256, (count, 3, side, side), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("name", sorted(AUGMENTATIONS))
def test_views_are_seeded_shape_preserving_and_per_image(name):
    images = rgb_images()
    augmentation = Augmentation(name, views=2)
    before = torch.random.get_rng_state()
    first, second = augmentation.apply(images, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random stream does not move
    assert first.shape == images.shape and first.dtype == torch.uint8
    again = augmentation.apply(images, seed=5)
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert not torch.equal(first, second)  # two views draw differently
    assert not torch.equal(augmentation.apply(images, seed=6)[0], first)
    grey = augmentation.apply(images[:, :1], seed=5)[0]
    assert grey.shape == images[:, :1].shape


def test_each_image_draws_its_own_flip():
    images = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4).expand(64, 3, 4, 4).contiguous()
    (view,) = Augmentation("flip_crop").apply(images, seed=0)
    assert 0 < sum(int(torch.equal(v, images[0])) for v in view) < 64  # some flipped, some not: not one draw for all


def test_bad_names_and_view_counts_are_refused():
    with pytest.raises(AugmentationError, match="unknown augmentation 'mixup'; choose one of"):
        Augmentation("mixup")
    with pytest.raises(AugmentationError, match="at least one view"):
        Augmentation("simclr", views=0)


def test_input_scalings():
    pixels = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 1, 1)
    assert to_model_input(pixels, "unit").flatten().tolist() == [0.0] * 3 + [1.0] * 3
    assert to_model_input(pixels, "symmetric").flatten().tolist() == [-1.0] * 3 + [1.0] * 3
    imagenet = to_model_input(pixels, "imagenet")
    assert imagenet[0, 0, 0, 0].item() == pytest.approx(-0.485 / 0.229)
    with pytest.raises(ValueError, match="unknown input scaling"):
        to_model_input(pixels, "zscore")


def test_batches_stay_uint8_until_the_batch_and_number_their_views():
    data = ClientData(rgb_images(10), torch.arange(10), torch.zeros(10, dtype=torch.long), scaling="unit")
    assert data.images.dtype == torch.uint8
    batches = list(data.batches(4, torch.Generator().manual_seed(0), Augmentation("simclr", views=2), 9, first_number=3))
    assert [b.number for b in batches] == [3, 4, 5] and [len(b.views) for b in batches] == [2, 2, 2]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batches[0].inputs, to_model_input(data.images[order[:4]], "unit"))  # augmentation leaves the order alone
    again = list(data.batches(4, torch.Generator().manual_seed(0), Augmentation("simclr", views=2), 9, first_number=3))
    assert all(torch.equal(a.views[1], b.views[1]) for a, b in zip(batches, again))


def test_an_augmented_run_resumes_bit_identically(tmp_path):
    settings = dict(model="lenet", rounds=2, local_steps=2, batch_size=8, augmentation="flip_crop", input_scaling="symmetric")
    straight = run_experiment(ExperimentConfig(run_dir=tmp_path / "a", **settings), progress=False, echo=lambda *_: None)
    run_experiment(ExperimentConfig(run_dir=tmp_path / "b", **{**settings, "rounds": 1}), progress=False, echo=lambda *_: None)
    resumed = run_experiment(ExperimentConfig(run_dir=tmp_path / "b", **settings), resume=True, progress=False, echo=lambda *_: None)
    logs = [[json.loads(line)["metrics"] for line in (tmp_path / r / "rounds.jsonl").read_text().splitlines()] for r in "ab"]
    assert logs[0] == logs[1]
    assert straight["selection"]["last"]["ood"] == resumed["selection"]["last"]["ood"]
    run_experiment(ExperimentConfig(run_dir=tmp_path / "c", **{**settings, "augmentation": None}), progress=False, echo=lambda *_: None)
    assert json.loads((tmp_path / "c" / "rounds.jsonl").read_text().splitlines()[0])["metrics"] != logs[0][0]


def test_amplitude_mix_keeps_each_images_phase_and_mixes_amplitudes():
    images = rgb_images(8)
    (mixed,) = Augmentation("amplitude_mix").apply(images, seed=1)
    assert mixed.shape == images.shape and mixed.dtype == torch.uint8 and not torch.equal(mixed, images)
    assert torch.equal(Augmentation("amplitude_mix").apply(images, seed=1)[0], mixed)
    # With λ = 0 (ratio 0) nothing changes but the round trip through the FFT.
    from fedbed.data.augmentation import amplitude_mix

    assert (amplitude_mix(images, ratio=0.0).int() - images.int()).abs().max() <= 1
    # Mixing two identical images changes nothing either: the amplitude is shared.
    twins = images[:1].expand(2, -1, -1, -1).contiguous()
    assert (amplitude_mix(twins).int() - twins.int()).abs().max() <= 1


def test_mixstyle_mixes_statistics_in_training_only():
    from fedbed.models import build_model
    from fedbed.models.mixstyle import MixStyle

    layer = MixStyle(p=1.0)
    features = torch.randn(4, 3, 5, 5) * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(4, 1, 1, 1)
    torch.manual_seed(0)
    mixed = layer(features)
    assert mixed.shape == features.shape and not torch.allclose(mixed, features)
    # The content (the normalised map) is kept: each mixed map is an affine copy of its own.
    normalised = (features - features.mean((2, 3), keepdim=True)) / features.std((2, 3), keepdim=True)
    again = (mixed - mixed.mean((2, 3), keepdim=True)) / mixed.std((2, 3), keepdim=True)
    assert torch.allclose(normalised, again, atol=1e-4)
    # Deterministic under a seed (the engine seeds torch per round and client), and the seed matters.
    torch.manual_seed(0)
    assert torch.equal(layer(features), mixed)
    torch.manual_seed(1)
    assert not torch.equal(layer(features), mixed)
    layer.eval()
    assert torch.equal(layer(features), features)
    model = build_model("hfedf_cnn", (3, 32, 32), 7, mixstyle=True)
    assert sum(isinstance(m, MixStyle) for m in model.modules()) == 2
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="MixStyle has a placement for"):
        build_model("lenet", (1, 28, 28), 10, mixstyle=True)


def test_domainbed_augmentation_takes_domainbeds_values_and_is_seeded():
    """DomainBed's augment_transform (datasets.py): RandomResizedCrop(scale 0.7-1), flip, ColorJitter(0.3 x 4),
    RandomGrayscale (p 0.1), here to the images' own side; the same seed gives the same views."""
    from torchvision.transforms import v2

    from fedbed.data.augmentation import AUGMENTATIONS

    crop, flip, jitter, grey = AUGMENTATIONS["domainbed"](3, 224).transforms
    assert isinstance(crop, v2.RandomResizedCrop) and crop.size == (224, 224) and crop.scale == (0.7, 1.0)
    assert isinstance(flip, v2.RandomHorizontalFlip) and flip.p == 0.5
    assert isinstance(jitter, v2.ColorJitter) and jitter.brightness == jitter.contrast == jitter.saturation == (0.7, 1.3)
    assert jitter.hue == (-0.3, 0.3)
    assert isinstance(grey, v2.RandomGrayscale) and grey.p == 0.1
    assert len(AUGMENTATIONS["domainbed"](1, 224).transforms) == 2  # grey images: the crop and the flip only
    images = rgb_images(count=3, side=224)
    (view,) = Augmentation("domainbed").apply(images, seed=11)
    assert view.shape == (3, 3, 224, 224) and view.dtype == torch.uint8 and not torch.equal(view, images)
    assert torch.equal(Augmentation("domainbed").apply(images, seed=11)[0], view)
    assert not torch.equal(Augmentation("domainbed").apply(images, seed=12)[0], view)
