"""Data spread over machines: each site's data root holds only its own domain, the server's only
the target; declared domain and class names make every machine number them alike, and each
builds exactly the part of the run that a machine holding everything builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedbed.config import ConfigError, ExperimentConfig, config_from_mapping
from fedbed.experiment import build_run, run_experiment
from fedbed.flower.apps import config_json_from_run_config, settings_as_run_config
from fedbed.run_directory import LOG_NAME
from tests.test_own_data import make_tree

LAYOUT = {"alps": {"yak": 3, "ibex": 4}, "coast": {"yak": 5, "ibex": 2}, "delta": {"yak": 3, "ibex": 3}}
DECLARED = dict(domain_names=["alps", "coast", "delta"], class_names=["yak", "ibex"])  # not sorted: the declared order rules


def config(dataset: Path, **changes) -> ExperimentConfig:
    values = dict(dataset=str(dataset), target="delta", rounds=1, local_steps=1, batch_size=4, image_size=8,
                  model="mnist_cnn", holdout_fraction=0.25, seed=5, **DECLARED)
    return ExperimentConfig(**{**values, **changes})


@pytest.fixture
def machines(tmp_path):
    """The whole data on one machine, and the same images spread: one folder per site, the
    target's on the server."""
    whole = make_tree(tmp_path / "whole" / "herds", LAYOUT)
    spread = {domain: make_tree(tmp_path / domain / "herds", {domain: classes}) for domain, classes in LAYOUT.items()}
    return whole, spread


def test_each_site_builds_its_client_exactly_as_a_machine_holding_every_domain(machines):
    whole, spread = machines
    everything = build_run(config(whole))
    for client, domain in enumerate(("alps", "coast")):
        site = build_run(config(spread[domain]))
        assert site.dataset.present_domains() == (client,)
        for part in ("client_data", "client_holdout"):
            mine, theirs = getattr(site, part)(client), getattr(everything, part)(client)
            assert torch.equal(mine.images[:], theirs.images[:]) and torch.equal(mine.targets, theirs.targets)
        other = 1 - client
        with pytest.raises(ConfigError, match=f"holds no sample of {('alps', 'coast')[other]}, which client {other} needs"):
            site.client_data(other)
    # Labels follow the declared order (yak 0, ibex 1), not the sorted folder names (ibex, yak).
    alps = build_run(config(spread["alps"])).dataset
    assert alps.class_names == ("yak", "ibex") and int((alps.labels == 0).sum()) == 3


def test_the_server_needs_only_the_target_and_scores_the_id_holdouts_on_the_sites(machines):
    whole, spread = machines
    server = build_run(config(spread["delta"], id_evaluation="clients"))
    federation = server.federation(clients=None)
    expected = build_run(config(whole, id_evaluation="clients")).federation(clients=None)
    (target_id,) = federation.target
    assert torch.equal(federation.target[target_id].images[:], expected.target[target_id].images[:])
    assert torch.equal(federation.target[target_id].targets, expected.target[target_id].targets)
    with pytest.raises(ConfigError, match="server's id evaluation .*id_evaluation: clients"):
        build_run(config(spread["delta"])).federation(clients=None)
    with pytest.raises(ConfigError, match="holds no sample of delta, which the server"):
        build_run(config(spread["alps"], id_evaluation="clients")).federation(clients=None)


def test_a_run_on_one_machine_refuses_data_that_lacks_a_domain(machines, tmp_path):
    _, spread = machines
    with pytest.raises(ConfigError, match="holds no sample of alps, delta, which a run on one machine"):
        run_experiment(config(spread["coast"], run_dir=tmp_path / "run"), progress=False, echo=lambda *_: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(domain_names=["alps", "delta"]), r"holds the domain\(s\) coast, which are not among the declared domain_names"),
    (dict(class_names=["yak"]), r"class\(es\) ibex are not among the declared class_names"),
    (dict(class_names=None), "declare class_names so that every machine numbers the classes alike"),
    (dict(domain_names=None), "declare them all with domain_names"),
    (dict(domain_names=["alps", "coast", "alps"]), "repeated: alps"),
    (dict(partition="lambda_mix", num_clients=4), "partition: lambda_mix needs every domain on one machine"),
    (dict(algorithm="central"), "central .*needs every domain on one machine"),
])
def test_declared_names_that_do_not_fit_are_refused_with_one_line(machines, changes, message):
    _, spread = machines
    with pytest.raises(ConfigError, match=message):
        build_run(config(spread["coast"], **changes))


def test_a_dataset_known_by_name_keeps_its_own_domains(tmp_path):
    with pytest.raises(ConfigError, match="VLCS's domains are Caltech101, LabelMe, SUN09, VOC2007"):
        build_run(ExperimentConfig(dataset="VLCS", target="VOC2007", data_root=tmp_path, domain_names=["a", "b"],
                                   class_names=["x"]))


def test_declared_names_travel_in_flowers_run_config_as_json_text(machines):
    whole, _ = machines
    original = config(whole)
    entries = settings_as_run_config(original)
    assert entries["fedbed.class_names"] == json.dumps(["yak", "ibex"])
    assert config_from_mapping(json.loads(config_json_from_run_config(entries))) == original


