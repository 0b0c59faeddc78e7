"""Bad input through the Python API and sweep files: one typed error with a one-line message,
raised before anything is written or run (the command line's battery is in test_cli.py)."""

import pytest
import yaml

from fedbed.config import ConfigError
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.sweep import load_sweep_file, run_sweep


@pytest.mark.parametrize("settings, message", [
    ({"dataset": "Foo"}, "unknown dataset 'Foo'"),
    ({"algorithm": "fedfoo"}, "unknown algorithm 'fedfoo'"),
    ({"target": "90"}, "RotatedMNIST has no domain '90'"),
    ({"model": "resnet1000"}, "unknown model 'resnet1000'"),
    ({"hp": {"lambda": 0.1}}, "fedavg has no hyperparameter 'lambda'"),
    ({"rounds": 0}, "rounds: Input should be greater than 0"),
    ({"learning_rate": 3}, "unknown setting 'learning_rate'"),
    ({"local_epochs": 1, "local_steps": 1}, "give local_epochs or local_steps, not both"),
    ({"data_root": "/nonexistent/folder"}, "does not exist"),
    ({"client_timeout": -1}, "client_timeout: Input should be greater than 0"),
    ({"update_norm_factor": 0.5}, "update_norm_factor: Input should be greater than 1"),
    ({"robust_aggregation": "mean"}, "robust_aggregation: Input should be 'median', 'trimmed_mean', 'krum' or 'multi_krum'"),
    ({"trimmed_fraction": 0.2}, "trimmed_fraction applies to robust_aggregation: trimmed_mean only"),
    ({"robust_aggregation": "trimmed_mean", "trimmed_fraction": 0.5}, "trimmed_fraction: Input should be less than 0.5"),
    ({"robust_aggregation": "trimmed_mean", "trimmed_fraction": 0.1}, "trims no client of the 5 a round"),
    ({"robust_aggregation": "krum", "byzantine_clients": 2}, "at least 2f + 3 = 7 clients a round; this run has 5"),
    ({"robust_aggregation": "median", "participation_fraction": 0.4}, "median needs at least 3 clients a round, this run has 2"),
    ({"robust_aggregation": "median", "algorithm": "ppdg"}, "ppdg's server needs each client's own update"),
    ({"differential_privacy": {"clipping_norm": 1.0, "noise_multiplier": 1.0}, "algorithm": "hfedf"},
     "hfedf's server needs each client's own update (it is not compatible with secure aggregation), so differential_privacy"),
    ({"differential_privacy": {"clipping_norm": 1.0}}, "differential_privacy.noise_multiplier: Field required"),
    ({"differential_privacy": {"clipping_norm": 1.0, "noise_multiplier": 1.0, "sigma": 2}}, "unknown setting 'differential_privacy.sigma'"),
    ({"differential_privacy": {"clipping": "everywhere", "clipping_norm": 1.0, "noise_multiplier": 1.0}},
     "differential_privacy.clipping: Input should be 'server' or 'client'"),
    ({"differential_privacy": {"clipping_norm": 1.0, "noise_multiplier": 1.0}, "robust_aggregation": "median"},
     "it cannot be combined with robust_aggregation"),
    ({"attack": "nonsense"}, "attack: Input should be 'exception'"),
    ({"attacking_clients": 1}, "attacking_clients applies with an attack only"),
    ({"attack": "sign_flip_scale10", "attacking_clients": 6}, "attacking_clients is 6, but the run has 5 client(s)"),
    ({"dirichlet_alpha": 0.5}, "dirichlet_alpha applies to partition: dirichlet only (this run's partition is domain)"),
    ({"partition": "dirichlet", "dirichlet_alpha": 0}, "dirichlet_alpha: Input should be greater than 0"),
    ({"partition": "dirichlet", "num_clients": 500, "dirichlet_alpha": 0.05}, "of 500 clients without a training sample"),
])
def test_the_python_api_raises_one_config_error(settings, message, tmp_path):
    with pytest.raises(ConfigError) as raised:
        run_experiment(ExperimentConfig(run_dir=tmp_path / "run", **settings), progress=False, echo=lambda *_: None)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


BASE = {"dataset": "RotatedMNIST", "model": "lenet", "rounds": 1, "local_steps": 1}


@pytest.mark.parametrize("sweep, message", [
    ({"algorithms": ["fedavg"], "colour": "blue"}, "colour: Extra inputs are not permitted"),
    ({"algorithms": []}, "algorithms: List should have at least 1 item"),
    ({"algorithms": ["fedprox"], "hp": {"fedprox": {"mu": []}}}, "hp.fedprox.mu lists no value"),
    ({"algorithms": ["fedavg"], "seeds": []}, "seeds: List should have at least 1 item"),
    ({"algorithms": ["fedavg"], "base": {**BASE, "learning_rate": 1}}, "unknown setting 'learning_rate'"),
    ({"algorithms": ["fedavg", "fedprox"], "hp": {"fedprox": {"mu": [0.1, -1]}}}, "fedprox hyperparameter mu"),
    ({"algorithms": ["fedavg", "ppdg"], "variants": {"private": {"differential_privacy": {"clipping_norm": 1, "noise_multiplier": 1}}}},
     "ppdg's server needs each client's own update"),
    ({"algorithms": ["fedavg"], "targets": ["0", "90"]}, "RotatedMNIST has no domain '90'"),
])
def test_a_bad_sweep_is_refused_before_any_job_runs(sweep, message, tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "base": BASE, **sweep}))
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as raised:
        run_sweep(load_sweep_file(path), out, progress=False)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not out.exists()


@pytest.mark.parametrize("backend, options, message", [
    ("flower-cloud", {}, "unknown backend 'flower-cloud'; choose one of in-process, flower-sim, flower-deployment"),
    ("flower-sim", {"resume": True}, "--resume works in-process only: on flower-sim the client states live on the clients' nodes"),
    ("in-process", {"tls": True}, "--tls applies to --backend flower-deployment only"),
    ("in-process", {"overwrite": True, "resume": True}, "--overwrite deletes the run that --resume would continue"),
])
def test_the_python_api_refuses_a_backend_option_as_the_command_line(backend, options, message, tmp_path):
    from fedbed.backends import run_on_backend

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("rounds: 1\n")  # an earlier run: overwrite would delete it
    with pytest.raises(ConfigError) as raised:
        run_on_backend(ExperimentConfig(run_dir=tmp_path / "run"), backend, progress=False, echo=lambda *_: None, **options)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert (tmp_path / "run" / "config.yaml").exists()
