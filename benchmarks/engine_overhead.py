"""Engine overhead: FedAvg through the engine vs a plain PyTorch loop on the same batches.

FedAvg with 3 clients (RotatedMNIST domains 15, 30, 45 of the embedded MNIST sample, DomainBed's
MNIST CNN), 1 local epoch per round, 3 rounds, evaluation off. The plain loop performs the same
optimiser steps on the same batches (same seeds) with the same model and a fresh Adam per
client and round, and averages the client weights with one line of torch. Each side is timed
``--repeats`` times, alternating; the medians are compared. Prints the largest difference between
the two final global models (the check that both did the same work: float rounding of the average
after one round, about 1e-7; in later rounds Adam's steps, about ±lr for a weight however small its
gradient, magnify that rounding: 0.004 after the default 3 rounds), then the ratio last (goal <= 1.05).
``--smoke``: one round on 96 samples per client (two batches, so that their order matters), once.

    python benchmarks/engine_overhead.py [--repeats 5] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import parse_arguments

from fedbed.algorithms import AlgorithmContext, TrainingBudget, get_algorithm
from fedbed.algorithms.base.local_training import make_optimizer
from fedbed.data import load_dataset, split_leave_one_domain_out
from fedbed.federation.engine import Federation, run_rounds
from fedbed.federation.local_data import ClientData
from fedbed.federation.messages import ClientInfo
from fedbed.federation.transport import InProcessClients
from fedbed.models import build_model
from fedbed.seeding import derive_seed

SEED, BATCH = 0, 64


def setup(client_samples: int | None):
    """The three clients' data (the first ``client_samples`` of each domain's training share, all
    when ``None``) and the model factory."""
    dataset = load_dataset("RotatedMNIST", None)
    split = split_leave_one_domain_out(dataset, ("0",), 0.2, SEED)
    clients = [ClientData.from_dataset(dataset, split.train[d][:client_samples]) for d in (1, 2, 3)]
    factory = lambda: build_model("mnist_cnn", dataset.input_shape, dataset.num_classes)  # noqa: E731
    return clients, factory


def time_engine(clients, factory, rounds: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Seconds of ``rounds`` rounds of FedAvg through the engine (in-process clients), and the
    global model's state at the end."""
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
        run_rounds(federation, rounds=rounds, seed=SEED, participation_fraction=1.0, eval_every=0,
                   run_dir=Path(run_dir), progress=False)
        seconds = time.perf_counter() - began
    return seconds, federation.strategy.global_model().state_dict()


def time_plain_loop(clients, factory, rounds: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Seconds of the same ``rounds`` rounds as a plain PyTorch loop, and its global model's state
    at the end."""
    hparams = get_algorithm("fedavg").hyperparameters()
    torch.manual_seed(SEED)
    global_model, local = factory(), factory()
    began = time.perf_counter()
    for round_number in range(1, rounds + 1):
        states, sizes = [], []
        for client, data in enumerate(clients):
            local.load_state_dict(global_model.state_dict())
            local.train()
            optimizer = make_optimizer(local.parameters(), hparams)
            torch.manual_seed(derive_seed(SEED, round_number, client))
            generator = torch.Generator().manual_seed(derive_seed(SEED, round_number, client))
            for batch in data.batches(BATCH, generator):
                loss = torch.nn.functional.cross_entropy(local(batch.inputs), batch.targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            states.append({k: v.clone() for k, v in local.state_dict().items()})
            sizes.append(len(data))
        total = sum(sizes)
        global_model.load_state_dict({k: sum(s[k] * (n / total) for s, n in zip(states, sizes)) for k in states[0]})
    return time.perf_counter() - began, global_model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-samples", type=int, default=None,
                        help="samples per client (default: all of its domain's training share, 666 or 667)")
    args = parse_arguments(parser, repeats=1, rounds=1, client_samples=BATCH + BATCH // 2)
    clients, factory = setup(args.client_samples)
    time_plain_loop(clients, factory, args.rounds)  # warm-up
    engine, plain = [], []
    for _ in range(args.repeats):
        seconds, engine_model = time_engine(clients, factory, args.rounds)
        engine.append(seconds)
        seconds, plain_model = time_plain_loop(clients, factory, args.rounds)
        plain.append(seconds)
    print(f"threads: {torch.get_num_threads()}, repeats: {args.repeats}, rounds: {args.rounds}, "
          f"samples per client: {', '.join(str(len(c)) for c in clients)}")
    print(f"engine median {statistics.median(engine):.3f} s  (all: {', '.join(f'{t:.3f}' for t in engine)})")
    print(f"plain  median {statistics.median(plain):.3f} s  (all: {', '.join(f'{t:.3f}' for t in plain)})")
    difference = max(float((engine_model[k].double() - plain_model[k].double()).abs().max()) for k in engine_model)
    print(f"final global models, largest difference engine - plain: {difference:.3g}")
    print(f"ratio engine/plain: {statistics.median(engine) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
