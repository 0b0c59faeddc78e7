"""Model architectures. Every model is a :class:`DomainClassifier`: a featurizer and a classifier."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fedbed.models.backbones import (  # ModelError lives there, below the networks that raise it
    TIMM_PREFIX,
    ModelError,
    load_torchvision_imagenet,
    pretrained_refusal,
    timm_architecture,
    timm_featurizer,
    timm_refusal,
)
from fedbed.models.mixstyle import insert_mixstyle


HEAD_PREFIX = "classifier."
"""State-dict prefix of the classifier head of a :class:`DomainClassifier` (MCGDM's heads, FedIIR's
classifier gradient)."""


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


class DomainBedFeaturizer(nn.Module):
    """A featurizer with DomainBed's ResNet conventions (Gulrajani & Lopez-Paz 2021,
    ``networks.ResNet``): dropout on its features, before the classifier (``resnet_dropout``), and
    frozen BatchNorm statistics (``freeze_bn``): its BatchNorm layers stay in evaluation mode
    whenever it is set to train (:meth:`train`, which ``model.train()`` reaches through every
    module holding it), so training neither uses batch statistics nor updates the running ones;
    their affine weights still train.

    Args:
        network: the featurizer, ``[B, C, H, W]`` -> ``[B, feature_dim]``.
        dropout: the dropout probability on its features (0: none).
        freeze_batchnorm: keep its BatchNorm layers in evaluation mode.
    """

    def __init__(self, network: nn.Module, dropout: float = 0.0, freeze_batchnorm: bool = False) -> None:
        super().__init__()
        self.network = network
        self.dropout = nn.Dropout(dropout)
        self.freeze_batchnorm = freeze_batchnorm
        self.train(self.training)

    def train(self, mode: bool = True) -> "DomainBedFeaturizer":
        """Set the training mode, BatchNorm layers kept in evaluation mode if frozen."""
        super().train(mode)
        if self.freeze_batchnorm:
            for module in batchnorm_layers(self.network):
                module.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.network(images))


def batchnorm_layers(module: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of ``module`` (any dimension, and subclasses such as timm's ``BatchNormAct2d``)."""
    return [each for each in module.modules() if isinstance(each, nn.modules.batchnorm._BatchNorm)]


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


class _ChannelsLastMaxPool(torch.autograd.Function):
    """2-D max-pooling whose forward runs torch's channels-last kernel and whose backward is
    torch's own (the default-layout kernel, with the forward's indices): :class:`MaxPool2d`'s.
    Written with ``setup_context`` and a ``vmap`` rule (torch's default-layout kernel over the
    batch of batches), so ``torch.func``'s ``grad``, ``vjp`` and ``vmap`` take it (forward-mode AD
    and TorchScript do not; FedBed uses neither)."""

    @staticmethod
    def forward(images: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int],
                dilation: list[int], ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, indices = torch.ops.aten.max_pool2d_with_indices(images.contiguous(memory_format=torch.channels_last),
                                                                 kernel_size, stride, padding, dilation, ceil_mode)
        # copied into the default layout, with its strides even where a 1 x 1 plane would let
        # .contiguous() keep the channels-last ones
        return torch.empty_like(pooled, memory_format=torch.contiguous_format).copy_(pooled), indices

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, *settings = inputs
        ctx.save_for_backward(images, output[1])
        ctx.settings = settings
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _indices_grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        images, indices = ctx.saved_tensors
        grad_images = torch.ops.aten.max_pool2d_with_indices_backward(grad, images, *ctx.settings, indices)
        return grad_images, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims: tuple, images: torch.Tensor, *settings) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
        """Under ``torch.func.vmap``: the ``[V, B, C, H, W]`` batch folded into ``[V * B, C, H, W]``
        and pooled by torch's default-layout kernel (channels-last is not available inside vmap)."""
        images = images.movedim(in_dims[0], 0) if in_dims[0] is not None else images.expand(info.batch_size, *images.shape)
        pooled, indices = torch.ops.aten.max_pool2d_with_indices(images.flatten(0, 1), *settings)
        return (pooled.unflatten(0, images.shape[:2]), indices.unflatten(0, images.shape[:2])), (0, 0)


