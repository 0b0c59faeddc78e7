"""Random hyperparameter search in sweep files: reproducible draws, independent of the other
methods, trial 0 the defaults, the declared bounds, unchanged grid jobs, and selection in reports."""

import json
import random
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedbed.algorithms import ALGORITHMS, AlgorithmError, get_algorithm, resolve_hyperparameters
from fedbed.algorithms.base.search_space import (Choice, HyperparameterTrial, LogUniform, Uniform, declared_search_space,
                                                 draw_trial)
from fedbed.cli import app
from fedbed.config import ConfigError, validate
from fedbed.run_directory import DONE_MARKER
from fedbed.sweep import SweepSpec, expand, load_sweep_file, sweep_record

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def search_spec(algorithms, trials=4, seed=0, **changes) -> SweepSpec:
    values = dict(name="search", base={"dataset": "RotatedMNIST", "model": "lenet", "rounds": 1, "local_steps": 1,
                                       "batch_size": 16},
                  algorithms=algorithms, targets=["0"], seeds=[0], hparams={"search": "random", "trials": trials, "seed": seed})
    values.update(changes)
    return SweepSpec(**values)


def jobs_of(spec: SweepSpec, algorithm: str, folder: Path) -> list:
    return [job for job in expand(spec, folder) if job.algorithm == algorithm]


def test_draws_are_reproducible_and_independent_of_the_other_methods_in_the_sweep(tmp_path):
    alone = jobs_of(search_spec(["fedprox"]), "fedprox", tmp_path)
    among_others = jobs_of(search_spec(["ppdg", "fedavg", "fedprox", "fedsr"]), "fedprox", tmp_path)
    assert [job.hp for job in alone] == [job.hp for job in among_others]
    assert [job.run_dir.name for job in alone] == [job.run_dir.name for job in among_others]
    assert [job.hparams_trial.trial for job in alone] == [0, 1, 2, 3]
    drawn = [job.hp for job in alone[1:]]
    assert all(set(hp) == {"client_lr", "client_weight_decay", "mu"} for hp in drawn)
    assert len({hp["mu"] for hp in drawn}) == 3  # each trial its own draw
    # Another search seed draws other values, and its jobs are other jobs.
    other = jobs_of(search_spec(["fedprox"], seed=1), "fedprox", tmp_path)
    assert [job.hp for job in other[1:]] != drawn
    assert not {job.run_dir.name for job in other} & {job.run_dir.name for job in alone}
    # Every target and seed runs the same trials; a trial's draws do not depend on the other names drawn.
    both = expand(search_spec(["fedprox"], targets=["0", "15"], seeds=[0, 1]), tmp_path)
    assert all([job.hp for job in both if (job.target, job.seed) == key] == [job.hp for job in alone]
               for key in [("0", 1), ("15", 0), ("15", 1)])
    space = get_algorithm("fedprox").search_space()
    assert draw_trial({"mu": space["mu"]}, 0, "fedprox", 2)["mu"] == drawn[1]["mu"]


def test_trial_zero_runs_the_method_defaults_and_every_trial_is_recorded(tmp_path):
    for algorithm in ["fedavg", "fedprox", "ppdg", "fedsr"]:
        first = jobs_of(search_spec([algorithm], trials=2), algorithm, tmp_path)[0]
        assert first.hp == {} and first.hparams_trial.model_dump() == {"search": "random", "seed": 0, "trial": 0}
        method = get_algorithm(algorithm)
        assert validate(first).hparams == resolve_hyperparameters(method, {}, "RotatedMNIST")
    # PPDG's paper value on RotatedMNIST is its default there, so trial 0 runs it.
    assert validate(jobs_of(search_spec(["ppdg"]), "ppdg", tmp_path)[0]).hparams.alignment_lambda == 0.001


