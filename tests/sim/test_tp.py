"""Tensor parallelism in the simulator: a plan's device is a TP group of GPUs in one node -- a
shard's compute plus the group's all-reduces, a shard's memory, a GPU's failure its group's."""
import json
import math

import pytest

from elaswave import cli
from elaswave.plan.plan import initial_plan
from elaswave.sim import trace
from elaswave.sim.model import step_time
from elaswave.sim.model import ring_s
from elaswave.sim.workload import MODELS, cluster, layer_numels


def test_a_tp_group_computes_a_shard_and_pays_its_all_reduces():
    m = MODELS["llama3-70b"]
    whole, split = cluster(m, 1), cluster(m, 1, tp=8)
    assert split.layer_forward_s == pytest.approx([t / 8 for t in whole.layer_forward_s])
    assert split.activation_bytes == pytest.approx(whole.activation_bytes / 8)
    assert split.layer_param_bytes == pytest.approx([b / 8 for b in whole.layer_param_bytes])
    assert split.devices_per_node == 1 and not whole.layer_tp_s
    ring = 2 * ring_s(8, m.seq_len * m.d_model * 2, split.intra_node_latency_s, split.intra_node_bytes_per_s)
    assert split.layer_tp_s[0] == pytest.approx(ring / 2) and split.layer_tp_s[1] == pytest.approx(2 * ring)
    # The all-reduces are part of each stage's time: the same plan is slower with them than its shards alone.
    plan = initial_plan(8, 2, 4, list(split.layer_forward_s), 16, layer_numels(m), 1 << 24)
    from dataclasses import replace
    assert step_time(plan, split).compute_s > step_time(plan, replace(split, layer_tp_s=())).compute_s
    with pytest.raises(ValueError, match="tp=3 is invalid"):
        cluster(m, 1, tp=3)


def test_a_gpu_trace_is_seen_by_its_tp_groups():
    gpus = [trace.Event(1.0, "fail", 3), trace.Event(2.0, "fail", 1), trace.Event(3.0, "fail", 9),
            trace.Event(4.0, "join", 3), trace.Event(5.0, "join", 1), trace.Event(6.0, "join", 9)]
    got = trace.groups(gpus, 8)
    # Group 0 fails with GPU 3 and is back only when GPU 1 is too; group 1 with GPU 9.
    assert got == [trace.Event(1.0, "fail", 0), trace.Event(3.0, "fail", 1), trace.Event(5.0, "join", 0),
                   trace.Event(6.0, "join", 1)]
    assert trace.groups(gpus, 1) == gpus


def _simulate(capsys, *argv):
    code = cli.main(["simulate", "--devices", "16384", "--model", "gpt-175b", "--device-gib", "80",
                     "--checkpointing", "full", "--micro-batch-size", "16", "--policies", "elaswave,drop_replica",
                     *argv])
    out = capsys.readouterr()
    return code, out


def test_with_tp_the_16k_gpt_175b_layout_fits_80_gib(capsys):
    code, out = _simulate(capsys, "--dp", "1024", "--pp", "16")
    # The smallest memory that would fit is named: the best partition's need plus the reserve.
    assert code == 2 and "--device-gib=80 is too small for dp=1024 x pp=16" in out.err
    need = float(out.err.split("partition needs ")[1].split(" GiB")[0])
    assert need > 80 and f"give --device-gib {math.ceil(need)} or more" in out.err
    code, out = _simulate(capsys, "--dp", "1024", "--pp", "16", "--device-gib", str(math.ceil(need)))
    assert code == 0, out.err
    code, out = _simulate(capsys, "--dp", "256", "--pp", "8", "--tp", "8", "--trace", "llama3", "--hours", "6", "--json")
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert (doc["config"]["dp"], doc["config"]["pp"], doc["config"]["tp"]) == (256, 8, 8)
    assert doc["config"]["failures"] >= 1  # GPU failures, each taking its TP group
    elaswave = doc["policies"]["elaswave"]
    assert elaswave["batch_after_over_before"] == 1.0 and elaswave["throughput_after_over_before"] <= 1.0


