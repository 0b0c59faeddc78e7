import math
import re

import pytest

from fedbed.federation.evaluation import format_score
from fedbed.reporting import format_spread, mean_std_se, ood_table, paired_pairs, paired_t_test, score_table, tidy_rows


def test_std_and_se_by_hand():
    # values 1, 2, 3, 6: mean 3; squared deviations 4+1+0+9 = 14; std = sqrt(14/3); SE = std/2
    mean, std, se = mean_std_se([1, 2, 3, 6])
    assert mean == 3 and std == pytest.approx(math.sqrt(14 / 3)) and se == pytest.approx(math.sqrt(14 / 3) / 2)
    assert format_spread([1, 2, 3, 6], "std") == "3.0 ± 2.2" and format_spread([1, 2, 3, 6], "se") == "3.0 ± 1.1"
    assert format_spread([5.0]) == "5.0"


def test_paired_t_test_known_case():
    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1/sqrt 3) = 2 sqrt 3; two-sided p with 2 df = 0.0742
    t, p = paired_t_test([2, 4, 6], [1, 2, 3])
    assert t == pytest.approx(2 * math.sqrt(3)) and p == pytest.approx(0.07418, abs=1e-4)
    with pytest.raises(ValueError):
        paired_t_test([1], [2])


def summary(algorithm, target, seed, ood):
    return {"algorithm": algorithm, "target": target, "seed": seed, "selection": {"last": {"ood_mean": ood}}}


def test_table_and_pairing():
    runs = [summary("a", "t1", 0, 10), summary("a", "t1", 1, 20), summary("a", "t2", 0, 30), summary("b", "t1", 0, 5), summary("b", "t2", 0, 7)]
    table = ood_table(runs, ["a", "b"], ["t1", "t2"], "last")
    assert "| a | 15.0 ± 7.1 | 30.0 | 22.5 |" in table and "± std over seeds" in table
    assert paired_pairs(runs, "a", "b", "last") == ([10, 30], [5, 7])
    # a's mean, 22.5, weighs t1's two seeds and t2's one alike: a note says so; b's seeds are even.
    from fedbed.reporting import uneven_seed_notes

    labelled = [{**run, "label": run["algorithm"]} for run in runs]
    assert uneven_seed_notes(labelled, ["a", "b"], ["t1", "t2"]) == [
        "uneven seeds: a's mean averages targets run with different numbers of seeds (t1: 2 seeds; t2: 1 seed)"]
    assert uneven_seed_notes(labelled, ["a", "b"], ["t1"]) == []  # one target: no mean column


def test_a_run_without_a_score_under_a_rule_is_a_missing_cell_not_a_failure():
    """A lost site's id holdout share leaves a round's id score null in summary.json (and
    train-domain validation, with no scored round, chooses none): the report leaves the run out of
    that cell's mean, prints "–" where no run has a score, and pairs only scored runs."""
    runs = [summary("a", "t1", 0, 10), summary("a", "t1", 1, None), summary("a", "t2", 0, None), summary("b", "t1", 0, 5),
            summary("b", "t1", 1, 6), summary("b", "t2", 0, 7)]
    table = ood_table(runs, ["a", "b"], ["t1", "t2"], "last")
    assert "| a | 10.0 | – | – |" in table
    per_seed = score_table(runs, ["a"], ["t1"], "last", "ood", per_seed=True)  # seed 1's cell: no score
    assert per_seed[1][1:] == ["10.0", "–", "10.0"]
    assert (format_score(None), format_score(math.nan), format_score(12.34)) == ("–", "–", "12.3")
    assert paired_pairs(runs, "a", "b", "last") == ([10], [5])
    for run in runs:
        run["label"] = run["algorithm"]
        run["selection"]["last"]["id_mean"] = None
    rows = tidy_rows(runs, "last")
    assert not [r for r in rows if r["metric"] == "id"]  # no run has an id score
    assert [(r["label"], r["target"], r["mean"], r["n"]) for r in rows if r["metric"] == "ood"] == [
        ("a", "t1", 10.0, 1), ("b", "t1", 5.5, 2), ("b", "t2", 7.0, 1)]


