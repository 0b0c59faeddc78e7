import pytest
import torch

from fedbed.models import ModelError, build_model
from fedbed.models.networks import HfedfCnn, InceptionModule


@pytest.mark.parametrize(
    "name, shape, feature_dim",
    [("mnist_cnn", (1, 28, 28), 128), ("lenet", (1, 28, 28), 84), ("hfedf_cnn", (3, 32, 32), 256), ("resnet18", (3, 32, 32), 512)],
)
def test_models_expose_featurizer_and_classifier(name, shape, feature_dim):
    model = build_model(name, shape, num_classes=7)
    images = torch.randn(2, *shape)
    features = model.featurizer(images)
    assert features.shape == (2, feature_dim) == (2, model.feature_dim)
    assert model.classifier(features).shape == (2, 7)
    assert torch.allclose(model.eval()(images), model.classifier(model.featurizer(images)))


def test_hfedf_cnn_matches_table_9_widths():
    first = InceptionModule(64)
    assert first.out_channels == 176 and InceptionModule(176).out_channels == 288
    layers = HfedfCnn().layers
    flat = layers[:13](torch.zeros(1, 3, 32, 32))
    assert flat.shape == (1, 2592)


@pytest.mark.parametrize("kernel_size, stride, padding, shape", [
    (2, 2, 0, (5, 64, 16, 16)),   # hFedF's CNN's stem
    (3, 1, 1, (5, 176, 8, 8)),    # hFedF's Inception pooling branch: overlapping windows
    (3, 2, 1, (5, 64, 15, 15)),   # an odd size, windows over the padding
])
def test_the_channels_last_max_pool_gives_torchs_values_and_gradients_bit_for_bit(kernel_size, stride, padding, shape):
    """On ReLU outputs rounded to one decimal (windows full of tied maxima, zeros above all), the
    layer's output, the gradient it passes back (a non-leaf's, contiguous, summed over
    overlapping windows), an upstream convolution's weight gradient and ``torch.func``'s
    gradient and vmap equal :class:`torch.nn.MaxPool2d`'s exactly; inputs it does not take (3-D,
    channels-last, ``return_indices``) go through torch's own path."""
    from fedbed.models.networks import MaxPool2d

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(*shape, generator=generator).relu().round(decimals=1)
    convolution = torch.nn.Conv2d(shape[1], shape[1], 3, padding=1)
    weights = torch.randn(torch.nn.functional.max_pool2d(images, kernel_size, stride, padding).shape,
                          generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (torch.nn.MaxPool2d(kernel_size, stride, padding), MaxPool2d(kernel_size, stride, padding)):
        convolution.zero_grad()
        features = convolution(images).relu()
        features = features + (features.round(decimals=1) - features).detach() + images  # rounded: ties; gradient: 1
        pooled = layer(features)
        (passed_back,) = torch.autograd.grad(pooled, features, weights, retain_graph=True)
        (pooled * weights).sum().backward()
        assert convolution.weight.grad.abs().sum() > 0 and passed_back.is_contiguous() and pooled.is_contiguous()
        function_gradient = torch.func.grad(lambda x: (layer(x) * weights).sum())(images)
        batched = torch.func.vmap(layer)(images.unsqueeze(1))
        results.append((pooled, passed_back, convolution.weight.grad.clone(), function_gradient, batched))
    for torchs, ours in zip(*results):
        assert torchs.stride() == ours.stride() and torch.equal(torchs, ours)
    layer = MaxPool2d(kernel_size, stride, padding)
    assert torch.equal(layer(images[0]), torch.nn.functional.max_pool2d(images[0], kernel_size, stride, padding))
    channels_last = images.contiguous(memory_format=torch.channels_last)
    assert torch.equal(layer(channels_last), torch.nn.functional.max_pool2d(images, kernel_size, stride, padding))
    with_indices = MaxPool2d(kernel_size, stride, padding, return_indices=True)(images)
    assert torch.equal(with_indices[1], torch.nn.functional.max_pool2d(images, kernel_size, stride, padding,
                                                                        return_indices=True)[1])
    one_by_one = torch.rand(2, 3, kernel_size, kernel_size)  # a 1 x 1 output plane keeps the default strides
    assert MaxPool2d(kernel_size, kernel_size)(one_by_one).stride() == torch.nn.MaxPool2d(kernel_size)(one_by_one).stride()


def test_resnet_weights_only_from_a_local_file(tmp_path):
    reference = build_model("resnet18", (3, 32, 32), 2)
    state = {k.removeprefix("featurizer."): v for k, v in reference.state_dict().items() if k.startswith("featurizer.")}
    state["fc.weight"], state["fc.bias"] = torch.zeros(1000, 512), torch.zeros(1000)
    torch.save(state, tmp_path / "resnet18.pth")
    loaded = build_model("resnet18", (3, 32, 32), 2, pretrained_weights=tmp_path / "resnet18.pth")
    assert torch.equal(loaded.featurizer.conv1.weight, reference.featurizer.conv1.weight)
    with pytest.raises(ModelError, match="does not exist"):
        build_model("resnet18", (3, 32, 32), 2, pretrained_weights=tmp_path / "missing.pth")


def test_model_errors():
    with pytest.raises(ModelError, match="unknown model"):
        build_model("vgg", (3, 32, 32), 2)
    with pytest.raises(ModelError, match="32x32"):
        build_model("hfedf_cnn", (3, 64, 64), 2)


def test_kd3a_cnn_has_kd3as_layers():
    """KD3A's Digit-5 CNN (model/digit5.py): 5x5 convolutions of 64, 64, 128 channels, 8192 flattened
    features at 32 px, linear 3072 then 2048 features; 32x32 inputs only."""
    import torch
    from torch import nn

    from fedbed.models import ModelError, build_model

    model = build_model("kd3a_cnn", (3, 32, 32), 10)
    convolutions = [m for m in model.featurizer.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.featurizer.modules() if isinstance(m, nn.Linear)]
    assert [(c.out_channels, c.kernel_size) for c in convolutions] == [(64, (5, 5)), (64, (5, 5)), (128, (5, 5))]
    assert [(m.in_features, m.out_features) for m in linears] == [(8192, 3072), (3072, 2048)]
    assert model.feature_dim == 2048 and model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ModelError, match="32x32"):
        build_model("kd3a_cnn", (3, 28, 28), 10)
