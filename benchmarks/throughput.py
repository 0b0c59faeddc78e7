"""Throughput of a client's local training: images per second of one method's own trainer on a
device and in a precision, with the fraction of the device's peak FLOP/s where that peak is known.

The client trains as ``fedbed.build`` builds it (``algorithm.create_trainer(hparams,
AlgorithmContext(model_factory, budget, seed, device=..., precision=...))``, the model built by
``build_model`` and wrapped by ``algorithm.wrap_model``: a self-supervised method trains its
``SelfSupervisedModel``), the method's server half (its strategy) writing the payloads, on
synthetic ``uint8`` images (3 channels, ``--image-size`` pixels square, 7 classes; the speed does
not depend on their content). Clients: 3, one domain each (1 holding the 3 domains for a pooled
method). A warm-up round (round 1: ``--warmup-steps`` batches on every client, then the
strategy's aggregation, so that a method that reads the previous round, MCGDM's heads say, finds
it) comes first; then client 0's ``trainer.fit`` of round 2, ``--steps`` batches of
``--batch-size``, is timed (its reply is copied to the host, which waits for the device), the
median of ``--repeats`` fits from the same payload and client state. Every
batch the method draws counts (FedADG's schedule draws 10 per step of the budget); an image
counts once although a method may pass it twice (MCGDM's A(x), the two views of SimCLR).

FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` counts one forward pass of the protocol's
model (``build_model``, the matrix products and convolutions) per image; a training step is taken
as 3 forward passes (forward, and the backward's two products), the usual model-FLOPs count, so
the figure compares devices and precisions for one model, not methods' extra passes. The peak is
the vendor's for a known CUDA device (:data:`CUDA_PEAK_TFLOPS`); for a CPU (or an unknown GPU) no
peak is known and the script says "peak unknown" instead of inventing one.

    python benchmarks/throughput.py --device cpu --precision bf16 --model resnet18 --image-size 224 \\
        --method fedavg [--batch-size 16] [--steps 3] [--warmup-steps 1] [--repeats 1] [--threads 2] [--smoke]

``--smoke``: hfedf_cnn at 32 px, fedavg, batch 8, 2 timed steps, 1 warm-up step, on the CPU in
fp32, one timed fit (the command line's other options but ``--threads`` are ignored).
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from _common import parse_arguments
from torch.utils.flop_counter import FlopCounterMode

from fedbed.algorithms import (
    ALGORITHMS,
    AlgorithmContext,
    TrainingBudget,
    get_algorithm,
    resolve_hyperparameters,
)
from fedbed.federation.devices import (
    PRECISIONS,
    DeviceError,
    device_description,
    resolve_device,
)
from fedbed.federation.local_data import Batch, ClientData
from fedbed.federation.messages import ClientInfo
from fedbed.models import ModelError, build_model
from fedbed.seeding import derive_seed

CLASSES, CHANNELS, SEED, CLIENTS = 7, 3, 0, 3

CUDA_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # Dense peaks (without structured sparsity) in TFLOP/s, from the vendors' spec sheets:
    # - NVIDIA H100 Tensor Core GPU datasheet: H100 SXM FP32 67, TF32 989 / 2 (the sheet's figure is
    #   with sparsity), BF16 and FP16 1,979 / 2; H100 PCIe FP32 51, TF32 756 / 2, BF16 and FP16 1,513 / 2.
    # - NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe, 40 and 80 GB alike): FP32 19.5, TF32 156,
    #   BF16 and FP16 312.
    # - NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6, TF32 82.6, BF16 and FP16
    #   with FP32 accumulate (what autocast's products use) 165.2.
    # - NVIDIA Tesla V100 datasheet: V100 SXM2 FP32 15.7, tensor (FP16) 125; V100 PCIe FP32 14,
    #   FP16 112; V100S PCIe FP32 16.4, FP16 130. V100 has no bf16 or TF32 units: no peak for them.
    # The patterns match torch.cuda.get_device_name (e.g. "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB
    # HBM3", "NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"), first match wins.
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (r"H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"V100S", {"fp32": 16.4, "fp16": 130.0}),
    (r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
)
"""Known CUDA devices' peak FLOP/s (TFLOP/s) by precision: a name pattern and its peaks."""