def test_draws_stay_inside_the_declared_distributions_and_their_sources():
    searchable = {name: cls() for name, cls in ALGORITHMS.items()}
    declared = {}
    for name, method in searchable.items():
        try:
            declared[name] = method.search_space()
        except AlgorithmError:
            continue
    assert {"fedavg", "fedprox", "ppdg", "fedsr"} <= set(declared)
    for name, space in declared.items():
        method = searchable[name]
        defaults = resolve_hyperparameters(method, {}).model_dump()
        for key, distribution in space.items():
            assert distribution.source, f"{name}.{key} has no source for its range"
            assert distribution.contains(defaults[key]), f"{name}'s default {key}={defaults[key]} is outside {distribution}"
        for trial in range(1, 41):
            values = draw_trial(space, 7, name, trial)
            assert set(values) == set(space)
            for key, value in values.items():
                assert space[key].contains(value), f"{name} trial {trial}: {key}={value} outside {space[key]}"
            resolve_hyperparameters(method, values)  # within the fields' own constraints
    # The shared training settings come from DomainBed's registry; the run's budget is not searched.
    shared = declared["fedavg"]
    assert shared["client_lr"] == LogUniform(10 ** -4.5, 10 ** -2.5, source=shared["client_lr"].source)
    assert shared["client_weight_decay"] == LogUniform(1e-6, 1e-2, source=shared["client_weight_decay"].source)
    assert "hparams_registry" in shared["client_lr"].source
    assert not {"batch_size", "local_epochs", "rounds"} & set().union(*declared.values())


def test_distributions_sample_their_whole_range():
    generator = random.Random(0)
    log = LogUniform(1e-4, 1e-2, source="test")
    draws = [log.sample(generator) for _ in range(2000)]
    assert min(draws) >= 1e-4 and max(draws) <= 1e-2
    assert 0.4 < sum(value < 1e-3 for value in draws) / len(draws) < 0.6  # uniform in the exponent: median 1e-3
    uniform = Uniform(0.3, 0.7, source="test")
    draws = [uniform.sample(generator) for _ in range(2000)]
    assert 0.4 < sum(value < 0.5 for value in draws) / len(draws) < 0.6
    choice = Choice([1, 2, 3], source="test")
    assert {choice.sample(generator) for _ in range(200)} == {1, 2, 3}
    with pytest.raises(ValueError, match="0 < low < high"):
        LogUniform(0.0, 1.0, source="test")
    with pytest.raises(ValueError, match="source"):
        Uniform(0.0, 1.0, source="")


def test_a_method_without_declared_distributions_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"^mcgdm declares no hyperparameter search distributions \(MCGDMHyperparameters"):
        expand(search_spec(["fedavg", "mcgdm"]), tmp_path)
    with pytest.raises(ConfigError, match="mcgdm declares no"):  # a composed method needs both sides'
        expand(search_spec(["mcgdm+ppdg"]), tmp_path)
    composed = get_algorithm("fedprox+fedgma").search_space()
    assert {"mu", "mask_threshold", "server_learning_rate", "client_lr"} <= set(composed)
    spec_file = tmp_path / "search.yaml"
    spec_file.write_text(yaml.safe_dump(search_spec(["mcgdm"]).model_dump(mode="json")))
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2 and "mcgdm declares no hyperparameter search distributions" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    # A class that declares nothing of its own is not searched through its base's declaration.
    from fedbed.algorithms.mcgdm import MCGDMHyperparameters

    assert "search_space" not in vars(MCGDMHyperparameters)
    with pytest.raises(ValueError, match="MCGDMHyperparameters.search_space"):
        declared_search_space(MCGDMHyperparameters, "mcgdm")


