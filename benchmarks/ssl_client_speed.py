"""Speed of a self-supervised client: images per second of FedGaLA's SimCLR client (two views per
image, projector 4096 -> 2048, Adam, local alignment on) with hFedF's client CNN and with the
CIFAR-style ResNet-18 of FedGaLA App. B.2, on random 32 x 32 RGB images (the speed does not
depend on their content). One image counts once although both of its views pass the network.

    OMP_NUM_THREADS=1 python benchmarks/ssl_client_speed.py [--steps 3] [--batch-size 128] [--threads 1] [--smoke]

``--smoke``: one timed step of a batch of 8.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import parse_arguments

from fedbed.algorithms import get_algorithm
from fedbed.algorithms.base.registry import AlgorithmContext, TrainingBudget
from fedbed.federation.arrays import clone_arrays
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from fedbed.models import build_model


def images_per_second(model_name: str, steps: int, batch_size: int) -> float:
    """Train one FedGaLA client for ``steps`` batches (after one warm-up batch) and time it."""
    spec = get_algorithm("fedgala")
    hparams = spec.hyperparameters()
    factory = lambda: spec.wrap_model(build_model(model_name, (3, 32, 32), 7), hparams)  # noqa: E731
    torch.manual_seed(0)
    model = factory()
    generator = torch.Generator().manual_seed(0)
    count = batch_size * steps
    data = ClientData(torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator),
                      torch.zeros(count, dtype=torch.long), torch.zeros(count, dtype=torch.long))
    # a reference change so that local alignment does its per-layer test on every step
    reference = {f"reference/{name}": torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}
    arrays = clone_arrays(model.state_dict())
    warm = spec.create_trainer(hparams, AlgorithmContext(factory, TrainingBudget(batch_size, local_steps=1), seed=0))
    warm.fit(Payload(arrays, {"round": 2, "rounds": 2, "batch_seed": 1}, reference), data, {})
    trainer = spec.create_trainer(hparams, AlgorithmContext(factory, TrainingBudget(batch_size, local_steps=steps), seed=0))
    start = time.perf_counter()
    trainer.fit(Payload(arrays, {"round": 2, "rounds": 2, "batch_seed": 2}, reference), data, {})
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parse_arguments(parser, steps=1, batch_size=8)
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, batch {args.batch_size}, {args.steps} timed steps")
    for model_name in ("hfedf_cnn", "resnet18_cifar"):
        print(f"{model_name}: {images_per_second(model_name, args.steps, args.batch_size):.1f} images/s")


if __name__ == "__main__":
    main()