def write_sweep(folder, runs, grid, logs=None, names=None):
    """A sweep folder with a record varying ``grid`` and one run folder per (algorithm, hp, target, seed, id, ood),
    named ``names[i]`` (default ``run<i>``); ``logs``, if given, holds per run the ood accuracies of its evaluated
    rounds (its ``rounds.jsonl``)."""
    import json

    import yaml

    folder.mkdir()
    (folder / "sweep.yaml").write_text(yaml.safe_dump({"name": "s", "algorithms": ["ppdg", "fedavg"], "hp": grid}))
    for number, (algorithm, hp, target, seed, id_score, ood) in enumerate(runs):
        run = folder / (names[number] if names else f"run{number}")
        run.mkdir()
        scores = {rule: {"id_mean": id_score, "ood_mean": ood, "id": {"s": id_score}, "ood": {target: ood}}
                  for rule in ("last", "train_domain_val", "oracle")}
        (run / "config.yaml").write_text(yaml.safe_dump({"algorithm": algorithm, "hp": hp}))
        (run / "summary.json").write_text(json.dumps({"algorithm": algorithm, "hp": hp, "target": target, "seed": seed,
                                                       "selection": scores}))
        if logs is not None:
            records = [{"round": r, "evaluation": {"round": r, "id": {"s": id_score}, "ood": {target: accuracy},
                                                   "id_mean": id_score, "ood_mean": accuracy}}
                       for r, accuracy in enumerate(logs[number], start=1)]
            (run / "rounds.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_report_scores_the_mean_of_the_last_five_evaluations(tmp_path):
    from typer.testing import CliRunner

    from fedbed.cli import app

    runs = [("fedavg", {}, "a", 0, 70, 30.0), ("fedavg", {}, "a", 1, 70, 10.0)]
    # Seed 0's last five evaluations average 22 (its last is 30); seed 1's average 12.
    logs = [[90.0, 20.0, 20.0, 20.0, 20.0, 30.0], [12.0, 12.0, 12.0, 12.0, 12.0]]
    write_sweep(tmp_path / "sweep", runs, {}, logs)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last_five_mean"])
    assert result.exit_code == 0, result.output
    # One target: no "mean" column repeating it.
    assert "| fedavg | 17.0 ± 7.1 |\n" in result.output and "(last_five_mean, ± std over seeds) | a |\n" in result.output
    assert "| fedavg | 20.0 ± 14.1 |\n" in CliRunner().invoke(app, ["report", str(tmp_path / "sweep"),
                                                                    "--selection", "last"]).output
    write_sweep(tmp_path / "unlogged", runs, {})  # summaries without their rounds.jsonl
    result = CliRunner().invoke(app, ["report", str(tmp_path / "unlogged"), "--selection", "last_five_mean"])
    assert result.exit_code == 2 and "is missing or holds no evaluation; choose --selection last" in result.output
    assert "Traceback" not in result.output


def test_select_hparams_chooses_by_source_validation_per_target(tmp_path):
    from fedbed.reporting import build_report

    def sweep_tables(folder, selection, select_hparams=False):
        return build_report(folder, selection, select_hparams=select_hparams).tables

    runs = [  # lambda 0.1 wins target a on id (mean 80 vs 75) though its ood is lower; lambda 1.0 wins target b
        ("ppdg", {"lam": 0.1}, "a", 0, 78, 10), ("ppdg", {"lam": 0.1}, "a", 1, 82, 12),
        ("ppdg", {"lam": 1.0}, "a", 0, 75, 50), ("ppdg", {"lam": 1.0}, "a", 1, 75, 52),
        ("ppdg", {"lam": 0.1}, "b", 0, 60, 30), ("ppdg", {"lam": 1.0}, "b", 0, 70, 20),
        ("fedavg", {}, "a", 0, 70, 40), ("fedavg", {}, "b", 0, 70, 40),
    ]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    plain = sweep_tables(tmp_path / "sweep", "last")
    assert [row[0] for row in plain["ood"][1:]] == ["fedavg", "ppdg(lam=0.1)", "ppdg(lam=1.0)"]
    tables = sweep_tables(tmp_path / "sweep", "last", select_hparams=True)
    assert [row[0] for row in tables["ood"][1:]] == ["fedavg", "ppdg"]
    assert tables["ood"][2][1:] == ["11.0 ± 1.4", "20.0", "15.5"]  # target a: lambda 0.1's ood; target b: lambda 1.0's
    choices = {(row[0], row[1]): row[2] for row in tables["selected_hyperparameters"][1:]}
    assert choices == {("fedavg", "a"): "fedavg", ("fedavg", "b"): "fedavg",
                       ("ppdg", "a"): "ppdg(lam=0.1)", ("ppdg", "b"): "ppdg(lam=1.0)"}
    with pytest.raises(ValueError, match="source-domain validation"):
        sweep_tables(tmp_path / "sweep", "oracle", select_hparams=True)


def test_a_tie_on_source_validation_goes_to_the_last_label_and_is_named(tmp_path):
    """Two values with the same mean id accuracy (77 = (78 + 76) / 2 = (80 + 74) / 2): the label
    last in string order is chosen, and a note names the tie; a group the report does not show
    has no tie note."""
    from fedbed.reporting import build_report

    runs = [("ppdg", {"lam": 0.1}, "a", 0, 78, 10), ("ppdg", {"lam": 0.1}, "a", 1, 76, 12),
            ("ppdg", {"lam": 1.0}, "a", 0, 80, 50), ("ppdg", {"lam": 1.0}, "a", 1, 74, 52),
            ("fedavg", {}, "a", 0, 70, 40)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    report = build_report(tmp_path / "sweep", "last", select_hparams=True)
    assert report.tables["ood"][2] == ["ppdg", "51.0 ± 1.4"]
    assert ("tie: ppdg, target a: ppdg(lam=0.1), ppdg(lam=1.0) have the same id accuracy (77.00); ppdg(lam=1.0) is "
            "chosen (the last label)") in report.notes
    per_seed = build_report(tmp_path / "sweep", "last", select_hparams=True, select_per_seed=True)
    assert not [note for note in per_seed.notes if note.startswith("tie:")]  # each seed has its own winner
    assert not [note for note in build_report(tmp_path / "sweep", "last", select_hparams=True, labels=["fedavg"]).notes
                if note.startswith("tie:")]


def test_a_choice_among_candidates_of_uneven_seeds_is_named(tmp_path):
    """A sweep still running: lambda 0.1 has seeds 0 and 1, lambda 1.0 seed 0 only, so the
    choice compares a two-seed mean (77) with a one-seed score (80), and a note names the label
    short of a seed; per seed, seed 1 has one candidate where seed 0 has two. With ``--seed 0``
    the candidates are even and the note goes. A finished run without an id score leaves the
    same gap."""
    from fedbed.reporting import build_report

    def uneven_notes(report):
        return [note for note in report.notes if note.startswith("uneven seeds:")]

    runs = [("ppdg", {"lam": 0.1}, "a", 0, 78, 10), ("ppdg", {"lam": 0.1}, "a", 1, 76, 12),
            ("ppdg", {"lam": 1.0}, "a", 0, 80, 50), ("fedavg", {}, "a", 0, 70, 40)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    report = build_report(tmp_path / "sweep", "last", select_hparams=True)
    assert report.tables["selected_hyperparameters"][2][2] == "ppdg(lam=1.0)"
    assert uneven_notes(report) == [
        "uneven seeds: ppdg, target a: not every candidate has a scored run of every seed (ppdg(lam=1.0) has no "
        "seed 1), so the choice compares means over different seeds; finish those runs, or choose among seeds every "
        "candidate has with --seed"]
    per_seed = build_report(tmp_path / "sweep", "last", select_hparams=True, select_per_seed=True)
    assert [(row[3], row[-1]) for row in per_seed.tables["selected_hyperparameters"][2:]] == [
        ("ppdg(lam=1.0)", "2"), ("ppdg(lam=0.1)", "1")]  # (chosen, candidates) in seeds 0 and 1
    assert uneven_notes(per_seed) == [uneven_notes(report)[0].replace("means over different seeds",
                                                                      "fewer candidates in some seeds")]
    assert not uneven_notes(build_report(tmp_path / "sweep", "last", select_hparams=True, seeds=[0]))
    runs[2:2] = [("ppdg", {"lam": 1.0}, "a", 1, None, 52)]  # finished, but no id score
    write_sweep(tmp_path / "unscored", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    assert "(ppdg(lam=1.0) has no seed 1)" in uneven_notes(build_report(tmp_path / "unscored", "last",
                                                                        select_hparams=True))[0]


def test_a_report_of_some_seeds_reads_only_their_runs_for_tables_tests_and_the_choice(tmp_path):
    """``seeds`` (``fedbed report --seed``) keeps the other seeds' runs out of everything: here
    lambda 0.1 wins on the mean id over both seeds (80 vs 75) but loses on seed 0 alone (70 vs 75)."""
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.reporting import build_report

    runs = [("ppdg", {"lam": 0.1}, "a", 0, 70, 10), ("ppdg", {"lam": 0.1}, "a", 1, 90, 12),
            ("ppdg", {"lam": 1.0}, "a", 0, 75, 50), ("ppdg", {"lam": 1.0}, "a", 1, 75, 52),
            ("fedavg", {}, "a", 0, 70, 40), ("fedavg", {}, "a", 1, 70, 44)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    both = build_report(tmp_path / "sweep", "last", select_hparams=True).tables
    assert both["ood"][2] == ["ppdg", "11.0 ± 1.4"] and both["selected_hyperparameters"][2][2] == "ppdg(lam=0.1)"
    first = build_report(tmp_path / "sweep", "last", select_hparams=True, seeds=[0]).tables
    assert first["ood"][1:] == [["fedavg", "40.0"], ["ppdg", "50.0"]]
    assert first["selected_hyperparameters"][2][2] == "ppdg(lam=1.0)"
    plain = build_report(tmp_path / "sweep", "last", baselines=["fedavg"], seeds=[1]).tables
    assert plain["ood"][1:] == [["fedavg", "44.0"], ["ppdg(lam=0.1)", "12.0"], ["ppdg(lam=1.0)", "52.0"]]
    with pytest.raises(ValueError, match=re.escape("seed 5 is not among the seeds of the runs on a: 0, 1")):
        build_report(tmp_path / "sweep", "last", seeds=[5])
    running = tmp_path / "sweep" / "running"  # seed 1's job still running: a report of seed 0 leaves nothing out
    running.mkdir()
    (running / "config.yaml").write_text("algorithm: fedavg\ntarget: a\nseed: 1\n")
    assert build_report(tmp_path / "sweep", "last", seeds=[0]).warnings == []
    assert build_report(tmp_path / "sweep", "last").warnings == [
        f"note: 1 unfinished run(s) left out (no summary.json yet), e.g. {running}"]
    write_sweep(tmp_path / "other", [("fedavg", {}, "a", 0, 70, 40), ("fedavg", {}, "b", 1, 70, 44)], {})
    with pytest.raises(ValueError, match=re.escape("seed 1 is not among the seeds of the runs on a: 0")):
        build_report(tmp_path / "other", "last", targets=["a"], seeds=[1])  # not an empty table
    printed = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--seed", "0",
                                       "--select-hparams"])
    assert printed.exit_code == 0 and "| ppdg | 50.0 |" in printed.output
    refused = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--seed", "5"])
    assert refused.exit_code == 2 and "seed 5 is not among" in refused.output and "Traceback" not in refused.output


def test_a_kept_candidate_stands_beside_the_choice_so_a_tuned_method_is_tested_against_it(tmp_path):
    """``keep_labels`` (``--keep-label``) keeps a candidate, e.g. a random search's defaults, as a
    row of its own under ``select_hparams``: lambda 0.1 is chosen on target a (id 80 vs 75), lambda
    1.0 on b (70 vs 60), so against lambda 1.0 the choice differs by -40 on a's two seeds and by 0
    on b's (the same runs): mean -20, sd sqrt(1600/3), t = -20 / (sd / 2) = -sqrt(3). A run that is
    both chosen and kept counts once in the data note (6 ppdg runs, not 8, and 2 fedavg)."""
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.reporting import build_report, sweep_settings

    runs = [("ppdg", {"lam": 0.1}, "a", 0, 78, 10), ("ppdg", {"lam": 0.1}, "a", 1, 82, 12),
            ("ppdg", {"lam": 1.0}, "a", 0, 75, 50), ("ppdg", {"lam": 1.0}, "a", 1, 75, 52),
            ("ppdg", {"lam": 0.1}, "b", 0, 60, 30), ("ppdg", {"lam": 0.1}, "b", 1, 60, 31),
            ("ppdg", {"lam": 1.0}, "b", 0, 70, 20), ("ppdg", {"lam": 1.0}, "b", 1, 70, 22),
            ("fedavg", {}, "a", 0, 70, 40), ("fedavg", {}, "b", 0, 70, 40)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}})
    report = build_report(tmp_path / "sweep", "last", select_hparams=True, keep_labels=["ppdg(lam=1.0)"],
                          comparisons=["ppdg vs ppdg(lam=1.0)"])
    assert report.tables["ood"][1:] == [["fedavg", "40.0", "40.0", "40.0"], ["ppdg", "11.0 ± 1.4", "21.0 ± 1.4", "16.0"],
                                        ["ppdg(lam=1.0)", "51.0 ± 1.4", "21.0 ± 1.4", "36.0"]]
    test = report.tables["t_test"][1]
    assert test[:5] == ["ppdg", "ppdg(lam=1.0)", "4", "-20.00", f"{-math.sqrt(3):.2f}"]
    assert [row[2] for row in report.tables["selected_hyperparameters"][1:]] == [
        "fedavg", "fedavg", "ppdg(lam=0.1)", "ppdg(lam=1.0)"]  # the choices are unchanged by the kept row
    assert report.notes[0] == "data: unrecorded (fingerprint unrecorded): 8 runs"
    settings = dict(sweep_settings(report.summaries, [run.config for run in report.runs], "last"))
    assert settings["data"] == "unrecorded (fingerprint unrecorded): 8 runs"  # the HTML page's count
    alone = build_report(tmp_path / "sweep", "last", select_hparams=True, keep_labels=["ppdg(lam=1.0)"],
                         labels=["ppdg(lam=1.0)"])  # its runs are the plots' runs
    assert sorted((run.summary["target"], run.summary["seed"]) for run in alone.runs) == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1)] and all(run.summary["hp"] == {"lam": 1.0} for run in alone.runs)
    with pytest.raises(ValueError, match="'fedavg' is a method with a single candidate, already a row"):
        build_report(tmp_path / "sweep", "last", select_hparams=True, keep_labels=["fedavg"])
    with pytest.raises(ValueError, match="give --select-hparams too"):
        build_report(tmp_path / "sweep", "last", keep_labels=["ppdg(lam=1.0)"])
    with pytest.raises(ValueError, match=re.escape("--keep-label 'ppdg(lam=2.0)' is not among the runs' labels")):
        build_report(tmp_path / "sweep", "last", select_hparams=True, keep_labels=["ppdg(lam=2.0)"])
    printed = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--select-hparams",
                                       "--keep-label", "ppdg(lam=1.0)", "--compare", "ppdg vs ppdg(lam=1.0)"])
    assert printed.exit_code == 0 and "| ppdg | ppdg(lam=1.0) | 4 | -20.00 | -1.73 |" in printed.output, printed.output
    refused = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--keep-label", "ppdg(lam=1.0)"])
    assert refused.exit_code == 2 and "give --select-hparams too" in refused.output and "Traceback" not in refused.output


