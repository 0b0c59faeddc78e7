"""Which code made a run: the record of each start, and the report's warning on mixed code."""

import json
from collections import Counter

import torch

from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.provenance import PROVENANCE_NAME, UNRECORDED, source_fingerprint, source_mix
from fedbed.reporting import mixed_code_warning


def test_each_start_of_a_run_is_recorded_with_the_code_that_made_it(tmp_path):
    config = ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path / "run")
    run_experiment(config, progress=False, echo=lambda *_: None)
    summary = run_experiment(config.model_copy(update={"rounds": 2}), resume=True, progress=False, echo=lambda *_: None)
    starts = [json.loads(line) for line in (tmp_path / "run" / PROVENANCE_NAME).read_text().splitlines()]
    assert [s["after_round"] for s in starts] == [0, 1] and summary["provenance"] == starts
    assert all(s["source"] == source_fingerprint() and s["torch_threads"] == torch.get_num_threads() for s in starts)
    assert len(source_fingerprint()) == 12 and int(source_fingerprint(), 16) >= 0
    # A run begun before starts were recorded, resumed now: its first part's code is unknown.
    (tmp_path / "run" / PROVENANCE_NAME).unlink()
    summary = run_experiment(config.model_copy(update={"rounds": 3}), resume=True, progress=False, echo=lambda *_: None)
    assert [(s["after_round"], s["source"]) for s in summary["provenance"]] == [(0, UNRECORDED), (2, source_fingerprint())]
    assert source_mix([summary]) == Counter({f"{UNRECORDED}+{source_fingerprint()}": 1})
    # A new run in the same folder starts a new record.
    run_experiment(config, progress=False, echo=lambda *_: None)
    assert len((tmp_path / "run" / PROVENANCE_NAME).read_text().splitlines()) == 1


def test_source_mix_and_the_reports_warning(tmp_path):
    summaries = [{"provenance": [{"source": "aaa"}]}, {"provenance": [{"source": "aaa"}, {"source": "bbb"}]},
                 {"provenance": [{"source": "aaa"}, {"source": "aaa"}]}, {}]
    assert source_mix(summaries) == Counter({"aaa": 2, "aaa+bbb": 1, UNRECORDED: 1})
    for name, summary in zip("wxyz", summaries[:1] * 2):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert mixed_code_warning(tmp_path) is None  # one version of the code: nothing to say
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "summary.json").write_text(json.dumps(summaries[1]))
    warning = mixed_code_warning(tmp_path)
    assert "2 versions" in warning and "aaa: 2" in warning and "aaa+bbb: 1" in warning
