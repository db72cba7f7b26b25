"""Fitting the link from timed collectives: it finds a known link back, prices what it fitted, and
says what is missing when the runs cannot determine it."""
import pytest

from elaswave import config
from elaswave.model.contract import counted_numels
from elaswave.model.registry import model_for
from elaswave.sim.calibrate import CalibrationError, fit, fit_links, predict

LATENCY_S, BYTES_PER_S = 300e-6, 1.5e9


def _run(d_model: int, dp: int = 4, deterministic: bool = False, steps: int = 6) -> list[dict]:
    """Metrics of a failure-free run whose collectives took what a known ring link takes."""
    cfg = config.load(None, [f"parallel.dp={dp}", "parallel.pp=1", "parallel.overlap_param_gather=false", f"model.d_model={d_model}",
                             "model.num_heads=2", f"train.deterministic={str(deterministic).lower()}"])
    nbytes = 4.0 * sum(counted_numels(model_for(cfg)))
    grad = nbytes * (2 if deterministic else 1)
    reduce = 2 * (dp - 1) * (LATENCY_S + grad / dp / BYTES_PER_S)  # gloo: an all-reduce, two rings
    gather = (dp - 1) * (LATENCY_S + nbytes / dp / BYTES_PER_S)
    records = [{"event": "job", "config": cfg.to_dict(), "world_size": dp}]
    for step in range(steps):
        records.append({"event": "step", "step": step, "epoch": 0, "num_samples": 4, "step_time_s": 0.5 + reduce + gather,
                        "phases_s": {"compute": 0.5, "reduce": reduce, "gather": gather}})
    return records


def test_two_widths_give_the_link_back_and_it_prices_a_third():
    lat, bw = fit_links([_run(32), _run(128)])
    assert lat == pytest.approx(LATENCY_S, rel=1e-6) and bw == pytest.approx(BYTES_PER_S, rel=1e-6)
    third = _run(96, dp=2, deterministic=True)
    got = predict(third, fit(_run(32), links=(lat, bw)))
    assert got["collectives_s"]["error"] == pytest.approx(0.0, abs=1e-9)


def test_the_fitted_collectives_leave_the_rest_of_the_step_as_its_fixed_cost():
    run = _run(128)
    model = fit(run, links=(LATENCY_S, BYTES_PER_S))
    assert model.step_overhead_s == pytest.approx(0.0, abs=1e-9)
    assert model.layer_param_bytes and model.reduce_is_all_reduce
    timed = run[-1]["phases_s"]["reduce"] + run[-1]["phases_s"]["gather"]
    assert fit(run).step_overhead_s == pytest.approx(timed)  # without a link they are a fixed cost


def test_one_size_cannot_fit_a_link():
    with pytest.raises(CalibrationError, match="not in one proportion"):
        fit_links([_run(64), _run(64)])
    with pytest.raises(CalibrationError, match="not in one proportion"):
        fit_links([_run(64, dp=1)])
