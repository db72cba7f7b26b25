"""Policies replayed over traces, and the ``elaswave simulate`` command."""
import contextlib
import io
import json

import pytest

from elaswave import cli
from elaswave.plan.frequency import PowerModel
from elaswave.plan.plan import initial_plan
from elaswave.sim import policies, trace
from elaswave.sim.engine import simulate
from elaswave.sim.model import ClusterModel

MODEL = ClusterModel(layer_forward_s=(0.01,) * 8, layer_param_bytes=(4e6,) * 8, step_overhead_s=0.05)


def _run(name, events, hours=1.0):
    plan = initial_plan(16, 4, 4, [1.0] * 8, 64, [10**6] * 8, 1 << 16)
    return simulate(events, policies.make(name, plan, 64, MODEL, policies.BaselineCosts()), MODEL, hours * 3600)


def test_without_failures_every_policy_trains_at_its_full_rate():
    for name in policies.POLICIES:
        res = _run(name, [])
        assert res.goodput == pytest.approx(1.0) and res.throughput_after_over_before is None


def test_one_failure_orders_the_policies_as_their_mechanisms_say():
    events = trace.single_failure(5, 600.0)
    res = {name: _run(name, events) for name in policies.POLICIES}
    drop = res["drop_replica"].throughput_after_over_before
    assert drop == pytest.approx(0.75, rel=0.02)  # one of four pipelines idle
    assert res["elaswave"].throughput_after_over_before > res["reroute"].throughput_after_over_before > drop
    # Restarting loses the work since the checkpoint and the restart itself.
    assert res["restart"].time_lost_per_failure_s > 100 * res["elaswave"].time_lost_per_failure_s
    assert max(r.goodput for r in res.values()) == res["elaswave"].goodput


def test_a_repair_brings_the_full_rate_back():
    events = [trace.Event(600.0, "fail", 5), trace.Event(1800.0, "join", 5)]
    res = _run("elaswave", events)
    assert res.failures == 1 and res.joins == 1
    assert res.timeline[-1][1] == pytest.approx(res.timeline[0][1])


