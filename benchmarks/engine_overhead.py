"""Engine overhead: FedAvg through the engine vs a plain PyTorch loop on the same batches.

FedAvg with 3 clients (RotatedMNIST domains 15, 30, 45 of the embedded MNIST sample, DomainBed's
MNIST CNN), 1 local epoch per round, 3 rounds, evaluation off. The plain loop performs the same
optimiser steps on the same batches (same seeds) with the same model and a fresh Adam per
client and round, and averages the client weights with one line of torch. Each side is timed
``--repeats`` times, alternating; the medians are compared. Prints the ratio last (goal <= 1.05).

    python benchmarks/engine_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedbed.algorithms import AlgorithmContext, TrainingBudget, get_algorithm
from fedbed.algorithms.local_training import make_optimizer
from fedbed.data import load_dataset, split_leave_one_domain_out
from fedbed.seeding import derive_seed
from fedbed.federation.engine import Federation, run_rounds
from fedbed.federation.transport import InProcessClients
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import ClientInfo
from fedbed.models import build_model

ROUNDS, SEED, BATCH = 3, 0, 64


def setup():
    dataset = load_dataset("RotatedMNIST", None)
    split = split_leave_one_domain_out(dataset, ("0",), 0.2, SEED)
    clients = [ClientData.from_dataset(dataset, split.train[d]) for d in (1, 2, 3)]
    factory = lambda: build_model("mnist_cnn", dataset.input_shape, dataset.num_classes)  # noqa: E731
    return clients, factory


def time_engine(clients, factory) -> float:
    algorithm = get_algorithm("fedavg")
    hparams = algorithm.hyperparameters()
    context = AlgorithmContext(factory, TrainingBudget(batch_size=BATCH, local_epochs=1), SEED)
    federation = Federation(algorithm.create_strategy(hparams, context),
                            InProcessClients(algorithm.create_trainer(hparams, context), clients),
                            holdout={}, target={}, domain_names=())
    torch.manual_seed(SEED)
    federation.strategy.initialize(factory(), [ClientInfo(k, len(c), (k,)) for k, c in enumerate(clients)])
    with tempfile.TemporaryDirectory() as run_dir:
        began = time.perf_counter()
        run_rounds(federation, rounds=ROUNDS, seed=SEED, participation_fraction=1.0, eval_every=0,
                   run_dir=Path(run_dir), progress=False)
        return time.perf_counter() - began


def time_plain_loop(clients, factory) -> float:
    hparams = get_algorithm("fedavg").hyperparameters()
    torch.manual_seed(SEED)
    global_model, local = factory(), factory()
    began = time.perf_counter()
    for round_number in range(1, ROUNDS + 1):
        states, sizes = [], []
        for client, data in enumerate(clients):
            local.load_state_dict(global_model.state_dict())
            local.train()
            optimizer = make_optimizer(local.parameters(), hparams)
            torch.manual_seed(derive_seed(SEED, round_number, client))
            generator = torch.Generator().manual_seed(derive_seed(SEED, round_number, client))
            for inputs, targets in data.batches(BATCH, generator):
                loss = torch.nn.functional.cross_entropy(local(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            states.append({k: v.clone() for k, v in local.state_dict().items()})
            sizes.append(len(data))
        total = sum(sizes)
        global_model.load_state_dict({k: sum(s[k] * (n / total) for s, n in zip(states, sizes)) for k in states[0]})
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    clients, factory = setup()
    time_plain_loop(clients, factory)  # warm-up
    engine, plain = [], []
    for _ in range(args.repeats):
        engine.append(time_engine(clients, factory))
        plain.append(time_plain_loop(clients, factory))
    print(f"threads: {torch.get_num_threads()}, repeats: {args.repeats}")
    print(f"engine median {statistics.median(engine):.3f} s  (all: {', '.join(f'{t:.3f}' for t in engine)})")
    print(f"plain  median {statistics.median(plain):.3f} s  (all: {', '.join(f'{t:.3f}' for t in plain)})")
    print(f"ratio engine/plain: {statistics.median(engine) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