def test_select_hparams_leaves_out_runs_without_an_id_score_and_says_when_none_has_one(tmp_path):
    """A run whose id score is null (no evaluated round scored the source holdouts) does not
    speak for its label: lambda 1.0's scored seed (75) loses to lambda 0.1's (78) although its
    unscored seed would have counted as nothing; a target where no run has an id score gets a row
    that says so and keeps no run, and ``fedbed report --select-hparams`` exits 0."""
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.reporting import build_report

    runs = [("ppdg", {"lam": 0.1}, "a", 0, 78, 10), ("ppdg", {"lam": 0.1}, "a", 1, 76, 12),
            ("ppdg", {"lam": 1.0}, "a", 0, 75, 50), ("ppdg", {"lam": 1.0}, "a", 1, None, 52),
            ("ppdg", {"lam": 0.1}, "b", 0, None, 30), ("ppdg", {"lam": 1.0}, "b", 0, None, 20),
            ("fedsr", {"alpha": 1}, "a", 0, None, 40), ("fedsr", {"alpha": 2}, "a", 0, None, 41),
            ("fedavg", {}, "a", 0, 70, 30)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}, "fedsr": {"alpha": [1, 2]}})
    report = build_report(tmp_path / "sweep", "last", select_hparams=True)
    tables = report.tables
    choices = {(row[0], row[1]): row[2:] for row in tables["selected_hyperparameters"][1:]}
    assert choices["ppdg", "a"] == ["ppdg(lam=0.1)", "lam=0.1", "77.0", "2"]
    assert choices["ppdg", "b"] == choices["fedsr", "a"] == ["– (no run has an id score)", "–", "–", "0"]
    # target b: no run kept, so no column; its choice row says why. fedsr keeps no run at all but keeps its row.
    assert tables["ood"][1:] == [["fedavg", "30.0"], ["fedsr", "–"], ["ppdg", "11.0 ± 1.4"]]
    assert not [note for note in report.notes if "without an" in note]  # every kept run has its scores
    plain = build_report(tmp_path / "sweep", "last")
    assert ("last: 5 run(s) without an id score, left out of their cells (fewer seeds there): fedsr(alpha=1) a seed 0, "
            "fedsr(alpha=2) a seed 0, ppdg(lam=0.1) b seed 0, ppdg(lam=1.0) a seed 1, ppdg(lam=1.0) b seed 0") in plain.notes
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--select-hparams"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_csv_report_is_tidy_numbers(tmp_path):
    import csv
    import io

    from typer.testing import CliRunner

    from fedbed.cli import app

    runs = [("fedavg", {}, "a", 0, 70, 10.0), ("fedavg", {}, "a", 1, 72, 12.0), ("fedavg", {}, "b", 0, 60, 30.0)]
    write_sweep(tmp_path / "sweep", runs, {})
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--format", "csv"])
    assert result.exit_code == 0, result.output
    records = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(records[0]) == ["label", "algorithm", "target", "selection", "metric", "mean", "std", "se", "n"]
    ood_a = next(r for r in records if r["target"] == "a" and r["metric"] == "ood")
    assert (float(ood_a["mean"]), float(ood_a["std"]), ood_a["n"]) == (11.0, pytest.approx(math.sqrt(2)), "2")
    ood_b = next(r for r in records if r["target"] == "b" and r["metric"] == "ood")
    assert ood_b["std"] == "" and ood_b["se"] == "" and len(records) == 4


