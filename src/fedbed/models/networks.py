"""Model architectures. Every model is a :class:`DomainClassifier`: a featurizer and a classifier."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fedbed.models.mixstyle import insert_mixstyle


class DomainClassifier(nn.Module):
    """``classifier(featurizer(x))`` with both parts reachable by name.

    Methods that act on the representation (FedSR, FedADG) or on the classifier head only
    (MCGDM) address ``featurizer`` and ``classifier`` directly.

    Args:
        featurizer: maps images ``[B, C, H, W]`` to features ``[B, feature_dim]``.
        classifier: maps features ``[B, feature_dim]`` to logits ``[B, num_classes]``.
        feature_dim: width of the features.
    """

    def __init__(self, featurizer: nn.Module, classifier: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.featurizer = featurizer
        self.classifier = classifier
        self.feature_dim = feature_dim

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_classes]`` of images ``[B, C, H, W]`` (float, normalized)."""
        return self.classifier(self.featurizer(images))


class MnistCnn(nn.Module):
    """DomainBed's MNIST featurizer (Gulrajani & Lopez-Paz 2021, ``networks.MNIST_CNN``).

    Four 3x3 convolutions (64, 128 stride 2, 128, 128 channels), each followed by ReLU and
    GroupNorm(8 groups), then global average pooling: ``[B, C, 28, 28]`` -> ``[B, 128]``.
    """

    feature_dim = 128

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        widths = (64, 128, 128, 128)
        strides = (1, 2, 1, 1)
        layers: list[nn.Module] = []
        previous = in_channels
        for width, stride in zip(widths, strides):
            layers += [nn.Conv2d(previous, width, 3, stride=stride, padding=1), nn.ReLU(), nn.GroupNorm(8, width)]
            previous = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.layers = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


class LeNet(nn.Module):
    """LeNet-5 featurizer (LeCun et al. 1998) for 28x28 images, the RotatedMNIST model of PPDG
    (``ppdg-gradient-alignment.txt``, Sec. 4.4).

    conv5x5(6, padding 2) -> ReLU -> maxpool 2 -> conv5x5(16) -> ReLU -> maxpool 2 -> flatten (400)
    -> linear 120 -> ReLU -> linear 84 -> ReLU: ``[B, C, 28, 28]`` -> ``[B, 84]``.
    """

    feature_dim = 84

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, self.feature_dim),
            nn.ReLU(),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


class InceptionModule(nn.Module):
    """The Inception-style block of hFedF's client CNN (``hfedf.txt``, Table 9).

    Four parallel branches concatenated on channels: a 1x1 convolution to 32 channels, a 3x3
    convolution to 64, a 5x5 convolution to 16 (the table's "int. channels = [32, 64, 16]") and a
    3x3 max-pool that passes the input channels through, so ``[B, C, H, W]`` -> ``[B, C + 112, H, W]``.
    This reproduces Table 9's widths exactly (64 -> 176 -> 288); the table gives no reduction
    convolutions, so none are added.
    """

    def __init__(self, in_channels: int, branch_channels: tuple[int, int, int] = (32, 64, 16)) -> None:
        super().__init__()
        one, three, five = branch_channels
        self.branch_1x1 = nn.Conv2d(in_channels, one, 1)
        self.branch_3x3 = nn.Conv2d(in_channels, three, 3, padding=1)
        self.branch_5x5 = nn.Conv2d(in_channels, five, 5, padding=2)
        self.branch_pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.out_channels = in_channels + one + three + five

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch_1x1(x), self.branch_3x3(x), self.branch_5x5(x), self.branch_pool(x)], dim=1)


class HfedfCnn(nn.Module):
    """hFedF's client featurizer for 32x32 RGB (``hfedf.txt``, App. C.7, Table 9).

    conv3x3(32) -> maxpool -> ReLU -> conv1x1(32) -> conv3x3(64) -> maxpool -> ReLU ->
    Inception(176) -> ReLU -> Inception(288) -> ReLU -> adaptive avg-pool 3x3 -> flatten (2592) ->
    dropout 0.2 -> linear 256: ``[B, 3, 32, 32]`` -> ``[B, 256]``. Table 9's last layer, the
    linear map to the classes, is the classifier of :func:`build_model`.
    """

    feature_dim = 256

    def __init__(self, in_channels: int = 3, dropout: float = 0.2) -> None:
        super().__init__()
        first = InceptionModule(64)
        second = InceptionModule(first.out_channels)
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(32, 32, 1),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            first,
            nn.ReLU(),
            second,
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(3),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(second.out_channels * 9, self.feature_dim),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