def test_a_deployment_whose_sites_each_hold_one_domain_equals_the_in_process_run(tmp_path, monkeypatch):
    """Three SuperNodes, each with a data root holding only its own VLCS domain; the server's
    holds only the target; the run equals the in-process run on the whole data. The method is
    FedADG's clients under FedDG-GA's server rule: FedADG's discriminator and random projection,
    and FedDG-GA's last local risk, live in each site's state (the SuperNode's context.state),
    never leave it and carry over to the next round there: the discriminator losses match in both
    rounds, and round 2's generalization gaps."""
    from fedbed.flower.deployment import run_flower_deployment

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    domains = ("Caltech101", "LabelMe", "SUN09", "VOC2007")
    layout = {domain: {"bird": 3 + i, "car": 4} for i, domain in enumerate(domains)}
    make_tree(tmp_path / "whole" / "VLCS", layout)
    roots = {domain: make_tree(tmp_path / domain / "VLCS", {domain: layout[domain]}).parent for domain in domains}
    # Evaluated after round 2 only (every message starts a ClientApp process on its SuperNode).
    settings = dict(dataset="VLCS", target="VOC2007", rounds=2, local_steps=2, batch_size=4, image_size=8,
                    model="mnist_cnn", holdout_fraction=0.25, seed=2, class_names=["bird", "car"],
                    id_evaluation="clients", eval_every=2, algorithm="fedadg+feddg_ga",
                    hp={"classification_epochs": 1, "alignment_epochs": 1, "client_lr": 0.01})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(ExperimentConfig(**settings, data_root=tmp_path / "whole", run_dir=tmp_path / "in-process"),
                       progress=False, echo=lambda *_: None)
        monkeypatch.setenv("FEDBED_DATA", str(roots["VOC2007"]))  # the server's
        run_flower_deployment(ExperimentConfig(**settings, run_dir=tmp_path / "deployed"), echo=lambda *_: None,
                              work_dir=tmp_path / "flower", site_data_roots=[roots[d] for d in domains[:3]])
    finally:
        torch.set_num_threads(threads)
    records = {name: [json.loads(line) for line in (tmp_path / name / LOG_NAME).read_text().splitlines()]
               for name in ("in-process", "deployed")}
    mine, theirs = records["in-process"], records["deployed"]
    assert [r["metrics"]["train_loss"] for r in theirs] == pytest.approx([r["metrics"]["train_loss"] for r in mine], rel=1e-5)
    assert theirs[-1]["evaluation"]["ood_mean"] == pytest.approx(mine[-1]["evaluation"]["ood_mean"], abs=1e-6)
    assert theirs[-1]["evaluation"]["id"] == pytest.approx(mine[-1]["evaluation"]["id"], abs=1e-6)
    assert [r["metrics"]["mean_adversarial_discriminator"] for r in theirs] == pytest.approx(
        [r["metrics"]["mean_adversarial_discriminator"] for r in mine], rel=1e-5)
    assert set(mine[-1]["evaluation"]["id"]) == set(domains[:3])
    gaps = [record[1]["telemetry"]["generalization_gaps"] for record in (mine, theirs)]
    assert set(gaps[0]) == {"0", "1", "2"} and gaps[1] == pytest.approx(gaps[0], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("changes", [dict(algorithm="fedsimclr"),  # linear_probe: the server probes, sites train
                                     dict(protocol="domain_adaptation")])  # the server alone holds the target
def test_each_site_builds_under_the_other_evaluation_protocols(machines, changes):
    whole, spread = machines
    everything = build_run(config(whole, **changes))
    site = build_run(config(spread["coast"], **changes))
    mine, theirs = site.client_data(1), everything.client_data(1)
    assert torch.equal(mine.images[:], theirs.images[:]) and torch.equal(mine.targets, theirs.targets)


def test_a_site_reads_its_packed_file_of_another_size_and_numeric_class_names(machines, tmp_path):
    """A site packs its one-domain tree (`fedbed data prepare`) at 16 px and runs at 8 px from
    the packed file alone (resized from the nearest packed size); class names that YAML read as
    numbers are names."""
    import shutil

    from fedbed.data.path_datasets import prepare_path_dataset

    whole, spread = machines
    packed_site = tmp_path / "packed-site" / "herds"
    prepare_path_dataset(str(spread["coast"]), 16, output_root=packed_site.parent)
    shutil.rmtree(spread["coast"])  # the folder tree is gone: only the packed file is read
    site = build_run(config(packed_site))
    everything = build_run(config(whole))
    assert site.dataset.present_domains() == (1,) and site.dataset.images.shape[-2:] == (8, 8)
    assert torch.equal(site.client_data(1).targets, everything.client_data(1).targets)
    numbered = config_from_mapping({"dataset": str(whole), "target": "delta", "domain_names": ["alps", "coast", "delta"],
                                    "class_names": [7, 3]})
    assert numbered.class_names == ["7", "3"]


def test_a_dataset_built_by_its_own_reader_is_refused_before_any_data_is_read(tmp_path):
    from fedbed.config import validate

    with pytest.raises(ConfigError, match="RotatedMNIST is built by its own reader"):
        validate(ExperimentConfig(dataset="RotatedMNIST", data_root=tmp_path, class_names=["0", "1"]))