def test_llama3_405b_on_16k_h100s_fits_and_trains_no_faster_than_its_schedule_allows(capsys):
    # Llama 3's own layout (arXiv:2407.21783, table 4): TP 8, PP 16, DP 128, 16 sequences of 8,192
    # tokens a pipeline; the sourced H100 preset, nominal clocks.
    code = cli.main(["simulate", "--devices", "16384", "--tp", "8", "--dp", "128", "--pp", "16", "--model",
                     "llama3-405b", "--micro-batches", "2048", "--hardware", "h100", "--no-dvfs", "--policies",
                     "elaswave_no_dvfs", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)["config"]
    free, hw = doc["failure_free"], doc["hardware"]
    assert hw["name"] == "h100" and doc["device_gib"] == 80  # it fits the default 80 GiB
    m, pp = 16, 16
    # No better than every GPU computing at the preset's share of the peak through 1F1B's fill and drain.
    assert 0 < free["mfu"] < hw["efficiency"] * m / (m + pp - 1)
    assert free["model_tflops_per_gpu"] == pytest.approx(free["mfu"] * hw["device_tflops"])


def test_a_node_failure_takes_every_gpu_of_the_node_and_its_groups_once():
    plain = trace.poisson(64, 10.0, 24, 4.0, seed=3)
    assert trace.poisson(64, 10.0, 24, 4.0, seed=3, node_share=0.0) == plain  # the old traces stay
    nodes = trace.poisson(64, 10.0, 24, 4.0, seed=3, node_share=1.0, per_node=8)
    trace.check(nodes, 64)
    fails = [e for e in nodes if e.kind == "fail"]
    at: dict[float, set[int]] = {}
    for e in fails:
        at.setdefault(e.t_s, set()).add(e.device // 8)
    assert fails and all(len(n) == 1 for n in at.values())  # one node at a time ...
    assert all(sum(e.t_s == t for e in fails) > 1 for t in at)  # ... and more than one GPU of it
    groups = trace.groups(nodes, 8)
    assert sum(e.kind == "fail" for e in groups) == len(at)  # with tp=8, a node is one group: one failure
    with pytest.raises(trace.TraceError, match="node_share=1.5 is invalid"):
        trace.poisson(64, 10.0, 24, 4.0, seed=3, node_share=1.5)


def test_a_node_lost_with_several_tp_groups_is_one_recovery(capsys):
    # Nodes of 8 GPUs, every failure a whole node: at tp=4 each failure takes two groups at once,
    # at tp=8 one; the job recovers once per node either way.
    seen = {}
    for tp in (4, 8):
        assert cli.main(["simulate", "--devices", "128", "--model", "gpt-1.3b", "--tp", str(tp), "--gpus-per-node", "8",
                         "--mtbf-h", "20", "--node-failures", "1.0", "--policies", "elaswave", "--seed", "1",
                         "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        seen[tp] = (doc["config"]["failures"], doc["policies"]["elaswave"]["failures"])
    assert seen[4][0] == 2 * seen[8][0] > 0  # the groups' failures in the trace ...
    assert seen[4][1] == seen[8][1] == seen[8][0]  # ... are one recovery per node


@pytest.mark.parametrize("argv,needle", [
    (["--dp", "2", "--pp", "4", "--device-gib", "80", "--reserve-gib", "90"], "--reserve-gib=90 is invalid"),
    (["--dp", "2", "--pp", "4", "--node-failures", "0.5"], "--node-failures=0.5 is invalid without a synthetic trace"),
    (["--dp", "2", "--pp", "4", "--tp", "3"], "--tp=3 is invalid"),
    (["--dp", "2", "--pp", "4", "--tp", "2"], "dp x pp x tp must equal the devices"),
    (["--tp", "8"], "need at least 2 TP groups"),
])
def test_bad_tp_input_is_one_line(argv, needle, capsys):
    assert cli.main(["simulate", "--devices", "8", "--model", "gpt-1.3b", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
