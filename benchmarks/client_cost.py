"""A method's local training cost per image relative to FedAvg's, on the same client data.

One client (PACS-32's photo domain with hFedF's client CNN when ``--data-root`` holds
``pacs/pacs_32.npz``, else the 0-degree domain of the embedded RotatedMNIST sample with LeNet),
batch 16, one torch thread; each side is timed ``--repeats`` times, alternating, and the medians
are compared. FedAvg trains on the method's augmentation and on as many images:

- ``fedadg``: its schedule with ``local_steps: S`` as the unit (E0 = 3 units of classification,
  E1 = 7 of alignment: 10 S batches) against FedAvg's 10 S batches with JiGen augmentation
  (FedADG's extra work: G and D forward and backward passes, three optimisers);
- ``mcgdm``: S batches of Eq. 8 with three previous heads in the payload (a round after the
  first: L_intra and L_inter, each a double backward through the head's gradients) against
  FedAvg's S batches of RandAugment views (MCGDM's extra work: the second forward pass on A(x)
  and the gradient matching; the issue's goal is a ratio of at most 3).

Prints the ratio last.

    python benchmarks/client_cost.py --method mcgdm [--data-root DATA] [--steps 5] [--repeats 3] [--smoke]

``--smoke``: one step per unit and one repeat on the embedded RotatedMNIST sample.

``benchmarks/mcgdm_client_cost.py`` is this script with ``--method mcgdm``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from _common import parse_arguments
from fedbed.algorithms import AlgorithmContext, TrainingBudget, get_algorithm, resolve_hyperparameters
from fedbed.data import load_dataset
from fedbed.data.augmentation import Augmentation
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import Payload
from fedbed.models import build_model

BATCH, SEED = 16, 0
UNITS = {"fedadg": 3 + 7, "mcgdm": 1}
"""Batches of the method per ``local_steps`` unit: FedADG's E0 + E1 (fedadg.md, Sec. 6.1); one for MCGDM."""
AUGMENTATION = {"fedadg": "jigen", "mcgdm": "randaugment"}
"""The augmentation each method draws, which FedAvg's batches get too."""


def client_data(data_root: Path | None) -> tuple[ClientData, str, tuple[int, int, int], int, str]:
    """The client's samples, the model's name, the input shape, the class count and a description."""
    if data_root is not None and (data_root / "pacs" / "pacs_32.npz").is_file():
        dataset, domain, model = load_dataset("PACS", data_root, 32), "photo", "hfedf_cnn"
    else:
        dataset, domain, model = load_dataset("RotatedMNIST", None), "0", "lenet"
    domain_id = dataset.domain_names.index(domain)
    data = ClientData.from_dataset(dataset, dataset.indices_of_domain(domain_id))
    return data, model, dataset.input_shape, dataset.num_classes, f"{dataset.name} domain {domain} ({len(data)} images), {model}"


def time_fit(name: str, hp: dict, steps: int, data: ClientData, model: str, shape, classes: int,
             augmentation_name: str) -> float:
    """Seconds of one client's ``fit`` (one round of local training; round 2 of 40, so that a
    method reading the previous round's heads finds three of them)."""
    algorithm = get_algorithm(name)
    hparams = resolve_hyperparameters(algorithm, hp)
    factory = lambda: algorithm.wrap_model(build_model(model, shape, classes), hparams)  # noqa: E731
    augmentation = None if algorithm.draws_its_own_views else Augmentation(augmentation_name)
    context = AlgorithmContext(factory, TrainingBudget(BATCH, local_steps=steps), SEED, augmentation=augmentation)
    trainer = algorithm.create_trainer(hparams, context)
    torch.manual_seed(SEED)
    arrays = factory().state_dict()
    heads = {f"head{j}/{key.removeprefix('classifier.')}": tensor.clone() for j in range(3)
             for key, tensor in arrays.items() if key.startswith("classifier.")}
    payload = Payload(arrays=arrays, config={"batch_seed": 1, "round": 2, "rounds": 40}, read_only_arrays=heads)
    began = time.perf_counter()
    trainer.fit(payload, data, {})
    return time.perf_counter() - began


def main(arguments: list[str] | None = None) -> None:
    """Parse ``arguments`` (the command line's when ``None``), time both sides, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(UNITS), required=True)
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=5, help="batches per unit of the method's schedule (S)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_arguments(parser, arguments, smoke="the embedded RotatedMNIST sample", steps=1, repeats=1, data_root=None)
    torch.set_num_threads(1)
    data, model, shape, classes, description = client_data(args.data_root)
    method, units = args.method, UNITS[args.method]
    images = units * args.steps * BATCH
    times: dict[str, list[float]] = {method: [], "fedavg": []}
    for _ in range(args.repeats):
        times[method].append(time_fit(method, {}, args.steps, data, model, shape, classes, AUGMENTATION[method]))
        times["fedavg"].append(time_fit("fedavg", {"client_optimizer": "sgd", "client_lr": 1e-3}, units * args.steps,
                                        data, model, shape, classes, AUGMENTATION[method]))
    cost, fedavg = (statistics.median(times[name]) / images * 1e3 for name in (method, "fedavg"))
    print(f"{description}; batch {BATCH}, {images} images per fit, 1 thread, median of {args.repeats}")
    print(f"FedAvg: {fedavg:.3f} ms per image; {method}: {cost:.3f} ms per image")
    print(f"{method} / FedAvg local training time per image: {cost / fedavg:.2f}")


if __name__ == "__main__":
    main()
