"""Training-step time of hFedF's client CNN with torch's ``nn.MaxPool2d`` and with FedBed's
``fedbed.models.networks.MaxPool2d`` (the same values and gradients, computed by torch's
channels-last CPU kernels), and the time of each pooling layer alone.

hFedF's CNN (``hfedf_cnn``, PACS at 32 px) has four max-pools: two 2x2 ones in the stem (at
32 x 32 and 16 x 16) and a 3x3 stride-1 one in each Inception block (8 x 8). On the CPU, torch's
``max_pool2d_with_indices`` (the training path) is up to several times slower in the default
``[B, C, H, W]`` layout than in channels-last. The script builds the model twice from one seed,
swaps the pooling layers of one copy for ``nn.MaxPool2d``, and times forward + backward + Adam steps on the same random batch,
alternating the two, ``--repeats`` times; it prints the medians, then the ratio last. It also
checks that both copies end with equal parameters, bit for bit (each repeat draws the same
dropout masks for both).

    python benchmarks/max_pool_layout.py [--batch-size 64] [--steps 5] [--repeats 5] [--threads 1] [--smoke]

``--smoke``: batch 4, 1 step, 1 repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from _common import parse_arguments
from fedbed.models import build_model
from fedbed.models.networks import MaxPool2d

CLASSES = 7


def with_torchs_pooling(model: nn.Module) -> nn.Module:
    """``model`` with every :class:`fedbed.models.networks.MaxPool2d` replaced by a
    :class:`torch.nn.MaxPool2d` of the same settings (in place; returned)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MaxPool2d):
                setattr(parent, name, nn.MaxPool2d(child.kernel_size, child.stride, child.padding, child.dilation,
                                                   child.return_indices, child.ceil_mode))
    return model


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                steps: int) -> float:
    """Seconds per training step over ``steps`` steps."""
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return (time.perf_counter() - began) / steps


def layer_milliseconds(layer: nn.Module, shape: tuple[int, ...], repeats: int) -> float:
    """Median milliseconds of one forward and backward pass of ``layer`` on a ``shape`` batch of ReLU outputs."""
    inputs = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).relu().requires_grad_()
    times = []
    for _ in range(max(repeats, 1)):
        began = time.perf_counter()
        layer(inputs).sum().backward()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main(arguments: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    options = parse_arguments(parser, arguments, batch_size=4, steps=1, repeats=1)
    torch.set_num_threads(options.threads)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(options.batch_size, 3, 32, 32, generator=generator)
    labels = torch.randint(0, CLASSES, (options.batch_size,), generator=generator)
    models = {}
    for name in ("torch", "fedbed"):
        torch.manual_seed(0)
        model = build_model("hfedf_cnn", (3, 32, 32), CLASSES)
        models[name] = with_torchs_pooling(model) if name == "torch" else model
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=1e-3) for name, model in models.items()}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(options.repeats):
        for name, model in models.items():
            torch.manual_seed(repeat)  # the same dropout masks for both
            seconds[name].append(timed_steps(model, optimizers[name], images, labels, options.steps))
    equal = all(torch.equal(a, b) for a, b in zip(models["torch"].parameters(), models["fedbed"].parameters()))
    batch = options.batch_size
    print(f"hfedf_cnn, batch {batch}, {options.threads} thread(s), {options.steps} step(s) x {options.repeats} "
          f"repeat(s), alternating; parameters equal bit for bit after training: {equal}")
    for shape, kernel, stride, padding in (((batch, 32, 32, 32), 2, 2, 0), ((batch, 64, 16, 16), 2, 2, 0),
                                           ((batch, 64, 8, 8), 3, 1, 1), ((batch, 176, 8, 8), 3, 1, 1)):
        torchs = layer_milliseconds(nn.MaxPool2d(kernel, stride, padding), shape, options.repeats)
        ours = layer_milliseconds(MaxPool2d(kernel, stride, padding), shape, options.repeats)
        print(f"max-pool {kernel}x{kernel}/{stride} on {list(shape)}: torch {torchs:.2f} ms, FedBed {ours:.2f} ms "
              "(forward + backward)")
    for name in models:
        print(f"training step with {name}'s max-pool: {1000 * statistics.median(seconds[name]):.1f} ms")
    if not equal:
        raise SystemExit("the two models' parameters differ after training: the layers are not equivalent")
    print(f"step time torch / FedBed max-pool: {statistics.median(seconds['torch']) / statistics.median(seconds['fedbed']):.3f}")


if __name__ == "__main__":
    main()