def test_fedbed_report_and_its_html_page_take_a_run_without_an_id_score(tmp_path):
    from typer.testing import CliRunner

    from fedbed.cli import app

    runs = [("fedavg", {}, "a", 0, None, 10.0), ("fedavg", {}, "a", 1, 72, 12.0)]  # seed 0: no id score
    write_sweep(tmp_path / "sweep", runs, {})
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--per-seed",
                                      "--html", str(tmp_path / "report.html")])
    assert result.exit_code == 0, result.output
    assert "| fedavg | – | 72.0 | 72.0 |" in result.output  # the id table: seed 0 missing, the mean of seed 1
    assert (tmp_path / "report.html").stat().st_size > 0


def test_a_t_test_of_identical_columns_says_why_it_is_undefined():
    from fedbed.reporting import t_test_rows

    runs = [{**summary(label, target, 0, ood), "label": label}
            for label, shift in (("a", 0.0), ("b", 0.0)) for target, ood in (("t1", 10.0), ("t2", 20.0))]
    rows = t_test_rows(runs, [("b", "a")], "last")
    assert rows[1] == ["b", "a", "2", "+0.00", "undefined", "undefined: the paired differences do not vary", "–"]
    assert rows[0][-1] == "p, Holm over 0"  # an undefined test is not one of Holm's m