class MaxPool2d(nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` with the same outputs and gradients, bit for bit, its forward
    pass computed on the CPU by torch's channels-last kernel. On hFedF's CNN's planes (32 x 32 to
    8 x 8, 32-176 channels) torch's CPU ``max_pool2d_with_indices``, the training path, takes up
    to several times as long in the default layout as in channels-last, and its four max-pools
    took about a fifth of that CNN's training time (``benchmarks/max_pool_layout.py`` prints each
    layer's time and the training step's both ways). The output is in the default layout, so the layers around it, and their bits, are those
    of :class:`torch.nn.MaxPool2d`'s models. A maximum is exact, both kernels scan a window in
    the same order and keep its first maximum (a NaN: its last), and the indices are positions in
    the plane whatever the layout, so the backward pass, torch's own, gets the same indices
    (``tests/test_models.py`` checks values, indices and gradients on inputs full of ties). Other
    inputs (``return_indices``, not 4-D, not on the CPU, not floating-point, not contiguous in
    the default layout) take :class:`torch.nn.MaxPool2d`'s path.

    Shapes: ``[B, C, H, W]`` -> ``[B, C, H', W']`` as :class:`torch.nn.MaxPool2d`.
    """

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if (self.return_indices or images.dim() != 4 or not images.is_cpu or not images.is_floating_point()
                or not images.is_contiguous()):
            return super().forward(images)

        def pair(value: int | tuple[int, ...]) -> list[int]:
            return [value, value] if isinstance(value, int) else list(value)

        pooled, _ = _ChannelsLastMaxPool.apply(images, pair(self.kernel_size), pair(self.stride), pair(self.padding),
                                               pair(self.dilation), self.ceil_mode)
        return pooled


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
        self.branch_pool = MaxPool2d(3, stride=1, padding=1)
        self.out_channels = in_channels + one + three + five

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch_1x1(x), self.branch_3x3(x), self.branch_5x5(x), self.branch_pool(x)], dim=1)


class Kd3aCnn(nn.Module):
    """The three-layer CNN of KD3A (Feng et al., ICML 2021) for Digit-5, MCGDM's backbone for its
    federated domain adaptation experiments (``mcgdm.md``, Implementation Details: "the three-layer
    CNN as the backbone for Digit-5 ... following the setting of previous work KD3A").

    Three stages conv5x5 (stride 1, padding 2) -> BatchNorm -> ReLU with 64, 64 and 128 channels,
    the first two followed by a 3x3 max-pool of stride 2 (padding 1), then flatten (128 x 8 x 8 =
    8192) -> linear 3072 -> BatchNorm -> ReLU -> dropout 0.5 -> linear 2048 -> BatchNorm -> ReLU:
    ``[B, C, 32, 32]`` -> ``[B, 2048]`` (KD3A's public code, ``model/digit5.py``, ``CNN``; its
    ``Classifier``, one linear layer 2048 -> 10, is the classifier of :func:`build_model`).
    """

    feature_dim = 2048

    def __init__(self, in_channels: int = 3) -> None:
        super().__init__()

        def stage(inputs: int, outputs: int) -> list[nn.Module]:
            return [nn.Conv2d(inputs, outputs, 5, stride=1, padding=2), nn.BatchNorm2d(outputs), nn.ReLU()]

        self.layers = nn.Sequential(
            *stage(in_channels, 64), nn.MaxPool2d(3, stride=2, padding=1),
            *stage(64, 64), nn.MaxPool2d(3, stride=2, padding=1),
            *stage(64, 128),
            nn.Flatten(),
            nn.Linear(128 * 8 * 8, 3072), nn.BatchNorm1d(3072), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(3072, self.feature_dim), nn.BatchNorm1d(self.feature_dim), nn.ReLU(),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


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
            MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(32, 32, 1),
            nn.Conv2d(32, 64, 3, padding=1),
            MaxPool2d(2),
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


def _resnet(depth: int, in_channels: int, weights_path: Path | None, pretrained: str | None = None) -> tuple[nn.Module, int]:
    """torchvision's ResNet-18/50 without its last layer; ImageNet weights from a local file
    (``weights_path``) or, with ``pretrained``, through torchvision's weights API from the torch hub
    cache (:func:`fedbed.models.backbones.load_torchvision_imagenet`, under the offline rule)."""
    from torchvision.models import resnet18, resnet50

    network = (resnet18 if depth == 18 else resnet50)(weights=None)
    if pretrained is not None:
        load_torchvision_imagenet(network, f"resnet{depth}")
    if weights_path is not None:
        if not Path(weights_path).is_file():
            raise ModelError(f"pretrained weights file {weights_path} does not exist; give a local torchvision state dict")
        try:
            # Tensors stay where they were saved (weights are saved from the host's memory).
            state = torch.load(weights_path, map_location=lambda storage, _: storage, weights_only=True)
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


MODELS = ("mnist_cnn", "lenet", "hfedf_cnn", "kd3a_cnn", "resnet18", "resnet50", "resnet18_cifar")
"""The built-in models; any timm model is also one by the name ``timm:NAME``
(:mod:`fedbed.models.backbones`, the extra ``fedbed[timm]``)."""

MODELS_WITHOUT_BATCHNORM = ("mnist_cnn", "lenet", "hfedf_cnn")
"""Built-in models with no BatchNorm layer to freeze."""

FIXED_INPUT_SIZES = {"lenet": 28, "hfedf_cnn": 32, "kd3a_cnn": 32, "resnet18_cifar": 32}
"""Models that take one image side only (pixels); a run that sets no ``image_size`` resizes its
images to it (LeNet on PACS reads the packed 32-px file resized to 28 px)."""


def model_refusal(name: str, pretrained: str | None = None, freeze_batchnorm: bool = False) -> str | None:
    """Why model ``name`` cannot be built on this machine with these options, in one line, or
    ``None``: an unknown name, a timm model without timm installed or unknown to it, ``pretrained``
    weights for a model that has none or that are not in the cache where downloads are not allowed
    (:func:`fedbed.models.backbones.pretrained_refusal`; never downloads), frozen BatchNorm on a
    built-in model without BatchNorm. The check of :func:`fedbed.config.validate`."""
    if name.startswith(TIMM_PREFIX):
        refusal = timm_refusal(name)
        if refusal is not None:
            return refusal
    elif name not in MODELS:
        return f"unknown model {name!r}; choose one of {', '.join(MODELS)}, or timm:NAME (a timm model, pip install \"fedbed[timm]\")"
    if pretrained is not None:
        refusal = pretrained_refusal(name, pretrained)
        if refusal is not None:
            return refusal
    if freeze_batchnorm and name in MODELS_WITHOUT_BATCHNORM:
        return f"freeze_batchnorm: {name} has no BatchNorm layer; leave freeze_batchnorm unset"
    return None


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    pretrained_weights: Path | None = None,
    mixstyle: bool = False,
    pretrained: str | None = None,
    freeze_batchnorm: bool = False,
    classifier_dropout: float = 0.0,
) -> DomainClassifier:
    """Build a model by name: its featurizer and a linear classifier on top.

    Args:
        name: one of :data:`MODELS`, or ``timm:NAME`` for timm's model ``NAME`` (built with
            ``num_classes=0``: its pooled features; :func:`fedbed.models.backbones.timm_featurizer`).
        input_shape: ``(C, H, W)`` of the images.
        num_classes: outputs of the classifier; 1 for a regression head.
        pretrained_weights: for ``resnet18``, ``resnet50`` and timm models, a local state-dict file
            of their ImageNet weights (never downloaded).
        mixstyle: insert MixStyle layers (:func:`fedbed.models.mixstyle.insert_mixstyle`).
        pretrained: ``imagenet``: ``resnet18``/``resnet50`` with torchvision's ImageNet weights,
            ``timm:NAME`` with timm's, from their caches (:mod:`fedbed.models.backbones`; downloaded
            only where ``FEDBED_ALLOW_DOWNLOADS=1``). Not with ``pretrained_weights``.
        freeze_batchnorm: keep the featurizer's BatchNorm layers in evaluation mode in training
            (DomainBed's ``freeze_bn``; :class:`DomainBedFeaturizer`).
        classifier_dropout: dropout on the features, before the classifier (DomainBed's
            ``resnet_dropout``; 0: none).

    Raises:
        ModelError: unknown name, a shape the model cannot take, weights that are not there or do
            not load, or options the model does not take.
    """
    if pretrained is not None and pretrained_weights is not None:
        raise ModelError("give pretrained or pretrained_weights, not both")
    refusal = model_refusal(name, pretrained, freeze_batchnorm)
    if refusal is not None:
        raise ModelError(refusal)
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
    elif name == "kd3a_cnn":
        if (height, width) != (32, 32):
            raise ModelError(f"kd3a_cnn takes 32x32 images (KD3A's Digit-5 CNN), got {height}x{width}; set image_size: 32")
        featurizer, dim = Kd3aCnn(channels), Kd3aCnn.feature_dim
    elif name == "resnet18_cifar":
        if (height, width) != (32, 32):
            raise ModelError(f"resnet18_cifar takes 32x32 images (its 4x4 pooling, FedGaLA App. B.2), got {height}x{width}; "
                             "set image_size: 32 in the --config file")
        featurizer, dim = _cifar_resnet18(channels)
    elif name in ("resnet18", "resnet50"):
        featurizer, dim = _resnet(int(name[6:]), channels, pretrained_weights, pretrained)
    elif timm_architecture(name) is not None:
        featurizer, dim = timm_featurizer(name, input_shape, pretrained, pretrained_weights)
    else:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if pretrained_weights is not None and name not in ("resnet18", "resnet50") and not name.startswith(TIMM_PREFIX):
        raise ModelError(f"pretrained weights are supported for resnet18/resnet50 and timm models only, not {name}")
    if mixstyle:
        try:
            featurizer = insert_mixstyle(name, featurizer)
        except ValueError as error:
            raise ModelError(f"{error}; choose one of those models or set mixstyle: false in the --config "
                             f"file (a method's paper settings may turn it on: see `fedbed algorithms`)") from None
    if freeze_batchnorm and not batchnorm_layers(featurizer):
        raise ModelError(f"freeze_batchnorm: {name} has no BatchNorm layer; leave freeze_batchnorm unset")
    if freeze_batchnorm or classifier_dropout:
        featurizer = DomainBedFeaturizer(featurizer, classifier_dropout, freeze_batchnorm)
    return DomainClassifier(featurizer, nn.Linear(dim, num_classes), dim)
