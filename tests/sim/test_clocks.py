"""The clock model from published data, the share of step time a clock moves, and the band and
calibration error every simulated ratio can carry (``elaswave simulate --band --calibration``)."""
import json
from pathlib import Path

import pytest

from elaswave import cli
from elaswave.plan.frequency import SOURCED, PowerModel, plan_frequencies

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["simulate", "--devices", "96", "--dp", "4", "--pp", "24", "--model", "gpt-13b", "--json"]


def test_only_the_clocked_share_of_a_stage_moves_with_its_clock():
    assert PowerModel().speed(0.5) == pytest.approx(0.5)
    half = PowerModel(clock_share=0.5)
    assert half.speed(0.5) == pytest.approx(1 / 1.5) and half.speed(1.0) == pytest.approx(1.0)
    assert half.speed(1.2) < 1.2
    with pytest.raises(ValueError, match="clock_share=0 is invalid"):
        PowerModel(clock_share=0)


def test_the_sourced_model_is_the_published_measurements_fit(monkeypatch):
    """plan/frequency.SOURCED against a refit of Perseus's A100 points (bench/sim/clock_fit.py)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.sim.clock_fit import fit

    got = fit()
    for term in ("clock_share", "static_w", "dynamic_w"):
        assert getattr(SOURCED, term) == pytest.approx(got[term], abs=0.01), term
    assert SOURCED.exponent == pytest.approx(got["exponent"], abs=0.1)
    assert got["time_max_abs_error"] < 0.05 and got["power_max_abs_error"] < 0.05
    assert SOURCED.power(1.0) == pytest.approx(1.0)


def test_a_clock_that_moves_less_of_the_step_buys_less():
    stage_s = [[1.0, 1.0, 1.6]] * 2  # an uneven pipeline: its last stage is raised, the others pay
    gains = []
    for share in (1.0, 0.78, 0.5):
        model = PowerModel(clock_share=share)
        flat = plan_frequencies(stage_s, 8, PowerModel(levels=(1.0,), clock_share=share)).step_s
        gains.append(flat / plan_frequencies(stage_s, 8, model).step_s)
    assert gains[0] > gains[1] > gains[2] > 1.0, gains


def test_every_ratio_carries_its_band_and_the_calibration_error(capsys):
    calibration = ROOT / "bench" / "results" / "sim_calibration.json"
    assert cli.main([*ARGV, "--band", "--calibration", str(calibration)]) == 0
    doc = json.loads(capsys.readouterr().out)
    config = doc["config"]
    assert config["clock_share"] == SOURCED.clock_share and len(config["band_corners"]) == 4
    lo, hi = config["failure_free_clock_gain_band"]
    assert lo <= config["failure_free_clock_gain"] <= hi and lo == pytest.approx(1.0)  # sustained: no gain
    errors = json.loads(calibration.read_text())["runs"]
    held = max(abs(q["after_over_before"]["error"]) for n, q in errors.items() if "fit" not in n and "after_over_before" in q)
    assert config["calibration"]["ratio"] == pytest.approx(held)
    for name, p in doc["policies"].items():
        lo, hi = p["band"]["after_over_before"]
        assert lo <= p["throughput_after_over_before"] <= hi, name
        if name == "reroute":  # priced at its lower bound, which no calibration run checked
            assert p["plus_minus"] is None
        else:
            assert p["plus_minus"]["after_over_before"] == pytest.approx(p["throughput_after_over_before"] * held)
    elaswave = doc["policies"]["elaswave"]
    assert elaswave["band"]["after_over_best_baseline_after"][1] > 1.0  # clocks buy elaswave a lead somewhere
    # The band's corners are real runs: at the sustained corner no clock rises, so the band reaches the
    # no-DVFS row's ratio.
    assert cli.main([*ARGV, "--no-dvfs"]) == 0
    plain = json.loads(capsys.readouterr().out)["policies"]["elaswave_no_dvfs"]
    assert elaswave["band"]["after_over_before"][0] <= plain["throughput_after_over_before"] + 1e-9


def test_absolute_figures_stand_beside_the_ratios(capsys):
    assert cli.main([*ARGV, "--micro-batch-size", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    seq, m = doc["config"]["seq_len"], doc["config"]["micro_batches"]
    for p in doc["policies"].values():
        assert p["tokens_per_s_after"] == pytest.approx(p["throughput_after"] * 2 * seq)
        assert p["step_after_s"] == pytest.approx(m * p["batch_after_over_before"] / p["throughput_after"])
    drop = doc["policies"]["drop_replica"]
    # One of 4 pipelines dropped, its share of the batch with it (the clock plan dealt 48 or 49 of 192).
    assert drop["batch_after_over_before"] == pytest.approx(0.75, abs=0.01)
    assert drop["step_after_s"] < doc["policies"]["elaswave"]["step_after_s"]  # a faster step of a smaller batch


@pytest.mark.parametrize("argv,needle", [
    (["--band", "0.9,0.6"], "--band=0.9,0.6 is invalid"),
    (["--band", "0.7,0.7"], "--band=0.7,0.7 is invalid"),
    (["--clock-share", "0"], "--clock-share=0.0 is invalid"),
    (["--clock-share", "0.5", "--no-dvfs"], "--clock-share is invalid with --no-dvfs"),
    (["--calibration", "/nonexistent.json"], "--calibration=/nonexistent.json cannot be read"),
])
def test_bad_clock_input_is_one_line(argv, needle, capsys):
    assert cli.main(["simulate", "--devices", "8", "--dp", "2", "--pp", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