def test_the_differences_table_shows_each_tested_pair_per_target_and_seed(tmp_path):
    """By hand: b − a on t1 is 12.5 − 10 = +2.5 (seed 0) and 9 − 11 = −2 (seed 1); on t2 seed 0
    7.25 − 7.25 = 0 (neither above nor below); c has no run on t2 and b none of seed 1 there, so
    those cells are "–". The t-test's mean difference of b is the mean of the row's three numbers."""
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.reporting import build_report

    runs = [("fedavg", {}, "t1", 0, 70, 10.0), ("fedavg", {}, "t1", 1, 70, 11.0), ("fedavg", {}, "t2", 0, 70, 7.25),
            ("fedavg", {}, "t2", 1, 70, 8.0), ("ppdg", {}, "t1", 0, 70, 12.5), ("ppdg", {}, "t1", 1, 70, 9.0),
            ("ppdg", {}, "t2", 0, 70, 7.25), ("fedsr", {}, "t1", 0, 70, 10.5)]
    write_sweep(tmp_path / "sweep", runs, {})
    report = build_report(tmp_path / "sweep", "last", baselines=["fedavg"], targets=["t1", "t2"], differences=True)
    assert report.tables["differences"] == [
        ["ood difference (last), label − baseline", "against", "t1, seed 0", "t1, seed 1", "t2, seed 0", "t2, seed 1",
         "above", "below"],
        ["fedsr", "fedavg", "+0.50", "–", "–", "–", "1", "0"],
        ["ppdg", "fedavg", "+2.50", "-2.00", "+0.00", "–", "1", "1"]]
    assert report.tables["t_test"][2][:4] == ["ppdg", "fedavg", "3", "+0.17"]  # (2.5 − 2 + 0) / 3
    assert list(report.tables)[-1] == "differences"  # after the t-tests
    with pytest.raises(ValueError, match="--differences shows each tested pair's difference"):
        build_report(tmp_path / "sweep", "last", differences=True)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--differences",
                                      "--compare", "ppdg vs fedavg"])
    assert result.exit_code == 0 and "| ppdg | fedavg | +2.50 | -2.00 | +0.00 | – | 1 | 1 |" in result.output
    for arguments in (["--differences"], ["--differences", "--baseline", "fedavg", "--format", "csv"]):
        result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", *arguments])
        assert result.exit_code == 2 and "Traceback" not in result.output and "--differences" in result.output


