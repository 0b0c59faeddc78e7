"""Pretrained backbones from the ecosystem's own sources: torchvision's ImageNet weights through
its weights API and the torch hub cache, and timm's models by name (``timm:NAME``, the optional
extra ``pip install "fedbed[timm]"``) with timm's own pretrained loading.

The offline rule: FedBed downloads weights only where ``FEDBED_ALLOW_DOWNLOADS=1``. Without it a
run with ``pretrained: imagenet`` whose weights are not in the cache is refused at validation,
with one line naming the cache folder, the file expected there and the alternative
(``pretrained_weights: PATH``, a local file); the same rule is checked again where a model is
built (a Flower site that did not validate the run itself). With it, validation passes and the
first model built on a connected machine downloads the weights into the cache (torchvision's and
timm's own download), where later runs find them.

Caches: torchvision's ResNets read ``torch.hub.get_dir()/checkpoints/<file>`` (``TORCH_HOME``,
default ``~/.cache/torch``), the file named by the last part of the weights' URL
(``resnet18-f37072fd.pth``). timm reads its Hugging Face Hub repository from the Hugging Face
cache (``HF_HOME``/``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``), or for models whose
weights have no Hub repository the torch hub folder as torchvision does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

TIMM_PREFIX = "timm:"
"""Model names ``timm:NAME`` are timm's models (``timm.list_models()``; a pretrained tag as in
``timm:resnet18.a1_in1k`` is allowed), built without their classifier."""

ALLOW_DOWNLOADS = "FEDBED_ALLOW_DOWNLOADS"
"""The environment variable that lets FedBed download pretrained weights (value ``1``)."""

PRETRAINED_SOURCES = ("imagenet",)
"""Values of the ``pretrained`` setting."""

TORCHVISION_PRETRAINED = ("resnet18", "resnet50")
"""Built-in models with torchvision ImageNet weights."""

TIMM_INSTALL = 'pip install "fedbed[timm]"'


class ModelError(ValueError):
    """Raised for an unknown model name, a model that does not fit the data, or unreadable weights
    (also :class:`fedbed.models.networks.ModelError`)."""


def downloads_allowed() -> bool:
    """Whether ``FEDBED_ALLOW_DOWNLOADS=1`` is set."""
    return os.environ.get(ALLOW_DOWNLOADS, "").strip() == "1"


def timm_architecture(name: str) -> str | None:
    """``NAME`` of a model name ``timm:NAME``, else ``None``."""
    return name[len(TIMM_PREFIX):] if name.startswith(TIMM_PREFIX) else None


def torchvision_weights(name: str) -> Any:
    """torchvision's ImageNet-1k weights of ``resnet18`` or ``resnet50``: ``IMAGENET1K_V1``, the
    weights of torchvision's former ``pretrained=True`` that DomainBed's ResNets load."""
    from torchvision.models import ResNet18_Weights, ResNet50_Weights

    return ResNet18_Weights.IMAGENET1K_V1 if name == "resnet18" else ResNet50_Weights.IMAGENET1K_V1


def torch_hub_file(url: str) -> Path:
    """Where ``torch.hub.load_state_dict_from_url`` keeps ``url``'s file: the hub folder's
    ``checkpoints``, under the last part of the URL's path."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def _missing(what: str, where: str, how: str = "copy the file there from a machine that has it") -> str:
    return (f"pretrained: imagenet needs {what} in {where}, which this machine does not hold, and FedBed downloads "
            f"weights only with {ALLOW_DOWNLOADS}=1: {how}, set "
            f"{ALLOW_DOWNLOADS}=1 on a machine with internet, or give a local state dict with pretrained_weights: PATH "
            "instead of pretrained")


def timm_refusal(name: str) -> str | None:
    """Why model name ``timm:NAME`` cannot be built here (timm not installed, an unknown name), or ``None``."""
    architecture = timm_architecture(name) or ""
    try:
        import timm
    except ImportError:
        return f"model {name} is a timm model and timm is not installed: {TIMM_INSTALL}"
    if not architecture or not timm.is_model(architecture):
        return f"timm has no model {architecture!r} (timm.list_models() lists its names; model {name})"
    return None


def _timm_weights_location(architecture: str) -> tuple[str, str, Path | None, str] | None:
    """Where timm keeps ``architecture``'s pretrained weights: ``(what, folder, the cached file
    or None, how to bring it there)``, or ``None`` when timm has no weights for it. Follows
    timm's order: its Hugging Face Hub repository (``model.safetensors``, else
    ``pytorch_model.bin``, in the Hugging Face cache), else its URL's file in the torch hub folder."""
    import timm

    config = timm.models.get_pretrained_cfg(architecture)
    if config is None:
        return None
    if config.hf_hub_id:
        from huggingface_hub import constants, try_to_load_from_cache

        repository, _, revision = config.hf_hub_id.partition("@")
        names = [config.hf_hub_filename] if config.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        found = [try_to_load_from_cache(repository, file, revision=revision or None) for file in names]
        cached = next((Path(each) for each in found if isinstance(each, str)), None)
        folder = Path(constants.HF_HUB_CACHE) / f"models--{repository.replace('/', '--')}"
        return (f"timm's {architecture} weights ({repository}, {names[0]})", str(folder), cached,
                "copy that folder from the Hugging Face cache of a machine that has it")
    if config.url:
        file = torch_hub_file(config.url)
        return (f"timm's {architecture} weights {file.name}", str(file.parent), file if file.is_file() else None,
                "copy the file there from a machine that has it")
    return None


