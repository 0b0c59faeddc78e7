"""Shared fixtures (the real data beside the checkout, skipped with a reason when absent; tiny
synthetic data) and the ``slow`` marks of the quick loop. The helpers tests import are in
``tests/helpers.py``."""

from __future__ import annotations

import os
from pathlib import Path

# pytest-xdist runs the suite in worker processes (``addopts`` in pyproject.toml). Their torch
# and BLAS threads, and those of the processes the tests start, share the cores rather than
# oversubscribe them (two workers on two cores: one thread each; OpenMP and OpenBLAS threads
# waiting on a busy core spin and stall). The variables are set, over any value the shell gave,
# before torch loads numpy's OpenBLAS and before scikit-learn's OpenMP loads (each reads them once
# when it loads); threadpoolctl limits whatever a plugin loaded earlier. Without xdist (``-n0``)
# the one process keeps to TORCH_THREADS too.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
TORCH_THREADS = max(1, min(2, (os.cpu_count() or 1) // XDIST_WORKERS))
for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = str(TORCH_THREADS)

import pytest  # noqa: E402 (after the thread settings)
import torch  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from fedbed.data.base import DomainDataset  # noqa: E402
from tests.helpers import make_dataset  # noqa: E402

torch.set_num_threads(TORCH_THREADS)
threadpool_limits(limits=TORCH_THREADS)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The tests never reach the network: the Hugging Face libraries (datasets, huggingface_hub) read
# these when imported and then use their caches only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The tests the quick loop (``python -m pytest -q -m "not slow"``) leaves out: each was measured
# > 2 s (``python -m pytest -q -n 2 --durations=0``, 2026-11-26, 2 cores shared with other jobs),
# or belongs to a group the quick loop leaves out as a whole (processes of a local Flower
# federation, signals sent to subprocesses, the headless browser, the benchmarks' smoke runs).
# ``tests/test_x.py::name`` marks every parameter of a test, ``tests/test_x.py::name[id]`` one.
# ``python -m pytest -q`` (CI) runs them all.
SLOW_TESTS = {
    # A method's clients under a server rule: whole runs compared, a sweep of them
    "tests/test_composition.py::test_fedavg_on_either_side_equals_the_plain_method_bit_for_bit",
    "tests/test_composition.py::test_a_sweep_grid_holds_composed_methods_and_their_report_labels_them",
    "tests/test_server_rules.py::test_feddg_ga_resumes_its_weights_exactly",
    # Random hyperparameter search: a two-trial sweep run and reported
    "tests/test_hparam_search.py::test_a_tiny_search_runs_and_the_report_prints_the_chosen_values",
    # Warm starts named by another sweep: two small sweeps run
    "tests/test_init_from.py::test_a_sweep_starts_each_job_from_the_other_sweeps_run_of_its_own_target",
    # Flower: a local federation's processes, or the simulation
    "tests/test_flower.py::test_same_results_in_process_and_on_a_flower_deployment",
    "tests/test_flower.py::test_the_script_by_its_full_path_without_the_environment_on_path_and_sigterm_leaves_nothing",
    "tests/test_spread_data.py::test_a_deployment_whose_sites_each_hold_one_domain_equals_the_in_process_run",
    "tests/test_flower.py::test_a_run_on_the_simulation_validates_its_settings_once_drops_a_faulty_reply_and_equals_the_in_process_run",
    "tests/test_flower_sites.py::test_strangers_supernodes_take_no_part_in_a_tls_deployment_and_the_run_goes_on",
    "tests/test_flower_sites.py::test_a_silent_site_holds_discovery_up_for_a_bounded_time_a_lost_one_is_dropped_and_the_progress_reaches_flwr_log",
    "tests/test_flower_strategies.py::test_a_plain_pytorch_flower_app_trains_with_ppdg_and_feddg_ga_on_the_simulation",
    "tests/test_flower_strategies.py::test_with_fedbeds_trainer_on_the_clients_ppdg_equals_the_in_process_run_bit_for_bit",
    # signals sent to subprocesses; other subprocesses importing the package
    "tests/test_signals.py::test_a_signal_stops_an_in_process_run_which_resumes_from_its_checkpoint",
    "tests/test_signals.py::test_sigterm_stops_a_sweep_and_its_workers",
    "tests/test_architecture.py::test_an_in_process_run_does_not_import_flower",
    "tests/test_cli.py::test_the_fedbed_script_prints_one_line_and_exits_2[arguments2-error: unknown dataset 'Foo']",
    # the headless browser
    "tests/test_sweep.py::test_html_report_renders_in_headless_chromium",
    # the benchmarks at smoke size, each a subprocess
    "tests/test_benchmarks.py::test_benchmark_prints_its_figure_at_smoke_size",
    # the README's tour, every complete line run
    "tests/test_readme_tour.py::test_every_complete_line_of_the_tour_runs",
    # sweeps of several runs
    "tests/test_sweep.py::test_results_report_and_html",
    "tests/test_sweep.py::test_variants_change_one_factor_of_base_and_label_the_runs",
    "tests/test_sweep.py::test_sweep_skips_finished_jobs_and_resumes_an_interrupted_one",
    "tests/test_sweep.py::test_threads_per_job_default_to_cores_over_workers_and_can_be_set",
    "tests/test_sweep.py::test_sweep_processes_sharing_a_folder_never_run_the_same_job",
    "tests/test_sweep.py::test_results_as_data_without_side_effect_files",
    "tests/test_sweep.py::test_a_sweep_run_again_from_another_data_root_leaves_its_folder_unchanged",
    "tests/test_sweep.py::test_run_experiment_returns_the_run_as_data",
    "tests/test_sweep.py::test_a_sweep_refuses_finished_jobs_made_from_other_data_and_report_names_the_data",
    # multi-round runs (16 of its 21 algorithms measured > 2 s; the rest 1-2 s)
    "tests/test_algorithms.py::test_every_registered_algorithm_runs_two_rounds",
    # runs stopped and resumed, or run twice
    "tests/test_mcgdm.py::test_a_resumed_mcgdm_run_equals_an_uninterrupted_one",
    "tests/test_self_supervised.py::test_a_resumed_run_equals_an_uninterrupted_one",
    "tests/test_self_supervised.py::test_a_resumed_moco_run_equals_an_uninterrupted_one",
    "tests/test_fedadg.py::test_a_resumed_fedadg_run_equals_an_uninterrupted_one",
    "tests/test_augmentation.py::test_an_augmented_run_resumes_bit_identically",
    "tests/test_knowledge_vote.py::test_training_never_reads_the_adaptation_labels",
    "tests/test_robustness.py::test_median_resists_a_byzantine_client_where_fedavg_does_not",
    "tests/test_cli.py::test_plot_alignment_writes_pngs",
    "tests/test_cli.py::test_run_prints_the_table_and_resumes",
    "tests/test_cli.py::test_resume_and_run_directory_guards",
    "tests/test_cli.py::test_a_run_with_other_settings_is_never_replaced_without_overwrite",
    "tests/test_privacy.py::test_a_private_run_logs_epsilon_per_round_and_reports_it",
    "tests/test_fedgala.py::test_fedgala_logs_discard_ratios_and_weights_and_its_switches_work",
    "tests/test_fedgala.py::test_global_alignment_works_with_supervised_clients",
    "tests/test_training_hooks.py::test_the_cosine_schedule_sets_each_rounds_learning_rate",
    "tests/test_training_hooks.py::test_phases_with_their_own_optimisers_continue_the_batch_numbering",
    "tests/test_evaluation_protocols.py::test_a_report_of_probed_runs_says_they_read_target_labels",
    "tests/test_evaluation_protocols.py::test_the_accuracy_plots_of_probed_runs_carry_the_note_that_they_read_target_labels",
    "tests/test_fedadg.py::test_feature_plot_of_a_tiny_run[fedadg]",
    "tests/test_faults.py::test_each_fault_is_dropped_with_its_reason_and_the_model_stays_finite[slow]",
    "tests/test_client_evaluation.py::test_scores_on_the_clients_equal_the_servers",
    "tests/test_bit_identity.py::test_a_short_run_computes_its_recorded_numbers[hfedf]",
    "tests/test_bit_identity.py::test_a_short_run_computes_its_recorded_numbers[local]",
    "tests/test_bit_identity.py::test_a_short_run_computes_its_recorded_numbers[fedsimclr_probe]",
    "tests/test_bit_identity.py::test_a_short_run_computes_its_recorded_numbers[mcgdm_adam]",
    # the seed papers' configs, each run for one step at 32 px (ResNet-18, DenseNet-121)
    "tests/test_paper_configs.py::test_each_paper_config_runs_one_round_of_one_step_on_the_cpu",
    # real data (MNIST read in full or parsed twice, a packed file resized)
    "tests/test_data.py::test_embedded_mnist_sample_equals_mlxtends_own_parse",
    "tests/test_data.py::test_shared_mnist_gives_the_full_dataset",
    "tests/test_data.py::test_a_model_for_another_input_size_reads_the_packed_file_resized",
    # a Hugging Face dataset: two tiny runs, the first packing it, the second reading the packed copy
    "tests/test_hugging_face_data.py::test_a_save_to_disk_copy_trains_once_packed_and_a_second_run_reads_the_packed_copy",
    # experiment trackers: a tiny run tracked by each tool and read back, one failing, exports (the tools' imports)
    "tests/test_tracking.py::test_tensorboard_logs_a_live_run_a_resumption_and_an_export_alike",
    "tests/test_tracking.py::test_mlflow_logs_a_live_run_into_its_tracking_uri",
    "tests/test_tracking.py::test_wandb_logs_a_live_run_offline",
    "tests/test_tracking.py::test_a_tracker_failing_mid_run_is_told_once_and_the_run_goes_on",
    "tests/test_tracking.py::test_export_replays_every_finished_run_of_a_sweep_folder",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(config, items):
    """Mark the tests :data:`SLOW_TESTS` names ``slow``; a name that names no test of a collected
    file (a test renamed or removed) is an error, so the quick loop never quietly grows."""
    collected = {}
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if item.nodeid in SLOW_TESTS or f"{path}::{name.split('[')[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if getattr(item, "module", None) is not None:
            collected[path] = item.module
    for entry in SLOW_TESTS:
        path, _, name = entry.partition("::")
        if path in collected and not callable(getattr(collected[path], name.split("[")[0], None)):
            raise pytest.UsageError(f"tests/conftest.py: SLOW_TESTS names {entry}, which {path} does not define")


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the project checkout."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not present at {SHARED_DATA} (see README, 'Datasets')")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _no_data_root_from_environment(monkeypatch):
    """Tests choose their data root explicitly."""
    monkeypatch.delenv("FEDBED_DATA", raising=False)


@pytest.fixture
def tiny_dataset() -> DomainDataset:
    return make_dataset()