def cuda_peak(device_name: str, precision: str) -> float | None:
    """The peak TFLOP/s of a CUDA device named ``device_name`` in ``precision`` (``tf32`` for
    fp32 products on tensor cores), or ``None`` where it is not in :data:`CUDA_PEAK_TFLOPS`."""
    for pattern, peaks in CUDA_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(precision)
    return None


def forward_flops_per_image(model_name: str, image_size: int) -> float:
    """FLOPs of one forward pass of ``model_name`` per image (FlopCounterMode over a batch of 2)."""
    model = build_model(model_name, (CHANNELS, image_size, image_size), CLASSES)
    model.eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.zeros(2, CHANNELS, image_size, image_size))
    return counter.get_total_flops() / 2


@contextmanager
def counted_batches() -> Iterator[list[int]]:
    """Within the block, the sizes of the batches the trainers draw (every training batch comes
    from :meth:`ClientData.batches`, through
    :func:`fedbed.algorithms.base.local_training.run_batches`), so that a method whose schedule
    draws more batches than its budget's steps (FedADG) is counted as it runs."""
    sizes: list[int] = []
    original = ClientData.batches

    def batches(data: ClientData, *arguments, **options) -> Iterator[Batch]:
        for batch in original(data, *arguments, **options):
            sizes.append(int(batch.targets.shape[0]))
            yield batch

    ClientData.batches = batches  # type: ignore[method-assign]
    try:
        yield sizes
    finally:
        ClientData.batches = original  # type: ignore[method-assign]


def synthetic_clients(count: int, pooled: bool, per_client: int, image_size: int) -> list[ClientData]:
    """``count`` clients of ``per_client`` random uint8 images each (one domain each, or one client
    of every domain for a pooled method), random labels of :data:`CLASSES` classes."""
    generator = torch.Generator().manual_seed(SEED)
    clients = []
    for client in range(count):
        images = torch.randint(0, 256, (per_client, CHANNELS, image_size, image_size), dtype=torch.uint8,
                               generator=generator)
        targets = torch.randint(0, CLASSES, (per_client,), generator=generator)
        domains = (torch.arange(per_client) % CLIENTS if pooled else torch.full((per_client,), client)).long()
        clients.append(ClientData(images, targets, domains))
    return clients


