"""FedBed's messages as Flower records (Flower 1.41 Message API).

- :class:`~fedbed.federation.messages.Payload` <-> ``RecordDict{"arrays": ArrayRecord,
  "read-only-arrays": ArrayRecord, "config": ConfigRecord}``
- :class:`~fedbed.federation.messages.Reply` <-> ``RecordDict{"arrays": ArrayRecord,
  "metrics": MetricRecord}``, ``num_examples`` being one of the metrics (as Flower's own
  strategies expect it).

Arrays keep their dtype and shape exactly (Flower stores them as NumPy bytes), so a payload
crosses the boundary bit for bit. Only named tensors and scalars are carried: never samples.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedbed.federation.devices import HOST
from fedbed.federation.messages import Payload, Reply

ARRAYS, READ_ONLY_ARRAYS, CONFIG, METRICS, PLACEMENT = "arrays", "read-only-arrays", "config", "metrics", "placement"
NUM_EXAMPLES = "num_examples"


def arrays_to_record(arrays: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors (a state dict) as an ``ArrayRecord``, each on the host, dtype and shape kept."""
    return ArrayRecord({name: tensor.detach().to(HOST).contiguous() for name, tensor in arrays.items()})


def arrays_from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ``ArrayRecord``'s arrays as named CPU tensors of their dtype and shape (copies: writable,
    sharing no memory with the record)."""
    return {name: torch.from_numpy(array.numpy().copy()) for name, array in record.items()}


def payload_to_records(payload: Payload) -> RecordDict:
    """The records of one server-to-client message (see the module docstring)."""
    return RecordDict({ARRAYS: arrays_to_record(payload.arrays), READ_ONLY_ARRAYS: arrays_to_record(payload.read_only_arrays),
                       CONFIG: ConfigRecord(dict(payload.config))})


def payload_from_records(content: RecordDict) -> Payload:
    """Inverse of :func:`payload_to_records`.

    Raises:
        KeyError: the message holds no ``arrays`` or ``config`` record (it did not come from FedBed).
    """
    read_only = content.array_records.get(READ_ONLY_ARRAYS)
    return Payload(arrays=arrays_from_record(content.array_records[ARRAYS]), config=dict(content.config_records[CONFIG]),
                   read_only_arrays=arrays_from_record(read_only) if read_only is not None else {})


def reply_to_records(reply: Reply, device: str | None = None) -> RecordDict:
    """The records of one client-to-server reply (see the module docstring), with the device the
    client trained on in a ``placement`` config record when given (:func:`reply_device`)."""
    metrics = MetricRecord({**{k: float(v) for k, v in reply.metrics.items()}, NUM_EXAMPLES: int(reply.num_examples)})
    records = {ARRAYS: arrays_to_record(reply.arrays), METRICS: metrics}
    if device is not None:
        records[PLACEMENT] = ConfigRecord({"device": device})
    return RecordDict(records)


def reply_device(content: RecordDict) -> str | None:
    """The device a reply's client trained on (``None`` when the client did not say)."""
    placement = content.config_records.get(PLACEMENT)
    return None if placement is None else str(placement["device"])


def reply_from_records(content: RecordDict) -> Reply:
    """Inverse of :func:`reply_to_records`.

    Raises:
        KeyError: the message holds no ``arrays`` or ``metrics`` record, or no ``num_examples``.
    """
    metrics = dict(content.metric_records[METRICS])
    num_examples = int(metrics.pop(NUM_EXAMPLES))
    return Reply(arrays=arrays_from_record(content.array_records[ARRAYS]), num_examples=num_examples, metrics=metrics)
