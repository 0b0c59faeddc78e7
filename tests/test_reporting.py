import math

import pytest

from fedbed.reporting import format_spread, mean_std_se, ood_table, paired_pairs, paired_t_test


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


def write_sweep(folder, runs, grid, logs=None):
    """A sweep folder with a record varying ``grid`` and one run folder per (algorithm, hp, target, seed, id, ood);
    ``logs``, if given, holds per run the ood accuracies of its evaluated rounds (its ``rounds.jsonl``)."""
    import json

    import yaml

    folder.mkdir()
    (folder / "sweep.yaml").write_text(yaml.safe_dump({"name": "s", "algorithms": ["ppdg", "fedavg"], "hp": grid}))
    for number, (algorithm, hp, target, seed, id_score, ood) in enumerate(runs):
        run = folder / f"run{number}"
        run.mkdir()
        scores = {rule: {"id_mean": id_score, "ood_mean": ood} for rule in ("last", "train_domain_val", "oracle")}
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
    assert "| fedavg | 17.0 ± 7.1 | 17.0 |" in result.output and "(last_five_mean, ± std over seeds)" in result.output
    assert "| fedavg | 20.0 ± 14.1 | 20.0 |" in CliRunner().invoke(app, ["report", str(tmp_path / "sweep"),
                                                                         "--selection", "last"]).output
    write_sweep(tmp_path / "unlogged", runs, {})  # summaries without their rounds.jsonl
    result = CliRunner().invoke(app, ["report", str(tmp_path / "unlogged"), "--selection", "last_five_mean"])
    assert result.exit_code == 2 and "is missing or holds no evaluation; choose --selection last" in result.output
    assert "Traceback" not in result.output


def test_select_hparams_chooses_by_source_validation_per_target(tmp_path):
    from fedbed.reporting import sweep_tables

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


def test_a_t_test_of_identical_columns_says_why_it_is_undefined():
    from fedbed.reporting import t_test_rows

    runs = [{**summary(label, target, 0, ood), "label": label}
            for label, shift in (("a", 0.0), ("b", 0.0)) for target, ood in (("t1", 10.0), ("t2", 20.0))]
    rows = t_test_rows(runs, ["a", "b"], "a", "last")
    assert rows[1] == ["b", "2", "+0.00", "undefined", "undefined: the paired differences do not vary"]


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