def main(arguments: list[str] | None = None) -> None:
    """Parse ``arguments`` (the command line's when ``None``), time the fit, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps (default cpu)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--model", default="hfedf_cnn")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--method", choices=sorted(ALGORITHMS), default="fedavg")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="batches of the timed fit (the budget's local_steps)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="batches of each client's warm-up fit (round 1)")
    parser.add_argument("--repeats", type=int, default=1, help="timed fits; their median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    args = parse_arguments(parser, arguments, smoke="on the CPU in fp32", device="cpu", precision="fp32",
                           model="hfedf_cnn", image_size=32, method="fedavg", batch_size=8, steps=2, warmup_steps=1,
                           repeats=1)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        sys.exit(f"throughput: {error}")
    algorithm = get_algorithm(args.method)
    if args.precision not in algorithm.precisions:
        sys.exit(f"throughput: {algorithm.name} trains in {', '.join(algorithm.precisions)} only, not {args.precision}")
    hparams = resolve_hyperparameters(algorithm, {})
    shape = (CHANNELS, args.image_size, args.image_size)
    try:
        build_model(args.model, shape, CLASSES)
    except ModelError as error:
        sys.exit(f"throughput: {error}")

    def model_factory():
        return algorithm.wrap_model(build_model(args.model, shape, CLASSES), hparams)

    def trainer(steps: int):
        context = AlgorithmContext(model_factory, TrainingBudget(args.batch_size, local_steps=steps), SEED,
                                   device=device, precision=args.precision)
        return algorithm.create_trainer(hparams, context)

    count = 1 if algorithm.pooled else CLIENTS
    # up to 8 full batches per client: a longer fit draws them again, in a new order each pass
    data = synthetic_clients(count, algorithm.pooled, args.batch_size * min(max(args.steps, args.warmup_steps), 8),
                             args.image_size)
    torch.manual_seed(SEED)
    strategy = algorithm.create_strategy(hparams, AlgorithmContext(model_factory, TrainingBudget(args.batch_size,
                                         local_steps=args.steps), SEED, device=device, precision=args.precision))
    strategy.initialize(model_factory(), [ClientInfo(client, len(data[client]),
                                                     tuple(range(CLIENTS)) if algorithm.pooled else (client,))
                                          for client in range(count)])
    states: list[dict] = [{} for _ in range(count)]

    def payloads(round_number: int):
        configured = strategy.configure_round(round_number, list(range(count)))
        for client, payload in configured.items():
            payload.config.update({"round": round_number, "rounds": 2, "client": client,
                                   "batch_seed": derive_seed(SEED, round_number, client)})
        return configured

    warm = trainer(args.warmup_steps)
    replies = {}
    for client, payload in payloads(1).items():
        torch.manual_seed(int(payload.config["batch_seed"]))
        replies[client] = warm.fit(payload, data[client], states[client])
    strategy.aggregate(1, replies)

    timed = trainer(args.steps)
    payload = payloads(2)[0]
    times, counts = [], []
    for _ in range(max(args.repeats, 1)):
        state = copy.deepcopy(states[0])
        torch.manual_seed(int(payload.config["batch_seed"]))
        with counted_batches() as sizes:
            began = time.perf_counter()
            timed.fit(payload, data[0], state)  # the reply's arrays are copied to the host: the device has finished
            times.append(time.perf_counter() - began)
        counts.append((sum(sizes), len(sizes)))
    seconds = statistics.median(times)
    images, batches = counts[0]
    rate = images / seconds

    description = device_description(device)
    flops = forward_flops_per_image(args.model, args.image_size)
    achieved = 3 * flops * rate
    print(f"torch {torch.__version__}, device {description['device']} ({description['device_name']}), "
          f"precision {args.precision}, {torch.get_num_threads()} torch threads")
    print(f"{algorithm.name}, {args.model} at {args.image_size} px, batch {args.batch_size}: one warm-up round of "
          f"{args.warmup_steps} step(s) on each of {count} client(s), then client 0's fit of round 2 timed: "
          f"{batches} batches, {images} images, median of {len(times)}: {seconds:.3f} s "
          f"({', '.join(f'{value:.3f}' for value in times)})")
    print(f"forward FLOPs per image: {flops / 1e9:.4f} GFLOP (FlopCounterMode); a training step counted as 3x forward")
    print(f"seconds per step: {seconds / batches:.4f}")
    print(f"model FLOP/s: {achieved / 1e12:.3g} TFLOP/s")
    peak = cuda_peak(description["device_name"], args.precision) if device.type == "cuda" else None
    if peak is None:
        print(f"fraction of peak: peak unknown (no peak FLOP/s known for {description['device_name']} "
              f"in {args.precision})")
    else:
        print(f"fraction of peak: {achieved / (peak * 1e12):.3f} of {peak:g} TFLOP/s "
              f"({description['device_name']} {args.precision}, vendor spec sheet, dense)")
        tf32 = cuda_peak(description["device_name"], "tf32")
        if args.precision == "fp32" and torch.backends.cudnn.allow_tf32 and tf32 is not None:
            print(f"  cuDNN's convolutions use TF32 (torch.backends.cudnn.allow_tf32): "
                  f"{achieved / (tf32 * 1e12):.3f} of the TF32 peak, {tf32:g} TFLOP/s")
    print(f"images per second: {rate:.1f}")


if __name__ == "__main__":
    main()
