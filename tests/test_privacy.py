"""Client-level differential privacy: clipping and noise by hand, the accountant, clipping on
the client, and (ε, δ) in the log, the summary, `fedbed run` and `fedbed report`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from fedbed.algorithms import ALGORITHMS
from fedbed.algorithms.base.model_aggregation import ClientModels
from fedbed.algorithms.options.differential_privacy import (
    DifferentialPrivacy,
    FixedClippingPrivacy,
    privacy_spent,
)
from fedbed.cli import app
from fedbed.experiment import ExperimentConfig, run_experiment
from fedbed.federation.arrays import clip_to_norm, clip_update
from fedbed.federation.messages import Payload, Reply
from fedbed.federation.strategy import ClientTrainer
from fedbed.federation.transport import CLIPPING_NORM, FIT_SECONDS, fit_client

runner = CliRunner()


def test_clipping_by_hand():
    clipped, norms = clip_to_norm(torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), 1.0)
    assert torch.allclose(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64))
    assert norms.tolist() == pytest.approx([5.0, 0.5, 0.0])
    arrays, norm = clip_update({"w": torch.tensor([4.0, 5.0]), "n": torch.tensor(7)},
                               {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(2)}, 2.5)
    assert norm == pytest.approx(5.0) and torch.allclose(arrays["w"], torch.tensor([2.5, 3.0])) and arrays["n"].item() == 7
    with pytest.raises(ValueError, match="clipping norm must be positive"):
        clip_to_norm(torch.ones(1, 2), 0.0)


def test_the_server_mean_of_clipped_updates_gets_noise_of_sigma_c_over_k():
    size, clipping_norm, sigma = 20000, 2.0, 0.5
    current = {"w": torch.zeros(size), "n": torch.tensor(1)}
    arrays = [{"w": torch.full((size,), 1.0), "n": torch.tensor(5)},   # norm sqrt(size) >> C: clipped
              {"w": torch.zeros(size), "n": torch.tensor(5)}]
    privacy = FixedClippingPrivacy(DifferentialPrivacy(clipping_norm=clipping_norm, noise_multiplier=sigma), 1.0)
    state, telemetry = privacy.aggregate(ClientModels(current, [3, 8], arrays, [100, 1], 1, torch.Generator().manual_seed(0), frozenset(current)))
    noise = torch.randn(size, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * sigma * clipping_norm / 2
    expected_mean = clipping_norm / size ** 0.5 / 2  # client 3's update scaled to norm C, averaged with a zero update
    assert torch.allclose(state["w"].double(), expected_mean + noise, atol=1e-6)
    assert float((state["w"].double() - expected_mean).std()) == pytest.approx(sigma * clipping_norm / 2, rel=0.03)
    assert state["n"].item() == 1  # integer buffers keep the server's value
    assert telemetry["weights"] == {"3": 0.5, "8": 0.5}  # n_k is ignored: each client weighs 1/K
    # The log keeps what the guarantee covers; per-client norms only behind the debugging switch.
    assert set(telemetry["privacy"]) == {"noise_std", "epsilon", "delta"} and telemetry["privacy"]["noise_std"] == pytest.approx(0.5)
    debugging = FixedClippingPrivacy(DifferentialPrivacy(clipping_norm=clipping_norm, noise_multiplier=sigma,
                                                         log_client_norms=True), 1.0)
    debug_state, telemetry = debugging.aggregate(
        ClientModels(current, [3, 8], arrays, [100, 1], 1, torch.Generator().manual_seed(0), frozenset(current)))
    assert torch.equal(debug_state["w"], state["w"])  # the switch changes the log, not the model
    assert telemetry["privacy"]["clipped_here"] == [3]
    assert telemetry["privacy"]["update_norms_before_clipping"] == pytest.approx([size ** 0.5, 0.0])


def test_privacy_spent_is_opacus_rdp_accountant_stepped_t_times():
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(20):
        accountant.step(noise_multiplier=1.1, sample_rate=0.6)
    assert privacy_spent(1.1, 0.6, 20, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    assert privacy_spent(1.1, 0.6, 10, 1e-5) < privacy_spent(1.1, 0.6, 20, 1e-5)  # more rounds spend more
    assert privacy_spent(2.0, 0.6, 20, 1e-5) < privacy_spent(1.1, 0.6, 20, 1e-5)  # more noise spends less
    with pytest.raises(ValueError, match="rounds >= 1"):
        privacy_spent(1.0, 1.0, 0, 1e-5)


class FarTrainer(ClientTrainer):
    def fit(self, payload, data, state):
        return Reply({"w": payload.arrays["w"] + torch.tensor([30.0, 40.0])}, 1, {"loss": 0.0})


def test_client_side_clipping_happens_in_fit_client():
    payload = Payload({"w": torch.zeros(2)}, config={"batch_seed": 1, CLIPPING_NORM: 5.0})
    reply = fit_client(FarTrainer(), payload, None, {})
    assert torch.allclose(reply.arrays["w"], torch.tensor([3.0, 4.0])) and reply.metrics[FIT_SECONDS] >= 0
    unclipped = fit_client(FarTrainer(), Payload({"w": torch.zeros(2)}, config={"batch_seed": 1}), None, {})
    assert torch.equal(unclipped.arrays["w"], torch.tensor([30.0, 40.0]))


@pytest.mark.parametrize("clipping", ["server", "client"])
def test_a_private_run_logs_epsilon_per_round_and_reports_it(clipping, tmp_path):
    config = tmp_path / "dp.yaml"
    config.write_text(f"model: lenet\nrounds: 2\nlocal_steps: 1\nbatch_size: 16\nparticipation_fraction: 0.6\n"
                      f"differential_privacy: {{clipping: {clipping}, clipping_norm: 0.5, noise_multiplier: 1.0}}\n")
    run_dir = tmp_path / "sweep" / "run"
    result = runner.invoke(app, ["run", "--config", str(config), "--run-dir", str(run_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    epsilons = [r["telemetry"]["privacy"]["epsilon"] for r in records]
    assert epsilons[0] < epsilons[1] and [len(r["selected"]) for r in records] == [3, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilons[-1]) and summary["privacy"]["sample_rate"] == 0.6
    assert summary["privacy"]["epsilon"] == pytest.approx(privacy_spent(1.0, 0.6, 2, 1e-5))
    assert f"privacy: client-level ({epsilons[-1]:.3g}, 1e-05)-differential privacy after 2 rounds" in result.output
    assert all("clipped_here" not in r["telemetry"]["privacy"] for r in records)  # not logged by default
    assert "not covered" in summary["privacy"]["note"] and "DEBUG" not in summary["privacy"]["note"]
    report = runner.invoke(app, ["report", str(tmp_path / "sweep")])
    assert report.exit_code == 0, report.output
    assert f"privacy (1 run): client-level ({epsilons[-1]:.3g}, 1e-05)" in report.output


def test_the_debugging_switch_logs_client_norms_and_the_statement_flags_it(tmp_path):
    """``log_client_norms: true``: under client-side clipping every client clipped its own update,
    so the server clipped none; the summary's statement says the norms were logged."""
    config = ExperimentConfig(model="lenet", rounds=1, local_steps=1, batch_size=16, run_dir=tmp_path / "run",
                              differential_privacy={"clipping": "client", "clipping_norm": 0.5, "noise_multiplier": 1.0,
                                                    "log_client_norms": True})
    summary = run_experiment(config, progress=False, echo=lambda *_: None)
    record = json.loads((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()[0])
    assert record["telemetry"]["privacy"]["clipped_here"] == []
    assert all(norm <= 0.5 * (1 + 1e-6) for norm in record["telemetry"]["privacy"]["update_norms_before_clipping"])
    assert summary["privacy"]["log_client_norms"] is True and "DEBUG" in summary["privacy"]["note"]


def test_fedbed_algorithms_says_which_methods_average():
    result = runner.invoke(app, ["algorithms"])
    assert result.exit_code == 0
    server_of, name = {}, None
    for line in result.output.splitlines():  # a method's name and summary, then its indented details
        if not line.startswith(" "):
            name = line.split()[0]
        elif line.split()[0] == "server:":
            server_of[name] = line
    assert set(server_of) == set(ALGORITHMS)
    assert "secure-aggregation compatible" in server_of["fedavg"]
    for name in ("ppdg", "pcgrad", "hfedf", "fedgala", "fedavg_global_alignment"):
        assert "not compatible with secure aggregation" in server_of[name], name


def test_noise_never_leaves_a_negative_batchnorm_variance():
    current = {"bn.running_var": torch.full((500,), 0.01), "bn.weight": torch.ones(500)}
    arrays = [{name: tensor.clone() for name, tensor in current.items()} for _ in range(3)]
    privacy = FixedClippingPrivacy(DifferentialPrivacy(clipping_norm=1.0, noise_multiplier=1.0), 1.0)
    state, _ = privacy.aggregate(ClientModels(current, [0, 1, 2], arrays, [1, 1, 1], 1, torch.Generator().manual_seed(0), frozenset(current)))
    assert float(state["bn.running_var"].min()) == 0.0  # noise of std 1/3 pushed some below 0: clamped
    assert float(state["bn.weight"].min()) < 0.5  # the other arrays keep their noise