def _resnet(depth: int, in_channels: int, weights_path: Path | None) -> tuple[nn.Module, int]:
    """torchvision's ResNet-18/50 without its last layer; ImageNet weights only from a local file."""
    from torchvision.models import resnet18, resnet50

    network = (resnet18 if depth == 18 else resnet50)(weights=None)
    if weights_path is not None:
        if not Path(weights_path).is_file():
            raise ModelError(f"pretrained weights file {weights_path} does not exist; give a local torchvision state dict")
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
            network.load_state_dict(state)
        except (RuntimeError, OSError, KeyError) as error:
            raise ModelError(f"cannot load ResNet-{depth} weights from {weights_path}: {error}") from None
    if in_channels != 3:
        network.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    feature_dim = network.fc.in_features
    network.fc = nn.Identity()
    return network, feature_dim


def _cifar_resnet18(in_channels: int) -> tuple[nn.Module, int]:
    """The CIFAR-style ResNet-18 of FedEMA (Zhuang, Wen, Zhang 2022) that FedGaLA uses
    (``fedgala.md``, App. B.2): torchvision's ResNet-18 with (i) a 3x3 stride-1 first convolution
    instead of the 7x7 stride-2 one and no max-pool (He et al. 2016, Sec. 4.2, the CIFAR stem),
    (ii) a 4x4 average pooling instead of the adaptive one, and (iii) no last linear layer (the
    classifier of :func:`build_model`; self-supervised methods add their projector).
    ``[B, C, 32, 32]`` -> ``[B, 512]``.
    """
    from torchvision.models import resnet18

    network = resnet18(weights=None)
    network.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    network.maxpool = nn.Identity()
    network.avgpool = nn.AvgPool2d(4)
    feature_dim = network.fc.in_features
    network.fc = nn.Identity()
    return network, feature_dim


class ModelError(ValueError):
    """Raised for an unknown model name, a model that does not fit the data, or unreadable weights."""


MODELS = ("mnist_cnn", "lenet", "hfedf_cnn", "resnet18", "resnet50", "resnet18_cifar")

FIXED_INPUT_SIZES = {"lenet": 28, "hfedf_cnn": 32, "resnet18_cifar": 32}
"""Models that take one image side only (pixels); a run that sets no ``image_size`` resizes its
images to it (LeNet on PACS reads the packed 32-px file resized to 28 px)."""


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    pretrained_weights: Path | None = None,
    mixstyle: bool = False,
) -> DomainClassifier:
    """Build a model by name: its featurizer and a linear classifier on top.

    Args:
        name: one of :data:`MODELS`.
        input_shape: ``(C, H, W)`` of the images.
        num_classes: outputs of the classifier; 1 for a regression head.
        pretrained_weights: for ``resnet18`` and ``resnet50`` only, a local torchvision ImageNet state-dict file
            (never downloaded).
        mixstyle: insert MixStyle layers (:func:`fedbed.models.mixstyle.insert_mixstyle`).

    Raises:
        ModelError: unknown name, a shape the model cannot take, or weights that do not load.
    """
    channels, height, width = input_shape
    if name == "mnist_cnn":
        featurizer, dim = MnistCnn(channels), MnistCnn.feature_dim
    elif name == "lenet":
        if (height, width) != (28, 28):
            raise ModelError(f"lenet takes 28x28 images, got {height}x{width}")
        featurizer, dim = LeNet(channels), LeNet.feature_dim
    elif name == "hfedf_cnn":
        if (height, width) != (32, 32):
            raise ModelError(f"hfedf_cnn takes 32x32 images (hFedF Table 9), got {height}x{width}; set image_size: 32 in the --config file")
        featurizer, dim = HfedfCnn(channels), HfedfCnn.feature_dim
    elif name == "resnet18_cifar":
        if (height, width) != (32, 32):
            raise ModelError(f"resnet18_cifar takes 32x32 images (its 4x4 pooling, FedGaLA App. B.2), got {height}x{width}; "
                             "set image_size: 32 in the --config file")
        featurizer, dim = _cifar_resnet18(channels)
    elif name in ("resnet18", "resnet50"):
        featurizer, dim = _resnet(int(name[6:]), channels, pretrained_weights)
    else:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if pretrained_weights is not None and name not in ("resnet18", "resnet50"):
        raise ModelError(f"pretrained weights are supported for resnet18/resnet50 only, not {name}")
    if mixstyle:
        try:
            featurizer = insert_mixstyle(name, featurizer)
        except ValueError as error:
            raise ModelError(f"{error}; choose one of those models or set mixstyle: false in the --config "
                             f"file (a method's paper settings may turn it on: see `fedbed algorithms`)") from None
    return DomainClassifier(featurizer, nn.Linear(dim, num_classes), dim)