def test_a_baseline_algorithm_under_sweep_variants_is_the_baseline_within_each_variant():
    from fedbed.reporting import comparison_pairs

    labels = ["fedavg[mix0]", "fedavg[mix1]", "feddg_ga[mix0]", "feddg_ga[mix1]", "fedomg[mix0]"]
    assert comparison_pairs(labels, ["fedavg"]) == [
        ("feddg_ga[mix0]", "fedavg[mix0]"), ("feddg_ga[mix1]", "fedavg[mix1]"), ("fedomg[mix0]", "fedavg[mix0]")]
    # A label named in full is every other label's baseline, as without variants.
    assert comparison_pairs(labels, ["fedavg[mix0]"])[:2] == [("fedavg[mix1]", "fedavg[mix0]"),
                                                              ("feddg_ga[mix0]", "fedavg[mix0]")]
    with pytest.raises(ValueError, match="baseline 'ppdg' is not among the runs' labels"):
        comparison_pairs(labels, ["ppdg"])
    with pytest.raises(ValueError, match="baseline 'fedavg' is not among"):
        comparison_pairs(["fedavg(client_lr=0.1)", "ppdg(client_lr=0.1)"], ["fedavg"])
    # A grid's or a warm start's label keeps its variant; a label without a variant is not paired.
    assert comparison_pairs(["fedavg[mix0]", "feddg_ga[mix0](step_size=0.1)", "feddg_ga[mix0]{from fedavg@10}",
                             "feddg_ga"], ["fedavg"]) == [("feddg_ga[mix0](step_size=0.1)", "fedavg[mix0]"),
                                                          ("feddg_ga[mix0]{from fedavg@10}", "fedavg[mix0]")]


def test_holm_adjusts_by_hand():
    from fedbed.reporting import holm

    # Sorted 0.01, 0.02, 0.04, 0.30 (m = 4): 4 x 0.01 = 0.04; 3 x 0.02 = 0.06; 2 x 0.04 = 0.08; 1 x 0.30 = 0.30.
    assert holm([0.04, 0.30, 0.01, 0.02]) == pytest.approx([0.08, 0.30, 0.04, 0.06])
    # Step-down monotone: a later p never gets a smaller adjustment; capped at 1.
    assert holm([0.02, 0.021, 0.9]) == pytest.approx([0.06, 0.06, 0.9]) and holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([]) == []


def test_curves_have_markers_and_integer_round_ticks_and_alignment_plots_name_the_run(tmp_path):
    import json

    import matplotlib.pyplot as plt
    import yaml

    from fedbed.plots import _plot_mean_band, client_domains, run_title

    figure, axis = plt.subplots()
    _plot_mean_band(axis, [{"round": 1, "ood_mean": 50.0}], "ood_mean", "fedavg")
    assert axis.lines[0].get_marker() == "o"
    assert all(float(tick).is_integer() for tick in axis.get_xticks())
    plt.close(figure)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algorithm": "ppdg", "dataset": "PACS", "target": "photo", "seed": 2}))
    (tmp_path / "summary.json").write_text(json.dumps({"clients": [["art_painting"], ["cartoon"], ["sketch"]]}))
    assert run_title(tmp_path) == f"ppdg on PACS, target photo, seed 2 ({tmp_path.name})"
    assert client_domains(tmp_path, [0, 2]) == "0 = art_painting, 2 = sketch"


def two_folders(tmp_path):
    """Table 6's layout in small: ``seeds`` holds fedavg and mcgdm (RandAugment, the default) over seeds 0-2,
    ``am`` the mcgdm rows with Amplitude Mix and a copy of ``seeds``' seed-0 fedavg job (same hash, same files)."""
    import shutil

    randaugment = {"use_intra": False, "augmentation": "randaugment"}
    amplitude_mix = {"use_intra": False, "augmentation": "amplitude_mix"}
    write_sweep(tmp_path / "seeds", [("fedavg", {}, "sketch", 0, 50, 30.0), ("fedavg", {}, "sketch", 1, 52, 36.0),
                                     ("fedavg", {}, "sketch", 2, 54, 33.0),
                                     ("mcgdm", randaugment, "sketch", 0, 50, 31.0), ("mcgdm", randaugment, "sketch", 1, 50, 35.0),
                                     ("mcgdm", randaugment, "sketch", 2, 50, 34.0)],
                {"mcgdm": {"use_intra": [False, True]}}, names=["f0", "f1", "f2", "r0", "r1", "r2"])
    write_sweep(tmp_path / "am", [("mcgdm", amplitude_mix, "sketch", seed, 60, ood) for seed, ood in enumerate((35.0, 36.0, 40.0))],
                {"mcgdm": {"augmentation": ["amplitude_mix"], "use_intra": [False, True]}}, names=["a0", "a1", "a2"])
    shutil.copytree(tmp_path / "seeds" / "f0", tmp_path / "am" / "f0")
    return tmp_path / "seeds", tmp_path / "am"


