"""The layout of a run folder: every file name a run, a sweep or the results store writes, in one place.

A run folder (``runs/<dataset>/<algorithm>/<target>/seed<seed>`` or a sweep's ``<hash>``) holds:

- :data:`CONFIG_NAME`: the resolved settings (YAML);
- :data:`LOG_NAME`: one JSON line per round (clients, drops, losses, telemetry, evaluation);
- :data:`CHECKPOINT_NAME`: the latest round's strategy and client states (never committed);
- :data:`CLIENT_STATES_FOLDER`: with many clients, one file per client state that the checkpoint
  names instead of holding it (:mod:`fedbed.federation.client_states`; never committed);
- :data:`PROVENANCE_NAME`: one JSON line per start and resumption (the code that ran);
- :data:`SUMMARY_NAME`: model selection under every rule;
- :data:`DONE_MARKER`: an empty file marking a finished sweep job;
- :data:`FLOWER_LOGS`: after a failed ``flower-deployment`` run, the logs of its Flower processes;
- :data:`PLOTS_FOLDER`: the plots ``fedbed plot`` writes (never committed);
- :data:`TENSORBOARD_FOLDER`: TensorBoard's event files of a run tracked with ``tracker: tensorboard``
  or exported to it (:mod:`fedbed.tracking`; never committed).

A sweep folder also holds :data:`SWEEP_RECORD` (the sweep file as run), :data:`STORE_NAME`
(the results index, rebuilt when read, never committed), :data:`CLAIMS_FOLDER` (one file per
job a sweep process is running now, never committed) and :data:`REMADE_FOLDER` (re-runs of
finished jobs that make their checkpoints, ``fedbed sweep --remake-checkpoints``; never committed,
and never read as the sweep's runs).
"""

from __future__ import annotations

CONFIG_NAME = "config.yaml"
LOG_NAME = "rounds.jsonl"
CHECKPOINT_NAME = "checkpoint.pt"
CLIENT_STATES_FOLDER = "client-states"
PROVENANCE_NAME = "provenance.jsonl"
SUMMARY_NAME = "summary.json"
DONE_MARKER = "done"
SWEEP_RECORD = "sweep.yaml"
STORE_NAME = "results.sqlite"
FLOWER_LOGS = "flower-logs"
CLAIMS_FOLDER = "claims"
REMADE_FOLDER = "remade"
PLOTS_FOLDER = "plots"
TENSORBOARD_FOLDER = "tensorboard"

COMMITTED_FILES = (CONFIG_NAME, LOG_NAME, PROVENANCE_NAME, SUMMARY_NAME, DONE_MARKER)
"""The small files of a finished run that a results folder in the repository keeps."""
