"""Activation recomputation priced by the simulator: each backward runs again what is recomputed
(a block's forward and its TP collectives, or selective's attention core), so less memory costs
time -- not memory for free."""
import json
from dataclasses import replace

import pytest

from elaswave import cli
from elaswave.model.registry import family
from elaswave.pipeline.schedule import one_f_one_b_makespan
from elaswave.plan.plan import initial_plan
from elaswave.sim.model import step_time
from elaswave.sim.workload import MODELS, cluster, layer_numels


def _plan(model, dp=2, pp=4, m=16):
    return initial_plan(dp * pp, dp, pp, list(model.layer_costs), m, layer_numels(MODELS["llama3-70b"]), 1 << 24)


def test_each_recomputed_block_runs_its_forward_again_with_its_tp_collectives():
    m = MODELS["llama3-70b"]
    none, full, every_2 = (cluster(m, 1, tp=8, checkpointing=c) for c in ("none", "full", "every_2"))
    n = none.num_layers
    assert not none.layer_recompute_s and not none.layer_recompute_tp_s and none.split_factor() == 2.0
    # full: every block (1..n-2), neither the embedding nor the head; every_2: the even blocks.
    assert full.layer_recompute_s == tuple(f if 0 < i < n - 1 else 0.0 for i, f in enumerate(none.layer_forward_s))
    assert full.layer_recompute_tp_s == tuple(t if 0 < i < n - 1 else 0.0 for i, t in enumerate(none.layer_tp_s))
    assert [i for i, r in enumerate(every_2.layer_recompute_s) if r] == list(range(2, n - 1, 2))
    plan = _plan(none)
    for rank in plan.ranks:  # a stage's time grows by exactly its recomputed blocks' forwards and collectives
        i, j = plan.layers_of(rank)
        again = sum(none.layer_forward_s[i:j][k] + none.layer_tp_s[i:j][k] for k in range(j - i) if 0 < i + k < n - 1)
        assert full.stage_s(plan, rank) - none.stage_s(plan, rank) == pytest.approx(again, rel=1e-12)
    # The backward carries it: a forward of a block is 1/4 of its time with full recomputation (no TP).
    whole = cluster(m, 1, checkpointing="full")
    blocks = sum(whole.layer_forward_s[1:-1]) / sum(whole.layer_forward_s)
    assert whole.split_factor() == pytest.approx(2.0 + blocks)


def test_selective_runs_only_the_attention_core_again():
    m = MODELS["llama3-70b"]
    none, selective = cluster(m, 1), cluster(m, 1, checkpointing="selective")
    q = m.num_heads * m.head_width
    core = 2 * m.seq_len * q  # multiply-adds a token: the scores and the weighted sum of values
    costs = family(m).layer_costs()
    assert [c.core_flops_per_token for c in costs] == [0.0] + [float(core)] * (m.num_layers - 2) + [0.0]
    for i in range(1, m.num_layers - 1):  # the core's share of a block's forward, run once more
        assert selective.layer_recompute_s[i] == pytest.approx(none.layer_forward_s[i] * core / costs[i].flops_per_token)
    assert not selective.layer_recompute_tp_s  # no collective inside the core
    plan = _plan(none)
    assert step_time(plan, none).step_s < step_time(plan, selective).step_s < step_time(plan, cluster(m, 1, checkpointing="full")).step_s


def test_the_schedule_is_timed_with_the_recomputation_in_the_backward():
    """One stage of a 1F1B pipeline recomputing everything: its fill is the forwards alone, so the
    pipeline's time is 1F1B's exact timing with the backward carrying the recomputation."""
    m = MODELS["gpt-13b"]
    full = cluster(m, 1, checkpointing="full")
    plan = _plan(full, dp=1, pp=4, m=8)
    times = [full.stage_s(plan, r) for r in plan.pipelines[0]]
    assert step_time(plan, full).compute_s == pytest.approx(one_f_one_b_makespan(times, 8, full.split_factor()))
    assert full.split_factor() > replace(full, layer_recompute_s=(), layer_recompute_tp_s=()).split_factor() == 2.0


def test_elaswave_simulate_prices_the_recomputation_and_refuses_an_unknown_kind(capsys):
    argv = ["simulate", "--json", "--devices", "16", "--dp", "2", "--pp", "8", "--model", "gpt-13b", "--no-dvfs",
            "--policies", "elaswave_no_dvfs", "--device-gib", "0"]
    steps = {}
    for kind in ("none", "selective", "every_2", "full"):
        assert cli.main([*argv, "--checkpointing", kind]) == 0
        steps[kind] = json.loads(capsys.readouterr().out)["config"]["failure_free"]["step_s"]
    assert steps["none"] < steps["selective"] < steps["every_2"] < steps["full"]
    assert cli.main([*argv, "--checkpointing", "every_0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--checkpointing=every_0 is invalid" in err and "every_N" in err


def test_auto_recomputes_what_the_limit_needs_and_prices_it(capsys):
    """Interleaved llama3-70b at 60 GiB: keeping every activation does not fit; recomputing every
    block fits at a cost; auto fits recomputing only what each GPU needs, faster than full. Without
    a limit it recomputes nothing."""
    argv = ["simulate", "--json", "--devices", "128", "--tp", "8", "--dp", "2", "--pp", "8", "--model", "llama3-70b",
            "--micro-batches", "32", "--hardware", "h100", "--no-dvfs", "--policies", "elaswave_no_dvfs",
            "--schedule", "interleaved", "--virtual-stages", "2"]

    def run(*more):
        code = cli.main([*argv, *more])
        out = capsys.readouterr()
        return json.loads(out.out)["config"] if code == 0 else out.err

    assert "too small" in run("--checkpointing", "none", "--device-gib", "60")
    full, auto = (run("--checkpointing", c, "--device-gib", "60") for c in ("full", "auto"))
    assert auto["peak_gib"] <= 60 - 8 and full["peak_gib"] < auto["peak_gib"]
    assert full["failure_free"]["step_s"] > auto["failure_free"]["step_s"]
    unlimited = run("--checkpointing", "auto", "--device-gib", "0")
    assert unlimited["failure_free"]["step_s"] == run("--checkpointing", "none", "--device-gib", "0")["failure_free"]["step_s"]
    assert unlimited["failure_free"]["step_s"] < auto["failure_free"]["step_s"]
