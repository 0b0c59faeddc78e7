"""Pretrained backbones (fedbed.models.backbones) and DomainBed's ResNet options, never downloading:
torchvision's ImageNet weights read from a test-made torch hub cache, the offline refusal at
validation, timm models by name (skipped without timm), frozen BatchNorm and feature dropout."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fedbed.build import build_run
from fedbed.cli import app
from fedbed.config import ConfigError, ExperimentConfig, validate
from fedbed.models import ModelError, build_model, model_refusal
from fedbed.models.backbones import ALLOW_DOWNLOADS, torch_hub_file, torchvision_weights
from fedbed.models.networks import DomainBedFeaturizer

runner = CliRunner()


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """An empty torch hub cache (``TORCH_HOME``) and downloads not allowed."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv(ALLOW_DOWNLOADS, raising=False)
    return tmp_path / "torch"


def cache_imagenet_resnet18(seed: int = 3) -> dict[str, torch.Tensor]:
    """A torchvision ResNet-18's state dict saved where torchvision's weights API looks for its
    ImageNet weights (the file name its URL gives, under ``TORCH_HOME``); the state dict."""
    from torchvision.models import resnet18

    torch.manual_seed(seed)
    state = resnet18(weights=None).state_dict()
    file = torch_hub_file(torchvision_weights("resnet18").url)
    assert file.name == "resnet18-f37072fd.pth"
    file.parent.mkdir(parents=True)
    torch.save(state, file)
    return state


def test_pretrained_imagenet_reads_torchvisions_weights_from_the_hub_cache(torch_home):
    state = cache_imagenet_resnet18()
    assert str(torch_hub_file(torchvision_weights("resnet18").url)).startswith(str(torch_home / "hub" / "checkpoints"))
    model = build_model("resnet18", (3, 32, 32), 7, pretrained="imagenet")
    featurizer = model.featurizer.state_dict()
    assert set(featurizer) == {key for key in state if not key.startswith("fc.")}
    assert all(torch.equal(featurizer[key], state[key]) for key in featurizer)
    assert model.classifier.out_features == 7


def test_a_run_with_pretrained_imagenet_starts_from_the_cached_weights(torch_home):
    state = cache_imagenet_resnet18()
    built = build_run(validate(ExperimentConfig(model="resnet18", pretrained="imagenet", channels=3, rounds=1,
                                                local_steps=1)))
    featurizer = built.initial_model.featurizer.state_dict()
    assert all(torch.equal(featurizer[key], state[key]) for key in featurizer)


def test_without_the_cached_file_validation_refuses_in_one_line(torch_home, monkeypatch):
    config = ExperimentConfig(model="resnet18", pretrained="imagenet", channels=3)
    with pytest.raises(ConfigError) as refused:
        validate(config)
    message = str(refused.value)
    assert "\n" not in message
    assert str(torch_home / "hub" / "checkpoints") in message and "resnet18-f37072fd.pth" in message
    assert "pretrained_weights: PATH" in message and f"{ALLOW_DOWNLOADS}=1" in message
    assert not torch_home.exists()  # nothing downloaded, no folder made
    monkeypatch.setenv(ALLOW_DOWNLOADS, "1")  # a connected machine: the download happens when the model is built
    validate(config)


def test_the_cli_refuses_pretrained_offline_with_exit_code_2(torch_home, tmp_path):
    result = runner.invoke(app, ["run", "--model", "resnet50", "--pretrained", "imagenet", "--rounds", "1",
                                 "--local-steps", "1", "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "resnet50-0676ba61.pth" in lines[0] and "pretrained_weights: PATH" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("settings, message", [
    ({"model": "resnet18", "pretrained": "imagenet", "pretrained_weights": "w.pth"}, "give pretrained"),
    ({"model": "lenet", "pretrained": "imagenet"}, "applies to resnet18, resnet50 and timm:NAME models, not lenet"),
    ({"model": "resnet18_cifar", "pretrained": "imagenet"}, "not resnet18_cifar"),
    ({"model": "lenet", "freeze_batchnorm": True}, "lenet has no BatchNorm layer"),
    ({"model": "vgg"}, "unknown model 'vgg'; choose one of mnist_cnn"),
])
def test_pretrained_and_batchnorm_settings_are_checked_at_validation(settings, message, torch_home):
    with pytest.raises(ConfigError, match=message):
        validate(ExperimentConfig(**settings))


@pytest.mark.parametrize("settings", [{"pretrained": "ImageNet21k"}, {"classifier_dropout": 1.0}, {"classifier_dropout": -0.1}])
def test_bad_values_of_the_new_settings_are_refused(settings):
    with pytest.raises(ConfigError, match=next(iter(settings))):
        ExperimentConfig(**settings)


def test_the_new_settings_default_to_none_so_job_hashes_stay():
    dumped = ExperimentConfig().model_dump()
    assert dumped["pretrained"] is dumped["freeze_batchnorm"] is dumped["classifier_dropout"] is None


