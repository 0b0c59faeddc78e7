"""Which code made a run: the record of each start, and the report's warning on mixed code."""

import json
import os
import re
from collections import Counter

import torch

from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.run_directory import PROVENANCE_NAME
from fedbed.provenance import CPU_KERNEL_CAPS, UNRECORDED, current_provenance, record_start, source_fingerprint, source_mix
from fedbed.reporting import mixed_code_warning


def test_each_start_of_a_run_is_recorded_with_the_code_that_made_it(tmp_path):
    config = ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path / "run")
    run_experiment(config, progress=False, echo=lambda *_: None)
    summary = run_experiment(config.model_copy(update={"rounds": 2}), resume=True, progress=False, echo=lambda *_: None)
    starts = [json.loads(line) for line in (tmp_path / "run" / PROVENANCE_NAME).read_text().splitlines()]
    assert [s["after_round"] for s in starts] == [0, 1] and summary["provenance"] == starts
    assert all(s["source"] == source_fingerprint() and s["torch_threads"] == torch.get_num_threads()
               and s["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability() for s in starts)
    caps_here = {name: os.environ[name] for name in CPU_KERNEL_CAPS if name in os.environ}
    assert all(s["cpu_kernel_caps"] == caps_here for s in starts)
    assert re.fullmatch("[0-9a-f]{12}", source_fingerprint())
    # Resuming a finished run trains nothing, so it records no start.
    again = run_experiment(config.model_copy(update={"rounds": 2}), resume=True, progress=False, echo=lambda *_: None)
    assert again["provenance"] == starts
    # The start round is the checkpoint's, not the log's length: a line cut short by a crash
    # does not count, and a log that was lost does not erase the record.
    log = tmp_path / "run" / "rounds.jsonl"
    log.write_text(log.read_text() + '{"round": 3, "sel')
    summary = run_experiment(config.model_copy(update={"rounds": 3}), resume=True, progress=False, echo=lambda *_: None)
    assert [s["after_round"] for s in summary["provenance"]] == [0, 1, 2]
    log.unlink()
    summary = run_experiment(config.model_copy(update={"rounds": 4}), resume=True, progress=False, echo=lambda *_: None)
    assert [s["after_round"] for s in summary["provenance"]] == [0, 1, 2, 3]
    # A run begun before starts were recorded, resumed now: its first part's code is unknown.
    (tmp_path / "run" / PROVENANCE_NAME).unlink()
    summary = run_experiment(config.model_copy(update={"rounds": 5}), resume=True, progress=False, echo=lambda *_: None)
    assert [(s["after_round"], s["source"]) for s in summary["provenance"]] == [(0, UNRECORDED), (4, source_fingerprint())]
    assert source_mix([summary]) == Counter({f"{UNRECORDED}+{source_fingerprint()}": 1})
    # A new start from round 0 in the same folder begins a new record.
    assert len(record_start(tmp_path / "run", 0)) == 1


def test_the_kernel_caps_set_are_recorded_and_nothing_else(monkeypatch):
    # Only the record is read here: no kernel runs while the variables are changed.
    for name in CPU_KERNEL_CAPS:
        monkeypatch.delenv(name, raising=False)
    assert current_provenance()["cpu_kernel_caps"] == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")  # not a cap
    assert current_provenance()["cpu_kernel_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_source_mix_and_the_reports_warning(tmp_path):
    summaries = [{"provenance": [{"source": "aaa"}]}, {"provenance": [{"source": "aaa"}, {"source": "bbb"}]},
                 {"provenance": [{"source": "aaa"}, {"source": "aaa"}]}, {}]
    assert source_mix(summaries) == Counter({"aaa": 2, "aaa+bbb": 1, UNRECORDED: 1})
    for name in "wx":
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summaries[0]))
    assert mixed_code_warning(tmp_path) is None  # one version of the code: nothing to say
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "summary.json").write_text(json.dumps(summaries[1]))
    warning = mixed_code_warning(tmp_path)
    assert "2 versions" in warning and "aaa: 2" in warning and "aaa then bbb: 1" in warning
    # Every run begun under one code and resumed under another: still two versions.
    for name in "wx":
        (tmp_path / name / "summary.json").write_text(json.dumps(summaries[1]))
    assert "2 versions" in mixed_code_warning(tmp_path)