def test_a_report_of_several_folders_pairs_their_runs_and_counts_a_copied_job_once(tmp_path):
    import json

    from typer.testing import CliRunner

    from fedbed.cli import app

    seeds, am = two_folders(tmp_path)
    alone = CliRunner().invoke(app, ["report", str(seeds), "--selection", "last"])
    assert alone.exit_code == 0 and "| mcgdm(use_intra=False) | 33.3 ± 2.1 |" in alone.output  # one folder: its grid's labels
    result = CliRunner().invoke(app, ["report", str(seeds), str(am), "--selection", "last", "--baseline", "fedavg"])
    assert result.exit_code == 0, result.output
    # The folders' records set augmentation differently: the labels name it, so the two mcgdm rows stay apart.
    assert "| mcgdm(augmentation=amplitude_mix, use_intra=False) | 37.0 ± 2.6 |" in result.output
    assert "| mcgdm(augmentation=randaugment, use_intra=False) | 33.3 ± 2.1 |" in result.output
    assert "| fedavg | 33.0 ± 3.0 |" in result.output and "9 runs" in result.output  # the copy counted once
    # Paired by seed across the folders: differences 5, 0, 7 from the Baseline; t = mean / (sd / sqrt(3)).
    differences = [5.0, 0.0, 7.0]
    sd = math.sqrt(sum((d - 4.0) ** 2 for d in differences) / 2)
    assert (f"| mcgdm(augmentation=amplitude_mix, use_intra=False) | fedavg | 3 | +4.00 | {4.0 / (sd / math.sqrt(3)):.2f} |"
            in result.output) and "| p | p, Holm over 2 |" in result.output
    compared = CliRunner().invoke(app, ["report", str(seeds), str(am), "--selection", "last", "--compare",
                                        "mcgdm(augmentation=amplitude_mix, use_intra=False) vs "
                                        "mcgdm(augmentation=randaugment, use_intra=False)"])
    assert "| randaugment, use_intra=False) | 3 | +3.67 |" in compared.output.replace("mcgdm(augmentation=", "")
    # The copy with other results is another run under one label, target and seed: refused, naming both.
    copy = am / "f0" / "summary.json"
    copy.write_text(json.dumps({**json.loads(copy.read_text()), "wall_seconds": 1.0}))
    refused = CliRunner().invoke(app, ["report", str(seeds), str(am), "--selection", "last"])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1
    assert f"{seeds / 'f0'} and {am / 'f0'} are both fedavg, target sketch, seed 0" in refused.output
    assert "the same job with other results" in refused.output and "Traceback" not in refused.output
    (am / "f0").rename(am / "f9")  # another job (other settings) under the same label, target and seed
    refused = CliRunner().invoke(app, ["report", str(seeds), str(am), "--selection", "last"])
    assert refused.exit_code == 2 and "other settings: job hashes f0 and f9" in refused.output