@pytest.mark.parametrize("hparams, hp, message", [
    ({"search": "random"}, {}, "search: random needs trials"),
    ({"search": "random", "trials": 0}, {}, "trials: Input should be greater than or equal to 1"),
    ({"search": "grid", "trials": 4}, {}, "trials and seed apply to search: random"),
    ({"search": "grid", "draws": "common"}, {}, "draws applies to search: random"),
    ({"search": "random", "trials": 4, "draws": "shared"}, {}, "hparams.draws"),
    ({"search": "bayes", "trials": 4}, {}, "hparams.search"),
    ({"search": "random", "trials": 4}, {"fedprox": {"mu": [0.1, 1.0]}}, "a random search draws the hyperparameters"),
])
def test_bad_search_settings_are_one_line(tmp_path, hparams, hp, message):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump({"algorithms": ["fedprox"], "hp": hp, "hparams": hparams}))
    with pytest.raises(ConfigError, match="sweep file") as error:
        load_sweep_file(spec_file)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_common_draws_give_every_method_the_same_shared_values_and_new_jobs_but_trial_zero(tmp_path):
    """``draws: common``: in each trial the four methods draw the learning rate and weight decay
    they share (the same distributions) from the same random numbers, so the values are equal; a
    method's own hyperparameter is drawn as by ``draw_trial(..., draws="common")``. Trial 0 draws
    nothing and stays the same job; the drawn trials are new jobs, labelled ``draws=common``."""
    from fedbed.results import run_label, search_trial

    methods = ["fedavg", "fedprox", "ppdg", "fedsr"]
    common = search_spec(methods, hparams={"search": "random", "trials": 4, "seed": 0, "draws": "common"})
    per_method = search_spec(methods)
    jobs = {method: jobs_of(common, method, tmp_path) for method in methods}
    for trial in range(1, 4):
        shared = {(jobs[m][trial].hp["client_lr"], jobs[m][trial].hp["client_weight_decay"]) for m in methods}
        assert len(shared) == 1  # one (learning rate, weight decay) per trial for every method
    assert len({jobs["fedavg"][trial].hp["client_lr"] for trial in range(1, 4)}) == 3  # each trial its own draw
    separate = {method: jobs_of(per_method, method, tmp_path) for method in methods}
    assert len({separate[m][1].hp["client_lr"] for m in methods}) == 4  # DomainBed's: each method its own
    space = get_algorithm("fedprox").search_space()
    assert jobs["fedprox"][2].hp["mu"] == draw_trial({"mu": space["mu"]}, 0, "ppdg", 2, draws="common")["mu"]
    assert jobs["fedprox"][2].hp["mu"] != separate["fedprox"][2].hp["mu"]
    for method in methods:
        assert jobs[method][0].run_dir.name == separate[method][0].run_dir.name  # the defaults: one job
        assert not {job.run_dir.name for job in jobs[method][1:]} & {job.run_dir.name for job in separate[method]}
    assert jobs["fedavg"][1].hparams_trial.draws == "common" and jobs["fedavg"][0].hparams_trial.draws is None
    assert yaml.safe_load(sweep_record(common))["hparams"]["draws"] == "common"
    assert "draws" not in yaml.safe_load(sweep_record(per_method))["hparams"]
    record = {"hparams_trial": jobs["fedavg"][1].hparams_trial.model_dump(mode="json")}
    assert run_label("fedavg", {}, [], trial=search_trial(record)) == "fedavg(trial=1, draws=common)"
    assert run_label("fedavg", {}, [], trial=search_trial({"hparams_trial": {"seed": 0, "trial": 1}})) == "fedavg(trial=1)"
    with pytest.raises(ValueError, match="draws must be one of per_method, common"):
        draw_trial(space, 0, "fedprox", 1, draws="shared")
    with pytest.raises(ValueError, match="trial 0 runs the defaults and draws nothing"):
        HyperparameterTrial(seed=0, trial=0, draws="common")


def test_a_value_the_sweep_sets_is_held_and_not_drawn(tmp_path):
    free = jobs_of(search_spec(["fedprox"]), "fedprox", tmp_path)
    base = search_spec(["fedprox"]).base
    held = jobs_of(search_spec(["fedprox"], base={**base, "hp": {"client_lr": 0.01}}), "fedprox", tmp_path)
    assert all(job.hp["client_lr"] == 0.01 for job in held)
    assert [{k: v for k, v in job.hp.items() if k != "client_lr"} for job in held] == \
           [{k: v for k, v in job.hp.items() if k != "client_lr"} for job in free]
    with pytest.raises(ValueError, match="'hparams_trial' is set per job"):
        search_spec(["fedprox"], base={"hparams_trial": {"seed": 0, "trial": 1}})