def pretrained_refusal(name: str, pretrained: str) -> str | None:
    """Why ``pretrained`` weights for model ``name`` cannot be had on this machine without a
    download FedBed may not make (the module's offline rule), or ``None``. Never downloads.

    ``resnet18``/``resnet50``: torchvision's file in the torch hub cache; ``timm:NAME``: timm's
    weights in its cache; any other model: no pretrained weights.
    """
    if pretrained not in PRETRAINED_SOURCES:
        return f"pretrained: {pretrained!r} is not one of {', '.join(PRETRAINED_SOURCES)}"
    if name in TORCHVISION_PRETRAINED:
        file = torch_hub_file(torchvision_weights(name).url)
        if file.is_file() or downloads_allowed():
            return None
        return _missing(f"torchvision's {name} weights {file.name}", str(file.parent))
    if timm_architecture(name) is not None:
        refusal = timm_refusal(name)
        if refusal is not None:
            return refusal
        location = _timm_weights_location(timm_architecture(name))
        if location is None:
            return f"timm has no pretrained weights for {timm_architecture(name)}; leave pretrained unset"
        what, folder, cached, how = location
        return None if cached is not None or downloads_allowed() else _missing(what, folder, how)
    return (f"pretrained: imagenet applies to {', '.join(TORCHVISION_PRETRAINED)} and timm:NAME models, not {name}; "
            "leave pretrained unset")


def load_torchvision_imagenet(network: nn.Module, name: str) -> None:
    """Load torchvision's ImageNet weights of ``name`` into ``network`` (its own architecture)
    through the weights API (``weights.get_state_dict``: the torch hub cache, downloaded there only
    where the offline rule allows)."""
    refusal = pretrained_refusal(name, "imagenet")
    if refusal is not None:
        raise ModelError(refusal)
    try:
        network.load_state_dict(torchvision_weights(name).get_state_dict(progress=False, check_hash=True))
    except (RuntimeError, OSError, KeyError, ValueError) as error:
        file = torch_hub_file(torchvision_weights(name).url)
        raise ModelError(f"cannot load torchvision's {name} weights from {file}: {str(error).splitlines()[0]}") from None


def timm_featurizer(name: str, input_shape: tuple[int, int, int], pretrained: str | None,
                    weights_path: Path | None) -> tuple[nn.Module, int]:
    """timm's model ``timm:NAME`` as a featurizer: built with ``num_classes=0`` (its pooled
    features, no classifier) for ``input_shape``'s channels (``in_chans``; timm adapts pretrained
    first-layer weights to them) and, for a model of fixed input size (ViTs), its image size
    (``img_size``; timm resamples pretrained position embeddings). Pretrained weights by timm's
    own loading: a local ``weights_path``, or with ``pretrained`` the file in timm's cache, read
    as a local file (no request to the Hub), else, where downloads are allowed, timm's download.

    Returns:
        The network and the width of its features (measured on one blank image).

    Raises:
        ModelError: timm missing, an unknown name, weights not allowed or not loadable, an input
            shape the model cannot take.
    """
    refusal = timm_refusal(name) or (pretrained_refusal(name, pretrained) if pretrained is not None else None)
    if refusal is not None:
        raise ModelError(refusal)
    import timm

    architecture = timm_architecture(name)
    channels, height, width = input_shape
    options: dict[str, Any] = {"num_classes": 0, "in_chans": channels}
    config = timm.models.get_pretrained_cfg(architecture)
    if config is not None and config.fixed_input_size:
        options["img_size"] = (height, width)
    if weights_path is not None:
        if not Path(weights_path).is_file():
            raise ModelError(f"pretrained weights file {weights_path} does not exist; give a local state dict of {architecture}")
        options["pretrained_cfg_overlay"] = {"file": str(weights_path)}
    elif pretrained is not None:
        location = _timm_weights_location(architecture)
        if location is not None and location[2] is not None:
            options["pretrained_cfg_overlay"] = {"file": str(location[2])}
    try:
        network = timm.create_model(architecture, pretrained=pretrained is not None or weights_path is not None, **options)
        network.eval()
        with torch.no_grad():
            features = network(torch.zeros(1, channels, height, width))
        network.train()
    except (RuntimeError, ValueError, TypeError, OSError, KeyError, AssertionError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelError(f"cannot build timm model {architecture} for images {channels}x{height}x{width}: {message}") from None
    if features.dim() != 2:
        raise ModelError(f"timm model {architecture} gives features of shape {tuple(features.shape[1:])}, not pooled "
                         "features; choose a classification model")
    return network, int(features.shape[1])
