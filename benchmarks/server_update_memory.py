"""Server memory of measuring a round's client updates: the engine's Gram matrix against stacked updates.

Every round the engine checks the replies' update norms and logs how the updates agree
(``fedbed.federation.engine.client_update_gram``); both read only inner products of the updates,
so the engine accumulates their K x K Gram matrix one array at a time and never holds the K
updates ``[K, P]`` at once (it did until 2026-11-27; the rules that combine updates, such as
PPDG, PCGrad and FedOMG, need them as a matrix: ``fedbed.federation.arrays.stacked_updates``). This script
builds K replies of a model (its initial weights plus noise, as after local training), then
measures, in this process, the peak memory each way adds above what the replies already take:

- the engine's way: ``client_update_gram`` (float64, K + 1 copies of the largest array at a time);
- stacked: the float64 ``[K, P]`` updates stacked from a list of rows, and their norms, as the
  engine computed them before (the list and the stack are held at once);
- an update rule's ``[K, P]``: ``fedbed.federation.arrays.stacked_updates``, written array by array,
  as ``base.update_aggregation`` and differential privacy's clipping build it.

Peak memory is Linux's ``VmHWM`` of ``/proc/self/status``, reset before each measurement by
writing 5 to ``/proc/self/clear_refs`` (Linux only: the script exits 1 elsewhere). It prints the
model's size, both peaks, the largest difference between the two ways' update norms (relative;
the script exits 1 above 1e-9) and, last, the figure: stacked / Gram.

    python benchmarks/server_update_memory.py [--model resnet50] [--clients 10] [--image-size 224]

``--smoke``: LeNet on 28-px single-channel input, 3 clients.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _common import parse_arguments

from fedbed.federation.alignment import norms_from_gram
from fedbed.federation.arrays import flatten, floating_keys, stacked_updates
from fedbed.federation.engine import client_update_gram
from fedbed.federation.messages import Payload, Reply
from fedbed.models import MODELS, build_model

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
MiB = 2**20


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmHWM``: peak resident memory, ``VmRSS``: now)."""
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1])


def peak_added_mib(measure) -> tuple[float, object]:
    """MiB by which the peak resident memory while ``measure()`` runs exceeds the resident memory
    before it (the peak reset first), and what ``measure`` returned."""
    CLEAR_REFS.write_text("5")
    before = status_kib("VmRSS")
    result = measure()
    return (status_kib("VmHWM") - before) * 1024 / MiB, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS), help="the model whose replies are measured")
    parser.add_argument("--clients", type=int, default=10, help="K, the round's replies")
    parser.add_argument("--image-size", type=int, default=224, help="input side in pixels (RGB, 7 classes: PACS)")
    args = parse_arguments(parser, smoke="LeNet on 28-px single-channel input (10 classes)", model="lenet",
                           clients=3, image_size=28)
    if not (STATUS.exists() and CLEAR_REFS.exists()):
        print("this benchmark reads Linux's /proc/self/status and /proc/self/clear_refs, which this system lacks",
              file=sys.stderr)
        return 1
    input_shape, classes = ((1, args.image_size, args.image_size), 10) if args.smoke else ((3, args.image_size, args.image_size), 7)
    torch.manual_seed(0)
    sent = {name: value.detach().clone() for name, value in build_model(args.model, input_shape, classes).state_dict().items()}
    keys = floating_keys(sent, sent)
    replies = {client: Reply({name: value + 1e-3 * torch.randn_like(value) if name in keys else value.clone()
                              for name, value in sent.items()}, num_examples=1) for client in range(args.clients)}
    payloads = {client: Payload(sent) for client in range(args.clients)}
    parameters, largest = sum(sent[key].numel() for key in keys), max(sent[key].numel() for key in keys)
    print(f"{args.model}: {parameters:,} floating-point values in {len(keys)} arrays, the largest {largest:,}; "
          f"K = {args.clients} replies of {parameters * 4 / MiB:.1f} MiB each")

    gram_mib, (_, gram) = peak_added_mib(lambda: client_update_gram(payloads, replies))

    def stacked_norms() -> torch.Tensor:
        updates = torch.stack([flatten(replies[c].arrays, keys) - flatten(sent, keys) for c in sorted(replies)])
        return updates.norm(dim=1)

    stacked_mib, norms = peak_added_mib(stacked_norms)
    start = flatten(sent, keys)
    rows_mib, _ = peak_added_mib(lambda: stacked_updates([replies[c].arrays for c in sorted(replies)], start, keys))
    deviation = float(((norms_from_gram(gram) - norms).abs() / norms).max())
    print(f"the engine's Gram matrix, array by array: peak {gram_mib:+.1f} MiB "
          f"(K + 1 copies of the largest array in float64: {(args.clients + 1) * largest * 8 / MiB:.1f} MiB)")
    print(f"the updates stacked as float64 [K, P], then their norms: peak {stacked_mib:+.1f} MiB "
          f"(K x P in float64: {args.clients * parameters * 8 / MiB:.1f} MiB)")
    print(f"an update rule's float64 [K, P], written array by array (arrays.stacked_updates): peak {rows_mib:+.1f} MiB")
    print(f"update norms, largest relative difference between the two ways: {deviation:.2e}")
    if not deviation <= 1e-9:
        print("the two ways disagree on the update norms", file=sys.stderr)
        return 1
    print(f"peak memory stacked / Gram: {stacked_mib / max(gram_mib, 1 / 1024):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