def test_grid_sweeps_keep_their_jobs_and_records(tmp_path):
    spec = load_sweep_file(ROOT / "docs" / "sweeps" / "rmnist-ppdg-converged.yaml")
    explicit = SweepSpec(**{**spec.model_dump(), "hparams": {"search": "grid"}})
    assert [job.run_dir.name for job in expand(spec, tmp_path)] == [job.run_dir.name for job in expand(explicit, tmp_path)]
    assert all(job.hparams_trial is None for job in expand(spec, tmp_path))
    assert "hparams" not in yaml.safe_load(sweep_record(spec))
    committed = ROOT / "results" / "sweeps" / "rmnist-ppdg-converged"
    if committed.is_dir():  # the committed jobs are still this sweep's (tests/test_sweep.py checks every folder)
        names = {job.run_dir.name for job in expand(explicit, committed)}
        assert {marker.parent.name for marker in committed.glob(f"*/{DONE_MARKER}")} <= names
    # The study's sweep file expands to 8 trials of every method.
    tuned = load_sweep_file(ROOT / "docs" / "sweeps" / "rmnist-tuned.yaml")
    jobs = expand(tuned.model_copy(update={"targets": ["0"], "seeds": [0]}), tmp_path)
    assert [(job.algorithm, job.hparams_trial.trial) for job in jobs] == [
        (algorithm, trial) for algorithm in ["fedavg", "fedprox", "ppdg", "fedsr"] for trial in range(8)]
    assert yaml.safe_load(sweep_record(tuned))["hparams"] == {"search": "random", "trials": 8, "seed": 0}


def test_a_tiny_search_runs_and_the_report_prints_the_chosen_values(tmp_path):
    spec_file = tmp_path / "search.yaml"
    spec = search_spec(["fedprox"], trials=2)
    spec.base["participation_fraction"] = 0.4  # 2 of the 5 clients train: the test reads records, not accuracy
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(spec_file), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    summaries = [json.loads(path.read_text()) for path in sorted(out.glob("*/summary.json"))]
    assert sorted((s["algorithm"], s["hparams_trial"]["trial"]) for s in summaries) == [("fedprox", 0), ("fedprox", 1)]
    configs = [yaml.safe_load(path.read_text()) for path in out.glob("*/config.yaml")]
    assert all(config["hparams_trial"]["seed"] == 0 for config in configs)
    # recorded as before common draws existed, so a search's unfinished runs resume under this code
    assert all(set(config["hparams_trial"]) == {"search", "seed", "trial"} for config in configs)
    assert all(set(s["hparams_trial"]) == {"search", "seed", "trial"} for s in summaries)
    stored = runner.invoke(app, ["results", str(out)])  # results.sqlite labels the trials as the reports do
    assert stored.exit_code == 0 and "fedprox(trial=0)" in stored.output and "fedprox(trial=1)" in stored.output
    plain = runner.invoke(app, ["report", str(out), "--selection", "last"])
    assert plain.exit_code == 0, plain.output
    for label in ["fedprox(trial=0)", "fedprox(trial=1)"]:
        assert f"| {label} |" in plain.output
    chosen = runner.invoke(app, ["report", str(out), "--selection", "last", "--select-hparams"])
    assert chosen.exit_code == 0, chosen.output
    rows = [line.split(" | ") for line in chosen.output.splitlines() if line.startswith("| fedprox | 0 |")]
    assert len(rows) == 1
    _, _, label, values, _, candidates = (cell.strip(" |") for cell in rows[0])
    by_trial = {s["hparams_trial"]["trial"]: s for s in summaries if s["algorithm"] == "fedprox"}
    trial = int(label.removeprefix("fedprox(trial=").removesuffix(")"))
    winner = by_trial[trial]
    assert winner["selection"]["last"]["id_mean"] == max(s["selection"]["last"]["id_mean"] for s in by_trial.values())
    assert values == ", ".join(f"{key}={winner['hp'][key]:.3g}" for key in ["client_lr", "client_weight_decay", "mu"])
    assert candidates == "2"
    per_seed = runner.invoke(app, ["report", str(out), "--selection", "last", "--select-hparams", "--select-per-seed"])
    assert per_seed.exit_code == 0 and "| fedprox | 0 | 0 |" in per_seed.output
    refused = runner.invoke(app, ["report", str(out), "--select-per-seed"])
    assert refused.exit_code == 2 and "give --select-hparams too" in refused.output