def test_without_timm_a_timm_model_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` fails as if it were not installed
    refusal = model_refusal("timm:resnet18")
    assert refusal is not None and 'pip install "fedbed[timm]"' in refusal and "\n" not in refusal
    with pytest.raises(ConfigError, match=r'pip install "fedbed\[timm\]"'):
        validate(ExperimentConfig(model="timm:resnet18"))


@pytest.mark.parametrize("name, shape", [("timm:resnet18", (1, 28, 28)), ("timm:vit_tiny_patch16_224", (3, 32, 32))])
def test_a_timm_backbone_builds_and_runs_with_random_weights(name, shape):
    pytest.importorskip("timm", reason='timm is not installed (pip install "fedbed[timm]")')
    torch.manual_seed(0)
    model = build_model(name, shape, 5)
    features = model.featurizer(torch.randn(2, *shape))
    assert features.shape == (2, model.feature_dim)
    assert isinstance(model.classifier, nn.Linear) and model.classifier.in_features == model.feature_dim
    assert model(torch.randn(2, *shape)).shape == (2, 5)


def test_timm_names_and_pretrained_weights_are_checked_without_downloading(torch_home):
    pytest.importorskip("timm", reason='timm is not installed (pip install "fedbed[timm]")')
    assert "timm has no model 'no_such_net'" in model_refusal("timm:no_such_net")
    assert model_refusal("timm:resnet18") is None
    refusal = model_refusal("timm:resnet18", "imagenet")
    if refusal is not None:  # a machine whose Hugging Face cache holds the weights passes
        assert "\n" not in refusal and f"{ALLOW_DOWNLOADS}=1" in refusal and "resnet18" in refusal


def test_timm_pretrained_reads_the_hugging_face_cache_as_a_local_file(tmp_path, monkeypatch):
    timm = pytest.importorskip("timm", reason='timm is not installed (pip install "fedbed[timm]")')
    from huggingface_hub import constants
    from safetensors.torch import save_file

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # a test-made Hugging Face cache
    monkeypatch.delenv(ALLOW_DOWNLOADS, raising=False)
    repository = timm.models.get_pretrained_cfg("resnet18").hf_hub_id
    assert "resnet18" in model_refusal("timm:resnet18", "imagenet")
    torch.manual_seed(5)
    state = timm.create_model("resnet18").state_dict()
    folder = tmp_path / "hub" / f"models--{repository.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    save_file(state, folder / "snapshots" / ("0" * 40) / "model.safetensors")
    assert model_refusal("timm:resnet18", "imagenet") is None
    model = build_model("timm:resnet18", (3, 32, 32), 3, pretrained="imagenet")
    featurizer = model.featurizer.state_dict()
    assert set(featurizer) == {key for key in state if not key.startswith("fc.")}
    assert all(torch.equal(featurizer[key], state[key]) for key in featurizer)


def batchnorm_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()
            if key.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def one_training_step(model: nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 0, 1])).backward()
    optimizer.step()


def test_frozen_batchnorm_keeps_its_running_statistics_through_a_training_step():
    torch.manual_seed(0)
    frozen = build_model("resnet18", (3, 16, 16), 2, freeze_batchnorm=True)
    before = batchnorm_statistics(frozen)
    weight = frozen.featurizer.network.bn1.weight.detach().clone()
    one_training_step(nn.Sequential(frozen))  # model.train() reaches the featurizer through any wrapper
    assert frozen.training and not frozen.featurizer.network.bn1.training
    after = batchnorm_statistics(frozen)
    assert before and all(torch.equal(before[key], after[key]) for key in before)
    assert not torch.equal(weight, frozen.featurizer.network.bn1.weight)  # the affine weights still train
    trained = build_model("resnet18", (3, 16, 16), 2)
    before = batchnorm_statistics(trained)
    one_training_step(trained)
    assert not torch.equal(before["featurizer.bn1.running_mean"], trained.state_dict()["featurizer.bn1.running_mean"])


def test_classifier_dropout_sits_on_the_features_before_the_classifier():
    model = build_model("resnet18", (3, 32, 32), 2, classifier_dropout=0.1)
    assert isinstance(model.featurizer, DomainBedFeaturizer) and model.featurizer.dropout.p == 0.1
    assert not model.featurizer.freeze_batchnorm
    images = torch.randn(2, 3, 32, 32)
    model.eval()
    assert torch.equal(model.featurizer(images), model.featurizer.network(images))
    plain = build_model("resnet18", (3, 32, 32), 2)
    assert not any(isinstance(module, nn.Dropout) for module in plain.modules())  # unset: the model as before


def test_a_run_builds_the_resnet_options_into_its_model(torch_home):
    built = build_run(validate(ExperimentConfig(model="resnet18", channels=3, freeze_batchnorm=True,
                                                classifier_dropout=0.25, rounds=1, local_steps=1)))
    featurizer = built.initial_model.featurizer
    assert isinstance(featurizer, DomainBedFeaturizer) and featurizer.freeze_batchnorm and featurizer.dropout.p == 0.25


def test_build_model_refuses_what_validation_refuses(torch_home):
    with pytest.raises(ModelError, match="resnet18-f37072fd.pth"):
        build_model("resnet18", (3, 32, 32), 2, pretrained="imagenet")
    with pytest.raises(ModelError, match="not both"):
        build_model("resnet18", (3, 32, 32), 2, pretrained="imagenet", pretrained_weights=torch_home / "w.pth")
    with pytest.raises(ModelError, match="no BatchNorm"):
        build_model("hfedf_cnn", (3, 32, 32), 2, freeze_batchnorm=True)