def test_simulate_json_has_every_policy(capsys):
    # Memory unmodelled (--device-gib 0): gpt-175b fits 80 GiB only with tensor parallelism.
    assert cli.main(["simulate", "--devices", "96", "--dp", "3", "--pp", "32", "--model", "gpt-175b", "--json",
                     "--device-gib", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["dp"] == 3 and doc["config"]["failures"] == 1
    assert set(doc["policies"]) == set(policies.POLICIES)
    for p in doc["policies"].values():
        assert {"throughput_after_over_before", "goodput", "mttr_s"} <= set(p)
    assert doc["policies"]["elaswave"]["throughput_after_over_before"] > doc["policies"]["drop_replica"]["throughput_after_over_before"]


def test_simulate_prices_the_gradient_sums_overlapped_unless_told_not_to(capsys):
    """Interleaved 1F1B: a GPU's later chunks are whole before its first, so their sums run during
    the compute (parallel.overlap_grad_reduce); --no-overlap starts them at the schedule's end."""
    argv = ["simulate", "--devices", "64", "--dp", "4", "--pp", "16", "--model", "gpt-13b", "--json", "--device-gib",
            "0", "--schedule", "interleaved", "--virtual-stages", "2", "--policies", "elaswave_no_dvfs", "--no-dvfs"]
    steps = []
    for extra in ([], ["--no-overlap"]):
        assert cli.main([*argv, *extra]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["config"]["overlap_grad_reduce"] == (not extra)
        steps.append(doc["config"]["failure_free"]["step_s"])
    assert steps[0] < steps[1] * 0.999, steps


@pytest.mark.parametrize("argv,needle", [
    (["--devices", "96", "--dp", "5"], "dp x pp x tp must equal the devices"),
    (["--devices", "96", "--policies", "elaswave,magic"], "choose from"),
    (["--devices", "1"], "need at least 2"),
    (["--devices", "96", "--no-dvfs", "--policies", "elaswave,reroute"], "is invalid with --no-dvfs"),
    (["--devices", "96", "--no-dvfs", "--clocks", "boost"], "--clocks=boost is invalid with --no-dvfs"),
    (["--devices", "96", "--micro-batch-size", "0"], "--micro-batch-size=0 is invalid"),
    (["--devices", "96", "--no-reshape"], "--no-reshape is invalid with --micro-batch-size=1"),
])
def test_bad_simulate_input_is_one_line(argv, needle, capsys):
    assert cli.main(["simulate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_simulate_draws_its_plot(tmp_path, capsys):
    out = tmp_path / "sim.png"
    assert cli.main(["simulate", "--devices", "16", "--dp", "4", "--pp", "4", "--model", "gpt-1.3b",
                     "--mtbf-h", "20", "--hours", "12", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "elaswave" in capsys.readouterr().out


GPT_96 = ["simulate", "--devices", "96", "--dp", "2", "--pp", "48", "--model", "gpt-175b", "--json", "--device-gib", "0"]


@pytest.fixture(scope="module")
def gpt_96():
    """``elaswave simulate`` of GPT_96 as it prints it, with clock planning and without (--no-dvfs)."""
    out = {}
    for extra in ((), ("--no-dvfs",)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert cli.main([*GPT_96, *extra]) == 0
        out[extra] = json.loads(printed.getvalue())
    return out


def test_every_policy_starts_from_the_same_plan_and_the_clock_gain_is_its_own_row(capsys, gpt_96):
    """The failure-free plan (clocks planned) is every row's: equal rates before the failure, the
    clocks' failure-free gain reported once; after the failure only elaswave re-plans clocks."""
    argv = GPT_96
    out = gpt_96[()]
    doc = out["policies"]
    before = {p["throughput_before"] for p in doc.values()}
    assert len(before) == 1, before
    assert out["config"]["failure_free_clock_gain"] > 1.01  # gpt-175b's 96 layers + head over 48 stages: uneven
    assert out["config"]["frequency_solver"] == "exact"
    assert doc["elaswave"]["throughput_after"] > doc["elaswave_no_dvfs"]["throughput_after"]
    assert cli.main([*argv, "--clocks", "sustained"]) == 0
    sustained = json.loads(capsys.readouterr().out)
    assert sustained["config"]["failure_free_clock_gain"] == pytest.approx(1.0)
    nominal = gpt_96[("--no-dvfs",)]
    assert nominal["policies"]["templates"]["throughput_before"] == pytest.approx(
        doc["templates"]["throughput_before"] / out["config"]["failure_free_clock_gain"])


def test_dvfs_shows_apart_and_a_model_without_boost_buys_no_time(gpt_96):
    """elaswave with and without frequency planning, side by side; with no level above nominal the
    planner can only lower waiting stages: the throughput of no DVFS at all, before and after."""
    doc = gpt_96[()]["policies"]
    baselines = [p["throughput_after"] for n, p in doc.items() if not n.startswith("elaswave")]
    for p in doc.values():
        assert p["after_over_best_baseline_after"] == pytest.approx(p["throughput_after"] / max(baselines))
    plain = gpt_96[("--no-dvfs",)]
    assert "elaswave" not in plain["policies"] and plain["config"]["dvfs"] is False
    events = trace.single_failure(5, 600.0)
    costs_s = (0.01,) * 7 + (0.017,)  # a heavier head: frequency planning has stages to lower
    plan = initial_plan(16, 4, 4, list(costs_s), 64, [10**6] * 8, 1 << 16)
    no_boost = ClusterModel(layer_forward_s=costs_s, layer_param_bytes=MODEL.layer_param_bytes,
                            step_overhead_s=MODEL.step_overhead_s,
                            power=PowerModel(levels=tuple(f for f in PowerModel().levels if f <= 1.0)))
    costs = policies.BaselineCosts()
    capped = simulate(events, policies.make("elaswave", plan, 64, no_boost, costs), no_boost, 3600)
    plain = simulate(events, policies.make("elaswave_no_dvfs", plan, 64, no_boost, costs), no_boost, 3600)
    assert (capped.throughput_before, capped.throughput_after) == pytest.approx(
        (plain.throughput_before, plain.throughput_after), rel=1e-9)


def _first_ratios(devices, dp, pp, preset, model_power=None):
    """After / before of every policy over single failures (first, middle, last stage) and a
    Poisson trace, on the modelled cluster of ``preset``."""
    from dataclasses import replace

    from elaswave.sim.workload import MODELS, cluster, layer_numels
    model = cluster(MODELS[preset])
    if model_power is not None:
        model = replace(model, power=model_power)
    m = 2 * pp * dp
    plan = initial_plan(devices, dp, pp, list(model.layer_forward_s), m, layer_numels(MODELS[preset]), 1 << 24)
    traces = [trace.single_failure(plan.pipelines[0][s], 360.0) for s in sorted({0, pp // 2, pp - 1})]
    traces.append(trace.poisson(devices, 3.0 * devices, 24, 4.0, 1))
    costs = policies.BaselineCosts()
    for events in traces:
        for name in policies.POLICIES:
            res = simulate(events, policies.make(name, plan, m, model, costs), model, 24 * 3600)
            yield name, events, res.throughput_after_over_before


@pytest.mark.parametrize("devices,dp,pp,preset", [
    (16, 4, 4, "gpt-1.3b"), (16, 2, 8, "gpt-13b"), (24, 3, 8, "gpt-13b"), (32, 2, 16, "gpt-13b"),
    (32, 4, 8, "gpt-13b"), (32, 4, 8, "gpt-175b")])
def test_no_policy_trains_faster_after_losing_a_device(devices, dp, pp, preset):
    """Each policy's before is the best its system runs on every device (elaswave: its frequency
    plan within the live devices' nominal power), so a loss can only cost: after / before <= 1 for
    every policy, layout, model and trace."""
    for name, events, ratio in _first_ratios(devices, dp, pp, preset):
        assert ratio is None or ratio <= 1 + 1e-9, (name, events[:1], ratio)


def test_a_rerouted_step_never_beats_the_whole_jobs_1f1b():
    """gpt-13b's 42 layers over 32 stages are uneven: when every pipeline's micro-batches got the
    routed schedule's 2 spare in flight, the hosts overlapped better than the 1F1B they ran before
    the failure (after / before 1.0022 for reroute and for elaswave without DVFS, which took the
    same detours). Only the detoured pipeline gets the spare now."""
    from elaswave.sim.workload import MODELS, cluster, layer_numels
    model = cluster(MODELS["gpt-13b"])
    plan = initial_plan(96, 3, 32, list(model.layer_forward_s), 192, layer_numels(MODELS["gpt-13b"]), 1 << 24)
    events = trace.single_failure(plan.pipelines[0][16], 360.0)
    for name in ("reroute", "elaswave_no_dvfs"):
        res = simulate(events, policies.make(name, plan, 192, model, policies.BaselineCosts()), model, 3600)
        assert res.throughput_after_over_before <= 1 + 1e-9, name


def _after_over_before(capsys, *extra):
    argv = ["simulate", "--devices", "16384", "--dp", "1024", "--pp", "16", "--model", "gpt-175b", "--clocks",
            "sustained", "--policies", "elaswave,drop_replica", "--json", "--device-gib", "0", *extra]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    return {n: p["throughput_after_over_before"] for n, p in doc["policies"].items()}, doc["config"]


def test_reshaping_at_16384_devices_keeps_the_batch_and_catches_up_with_dropping_a_replica(capsys):
    """One failure at 16,384 devices: dealing whole micro-batches, the pipelines that take the
    broken one's extra micro-batches cost every pipeline a micro-batch's time (elaswave 0.984,
    TorchFT's policy 0.999 with a smaller batch); dealing sequences, a sequence's time. Not quite
    drop_replica's (0.9987 against 0.9990): the re-split pipeline's ranks each sum their gradients in
    two holder groups, one ring after the other (priced as one, the larger, until session 45)."""
    whole, _ = _after_over_before(capsys, "--micro-batch-size", "16", "--no-reshape")
    shaped, config = _after_over_before(capsys, "--micro-batch-size", "16")
    assert config["reshape"] and config["micro_batch_size"] == 16
    assert config["frequency_solver"] in ("greedy", None)  # 1,024 pipelines: above the exact DP's bound
    assert whole["elaswave"] < 0.99 < shaped["elaswave"] <= 1.0
    assert shaped["drop_replica"] == pytest.approx(1023 / 1024)
    assert shaped["elaswave"] > shaped["drop_replica"] - 1e-3


def test_a_failure_under_interleaved_keeps_the_virtual_stages_and_is_priced_on_them():
    """Every policy survives a failure of an interleaved job: elaswave re-splits the broken
    pipeline into p' x V chunks, priced by the interleaved schedule's timing on those chunks;
    reroute sends each lost chunk through a host, priced at its routes' lower bound, which no
    schedule of them beats; none crashes."""
    import random
    from dataclasses import replace

    from elaswave.pipeline.schedule import interleaved_1f1b, makespan
    from elaswave.sim.model import step_time

    draw = random.Random(3)
    costs = [draw.uniform(0.5, 1.5) for _ in range(16)]
    model = replace(MODEL, layer_forward_s=tuple(0.01 * c for c in costs), layer_param_bytes=(4e6,) * 16,
                    pipeline_schedule="interleaved")
    plan = initial_plan(16, 4, 4, costs, 64, [10**6] * 16, 1 << 16, virtual_stages=2)
    events = trace.single_failure(5, 600.0)
    res = {}
    for name in policies.POLICIES:
        policy = policies.make(name, plan, 64, model, policies.BaselineCosts(), start=plan)  # nominal clocks
        res[name] = simulate(events, policy, model, 3600)
        after = policy.layout([r for r in plan.ranks if r != 5])
        if name == "reroute":
            assert after.routes and after.virtual_stages == 2
            bound, runs = step_time(after, model, "lower_bound").compute_s, step_time(after, model).compute_s
            assert 0 < bound <= runs
            continue
        assert after.virtual_stages == 2
        assert all(len(ranges) == 2 * len(p) for p, ranges in zip(after.pipelines, after.layer_ranges))
        if name == "elaswave":
            assert after.pipelines[1] == (4, 6, 7) and after.is_complete(1)
            expected = max(makespan([interleaved_1f1b(s, len(p), 2, range(len(mbs))) for s in range(len(p))],
                                    [3 * sum(model.layer_forward_s[i:j]) for i, j in ranges], 2.0)
                           for p, ranges, mbs in zip(after.pipelines, after.layer_ranges, after.micro_batches) if mbs)
            # (With parallel.overlap_param_gather a chunk's first forward also waits for its all-gather.)
            assert step_time(after, replace(model, overlap_param_gather=False)).compute_s == pytest.approx(expected, rel=1e-12)
            assert step_time(after, model).compute_s > expected
            assert res[name].throughput_after == pytest.approx(step_time(after, model).micro_batches_per_s)
    assert res["reroute"].stalls == 0 and res["reroute"].throughput_after > 0
    assert res["elaswave"].throughput_after_over_before > res["drop_replica"].throughput_after_over_before
    assert all(r.failures == 1 for r in res.values())


@pytest.mark.slow  # 15 s: a 405B model's memory measured; the planner's check is the same at every size
def test_clock_planning_never_slows_an_interleaved_job_at_sustained_clocks(capsys):
    """Sustained clocks (none above nominal) leave clock planning energy to save, never time. The
    frequency planner times a rank's chunks as one 1F1B stage; after a loss at Llama 3 405B's
    layout on 512 GPUs (interleaved V = 4, recomputing to fit 80 GiB) its levels lengthened the
    interleaved step (0.919 after/before against 0.934 at nominal clocks). The planner now keeps a
    deal's levels only where the schedule's own timing finds them no slower (plan.plan: settled)."""
    argv = ["simulate", "--devices", "512", "--tp", "8", "--pp", "16", "--model", "llama3-405b", "--hardware", "h100",
            "--schedule", "interleaved", "--virtual-stages", "4", "--checkpointing", "auto", "--clocks", "sustained",
            "--micro-batches", "64", "--policies", "elaswave,elaswave_no_dvfs", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)["policies"]
    ratio = {n: p["throughput_after_over_before"] for n, p in doc.items()}
    assert ratio["elaswave"] >= ratio["elaswave_no_dvfs"] - 1e-9 and ratio["elaswave_no_dvfs"] < 1.0, ratio


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved", 2)])
def test_reroute_as_the_runtime_runs_it_is_priced_by_the_routed_schedule_and_elaswave_never_trails_it(schedule, virtual):
    """reroute_runtime prices reroute's routes by the routed schedule the runtime runs (its rate after
    the failure is that schedule's), which takes at least their bound's compute; elaswave, whose
    planner prices that same plan among its choices (``plan.replan`` with detours), is never slower."""
    import random
    from dataclasses import replace

    from elaswave.sim.model import step_time

    draw = random.Random(5)
    costs = [draw.uniform(0.5, 1.5) for _ in range(16)]
    model = replace(MODEL, layer_forward_s=tuple(0.01 * c for c in costs), layer_param_bytes=(4e6,) * 16,
                    pipeline_schedule=schedule)
    plan = initial_plan(16, 4, 4, costs, 64, [10**6] * 16, 1 << 16, virtual_stages=virtual)
    events = trace.single_failure(6, 600.0)
    rate = {}
    for name in ("elaswave_no_dvfs", "reroute_runtime"):
        policy = policies.make(name, plan, 64, model, policies.BaselineCosts(), start=plan)
        rate[name] = simulate(events, policy, model, 3600).throughput_after
        if name == "reroute_runtime":
            after = policy.layout([r for r in plan.ranks if r != 6])
            assert after.routes and after.virtual_stages == virtual
            runs = step_time(after, model)
            assert rate[name] == pytest.approx(runs.micro_batches_per_s, rel=1e-12)
            assert step_time(after, model, "lower_bound").compute_s <= runs.compute_s
    assert 0 < rate["reroute_runtime"] <= rate["elaswave_no_dvfs"] * (1 + 1e-12)