def test_a_report_shows_chosen_targets_labels_rules_and_seeds(tmp_path):
    from fedbed.reporting import build_report

    seeds, _ = two_folders(tmp_path)
    report = build_report(seeds, ["last", "oracle"], labels=["mcgdm(use_intra=False)", "fedavg"], targets=["sketch"],
                          per_seed=True)
    ood = report.tables["ood"]
    assert ood[0] == ["ood label (last, oracle (oracle: reads the target), ± std over seeds)",
                      "sketch, last, seed 0", "sketch, last, seed 1", "sketch, last, seed 2", "sketch, last, all seeds",
                      "sketch, oracle, seed 0", "sketch, oracle, seed 1", "sketch, oracle, seed 2", "sketch, oracle, all seeds"]
    assert ood[1] == ["mcgdm(use_intra=False)", "31.0", "35.0", "34.0", "33.3 ± 2.1", "31.0", "35.0", "34.0", "33.3 ± 2.1"]
    assert [row[0] for row in ood] [1:] == ["mcgdm(use_intra=False)", "fedavg"] and report.tables["id"][2][4] == "52.0 ± 2.0"
    for wrong, message in (({"targets": ["photo"]}, "target 'photo' is not among the runs' targets: sketch"),
                           ({"labels": ["ppdg"]}, "label 'ppdg' is not among the runs' labels: fedavg, mcgdm"),
                           ({"baselines": ["ppdg"]}, "baseline 'ppdg' is not among"),
                           ({"comparisons": ["fedavg against ppdg"]}, "--compare expects 'LABEL vs BASELINE'"),
                           ({"selections": ["best"]}, "unknown selection 'best'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            build_report(seeds, **{"selections": ["last"], **wrong})


def test_curves_draw_finished_runs_only_and_say_what_they_left_out(tmp_path, monkeypatch):
    import fedbed.plots as plots

    runs = [("fedavg", {}, "a", 0, 70, 30.0), ("fedavg", {}, "a", 1, 70, 10.0)]
    write_sweep(tmp_path / "sweep", runs, {}, logs=[[20.0, 30.0], [10.0, 10.0]])
    (tmp_path / "sweep" / "run1" / "summary.json").unlink()  # seed 1 is still running
    drawn, captions = [], []
    band = plots._plot_mean_band
    monkeypatch.setattr(plots, "_plot_mean_band", lambda axis, rows, key, label: (drawn.append(rows), band(axis, rows, key, label)))
    caption = plots._caption
    monkeypatch.setattr(plots, "_caption", lambda figure, notes: (captions.append(notes), caption(figure, notes)))
    written = plots.plot_sweep(tmp_path / "sweep", "last")
    assert [p.name for p in written] == ["curve_a.png", "domains_last.png"]
    # The ood and id curves of target a: seed 0's two rounds, nothing of the unfinished seed 1.
    assert [[(row["seed"], row["round"], row["ood_mean"]) for row in rows] for rows in drawn] == [[(0, 1, 20.0), (0, 2, 30.0)]] * 2
    assert all("left out: 1 unfinished run(s), without summary.json" in notes for notes in captions)
    with pytest.raises(ValueError, match="need a folder to go to"):
        plots.plot_sweep([tmp_path / "sweep", tmp_path / "sweep"])


def test_by_round_tables_show_each_evaluated_round_mean_over_seeds_and_the_chosen_runs(tmp_path):
    """``--by-round ood`` prints, per target, the ood mean at each evaluated round averaged over
    seeds (by hand: round 1 (20 + 10) / 2 = 15, std 7.1); a logged metric is shown at the same
    rounds; under ``--select-hparams`` the rows are the chosen runs' logs; an unknown quantity is
    refused in one line (exit 2)."""
    import json

    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.reporting import build_report

    runs = [("fedavg", {}, "a", 0, 70, 30.0), ("fedavg", {}, "a", 1, 70, 10.0),
            ("ppdg", {"lam": 0.1}, "a", 0, 80, 50.0), ("ppdg", {"lam": 1.0}, "a", 0, 60, 90.0),
            ("ppdg", {"lam": 0.1}, "b", 0, 80, 60.0)]
    write_sweep(tmp_path / "sweep", runs, {"ppdg": {"lam": [0.1, 1.0]}},
                logs=[[20.0, 30.0], [10.0, 10.0], [40.0, 50.0], [80.0, 90.0], [60.0]])
    log = tmp_path / "sweep" / "run0" / "rounds.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record, loss in zip(records, [2.5, 1.25]):
        record["metrics"] = {"train_loss": loss}
    log.write_text("".join(json.dumps(record) + "\n" for record in records))
    tables = build_report(tmp_path / "sweep", "last", by_round=["ood", "train_loss"]).tables
    assert tables["by_round:ood:a"] == [["ood by round, target a (± std over seeds)", "1", "2"],
                                        ["fedavg", "15.0 ± 7.1", "20.0 ± 14.1"],
                                        ["ppdg(lam=0.1)", "40.0", "50.0"], ["ppdg(lam=1.0)", "80.0", "90.0"]]
    assert tables["by_round:train_loss:a"][1] == ["fedavg", "2.500", "1.250"]  # seed 1 logged none
    assert tables["by_round:train_loss:a"][2] == ["ppdg(lam=0.1)", "–", "–"]
    # Target b: one evaluated round; the labels without a run there keep their rows.
    assert tables["by_round:ood:b"][1:] == [["fedavg", "–"], ["ppdg(lam=0.1)", "60.0"], ["ppdg(lam=1.0)", "–"]]
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--by-round", "ood", "--format", "csv"])
    assert result.exit_code == 2 and "the --by-round tables are markdown or latex" in result.output
    chosen = build_report(tmp_path / "sweep", "last", select_hparams=True, by_round=["ood"]).tables
    assert chosen["by_round:ood:a"][1:] == [["fedavg", "15.0 ± 7.1", "20.0 ± 14.1"], ["ppdg", "40.0", "50.0"]]  # lam 0.1: id 80
    assert chosen["by_round:ood:b"][1:] == [["fedavg", "–"], ["ppdg", "60.0"]]
    result = CliRunner().invoke(app, ["report", str(tmp_path / "sweep"), "--selection", "last", "--by-round", "nosuch"])
    assert result.exit_code == 2 and "--by-round nosuch: no shown run logged a metric of that name; choose ood, id or one of: " \
        "train_loss" in result.output
    assert "Traceback" not in result.output


def test_runs_whose_training_read_their_id_holdouts_are_named_once_per_label():
    """FedDG-GA's gap_samples: holdout scores the gap on the id-validation holdouts that the id
    score and train_domain_val read: the report names those labels with their run counts, from
    each run's recorded hp (so runs recorded before the note existed are named too); the default
    reading and runs without the hyperparameter are not named."""
    from fedbed.reporting import holdout_steering_notes

    def run(label, seed, **hp):
        return {"label": label, "target": "t1", "seed": seed, "hp": hp}

    runs = [run("feddg_ga[holdout-gap]", 0, gap_samples="holdout"), run("feddg_ga[holdout-gap]", 1, gap_samples="holdout"),
            run("fedsr+feddg_ga", 0, gap_samples="holdout", fedsr_l2=0.01), run("feddg_ga", 0, gap_samples="training"),
            run("fedavg", 0)]
    notes = holdout_steering_notes(runs)
    assert [note.split(":")[0] for note in notes] == ["id holdouts read by training (feddg_ga[holdout-gap], 2 runs)",
                                                       "id holdouts read by training (fedsr+feddg_ga, 1 run)"]
    assert all("train_domain_val" in note for note in notes)
    assert holdout_steering_notes([run("feddg_ga", 0, gap_samples="training"), {**run("fedavg", 0), "hp": None}]) == []


def test_evaluation_privacy_and_data_lines_count_their_runs_in_first_seen_order():
    """evaluation_notes gives one line per distinct statement in the order first seen, with "1 run"
    or "N runs"; a run may add an evaluation and a privacy line; data_sources counts runs per
    source (sorted) and flags a mix of sources or fingerprints."""
    from fedbed.reporting import data_sources, evaluation_notes

    probe = {"evaluation": {"note": "linear probe"}, "data_source": "PACS", "data_fingerprint": "aa"}
    private = {"privacy": {"note": "client-level (2, 1e-05)"}, "data_source": "PACS", "data_fingerprint": "aa"}
    both = {**probe, "privacy": private["privacy"], "data_source": "MNIST", "data_fingerprint": "bb"}
    assert evaluation_notes([private, probe, both, probe]) == ["privacy (2 runs): client-level (2, 1e-05)",
                                                                "evaluation (3 runs): linear probe"]
    assert evaluation_notes([probe]) == ["evaluation (1 run): linear probe"] and evaluation_notes([{}]) == []
    assert data_sources([probe, private]) == (["PACS (fingerprint aa): 2 runs"], False)
    lines, mixed = data_sources([private, both])
    assert lines == ["MNIST (fingerprint bb): 1 run", "PACS (fingerprint aa): 1 run"] and mixed
