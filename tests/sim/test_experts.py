"""Mixtures of experts in the simulator: each expert a unit held by its owners (the plan's, as the
runtime holds them), each MoE layer's all-to-all priced over its expert-parallel group's slowest
link, a lost rank under drop_replica taking its whole group (TorchFT keeps EP inside a replica)."""
import json
from dataclasses import replace

import pytest

from elaswave import cli
from elaswave.sim import policies
from elaswave.plan.plan import initial_plan
from elaswave.sim.model import step_time
from elaswave.sim.moves import held_units
from elaswave.sim.workload import MODELS, cluster, model_units

MOE = MODELS["mixtral-8x7b"]


def _plan(model, dp: int, pp: int, ep: int):
    units = model_units(MOE)
    return initial_plan(dp * pp, dp, pp, list(model.layer_costs), 2 * dp * pp, list(units.numels), 1 << 24,
                        unit_layers=units.expert_layers, ep=ep)


def test_each_unit_has_its_parameters_and_each_moe_layer_its_exchange():
    units = model_units(MOE)
    model = cluster(MOE, 1, ep=2)
    assert len(model.layer_param_bytes) == units.count > MOE.num_layers
    assert model.layer_param_bytes == pytest.approx([4.0 * n for n in units.numels])
    moe = set(units.expert_layers)
    rows = MOE.seq_len * MOE.experts_per_token * MOE.d_model * 2  # bf16 rows, one a token's pick
    # Dispatch and combine, in the forward and the backward; a recomputed block's forward again.
    assert model.layer_exchange_bytes == tuple(4.0 * rows if i in moe else 0.0 for i in range(MOE.num_layers))
    full = cluster(MOE, 1, checkpointing="full", ep=2)
    assert full.layer_exchange_bytes == tuple(6.0 * rows if i in moe else 0.0 for i in range(MOE.num_layers))
    assert not cluster(MOE, 1).layer_exchange_bytes  # ep = 1: every expert where its tokens are


@pytest.mark.parametrize("per_node", [8, 2, 1])
def test_a_stage_pays_its_exchanges_over_the_groups_slowest_link(per_node):
    """dp = 2 x pp = 2 at ep = 2: the team layout makes stage 0's group ranks 0 and 1 (pipelines
    (0, 2) and (1, 3)), inside one node of 8 or of 2, across two of 1."""
    model = replace(cluster(MOE, 1, ep=2), devices_per_node=per_node)
    plan = _plan(model, 2, 2, 2)
    assert plan.pipelines == ((0, 2), (1, 3)) and plan.expert_group[0] == (0, 1)
    alone = replace(plan, ep=1)
    i, j = plan.layer_ranges[0][0]
    layers = sum(1 for b in model.layer_exchange_bytes[i:j] if b)
    bw, lat = ((model.intra_node_bytes_per_s, model.intra_node_latency_s) if per_node > 1
               else (model.inter_node_bytes_per_s, model.inter_node_latency_s))
    exchanged = sum(model.layer_exchange_bytes[i:j]) / 2 / bw + 4 * layers * lat  # half the rows leave
    assert model.chunk_s(plan, 0, 0) - model.chunk_s(alone, 0, 0) == pytest.approx(exchanged)
    assert step_time(plan, model).step_s > step_time(alone, model).step_s


def test_a_rank_holds_its_layers_and_only_the_experts_it_owns():
    model = cluster(MOE, 1, ep=2)
    plan = _plan(model, 2, 1, 2)
    units = model_units(MOE)
    mine, theirs = held_units(plan, 0), held_units(plan, 1)
    assert set(range(MOE.num_layers)) <= mine & theirs
    experts = set(range(units.num_layers, units.count))
    assert (mine | theirs) >= experts and not (mine & theirs & experts)


def test_a_restart_runs_whole_expert_parallel_groups_on_whole_hosts():
    """64 GPUs, dp = 4 x pp = 16 at ep = 2, a GPU of host 0 lost: the restarted job runs 2 pipelines
    (its data-parallel ranks a multiple of ep), on whole hosts only, so that each stage's group is two
    GPUs of one host as in the first layout."""
    model = replace(cluster(MOE, 1, ep=2), devices_per_node=8)
    plan = _plan(model, 4, 16, 2)
    restart = policies.make("restart", plan, 8, model, policies.BaselineCosts())
    after = restart.rebuild([r for r in range(64) if r != 5])
    assert len(after.pipelines) == 2 and all(r >= 8 for r in after.ranks)
    assert all(len({m // 8 for m in after.expert_group[r]}) == 1 and len(after.expert_group[r]) == 2 for r in after.ranks)


def test_a_stage_waits_for_its_groups_busiest_owner_and_a_static_map_makes_one():
    """dp = ep = 4, one stage: 8 experts a block, 2 a member. Rank 2 lost: by load its experts go
    to two members (3, 3, 2: the busiest 9/8 of an even share); the static-expert-map baseline gives
    both to one backup (4, 2, 2: 12/8). The stage takes each MoE layer's expert share of its compute
    that much longer (every block recomputed: its experts run again; under selective they do not);
    the static baseline is the same policy with that one difference."""
    model = cluster(MOE, 1, ep=4, checkpointing="full")
    assert cluster(MOE, 1, ep=4, checkpointing="selective").layer_expert_again == (0.0,) * len(model.layer_forward_s)
    plan = _plan(model, 4, 1, 4)
    assert set(plan.expert_imbalance.values()) == {1.0}  # (an even placement adds nothing)
    rebuilt = {}
    for name in ("elaswave", "static_experts"):
        policy = policies.make(name, plan, 8, model, policies.BaselineCosts())
        rebuilt[name] = policy.rebuild([0, 1, 3])
    load, static = rebuilt["elaswave"], rebuilt["static_experts"]
    assert static.expert_map == "static" and load.expert_map == "load"
    assert set(load.expert_imbalance.values()) == {9 / 8} and set(static.expert_imbalance.values()) == {12 / 8}
    # Forward, backward (2x) and the recomputed block's forward again: the experts' share of each.
    work = sum(share * model.layer_forward_s[i] * (3 + model.layer_expert_again[i])
               for i, share in enumerate(model.layer_expert_share))
    assert work == pytest.approx(4 * sum(share * f for share, f in zip(model.layer_expert_share, model.layer_forward_s)))
    assert work > 0 and static.micro_batches == load.micro_batches
    assert model.chunk_s(static, 0, 0) - model.chunk_s(load, 0, 0) == pytest.approx(work * (12 - 9) / 8)


def _simulate(capsys, *argv):
    code = cli.main(["simulate", "--model", "mixtral-8x7b", "--hardware", "h100", "--clocks", "sustained",
                     "--checkpointing", "full", "--device-gib", "0", "--json", *argv])
    out = capsys.readouterr()
    return code, out


def test_drop_replica_loses_the_whole_expert_parallel_group(capsys):
    code, out = _simulate(capsys, "--devices", "64", "--pp", "16", "--ep", "2", "--policies", "drop_replica,restart")
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["config"]["ep"] == 2 and doc["config"]["dp"] == 4
    # A lost GPU's pipeline and its group mate stop: half the batch of four pipelines.
    assert doc["policies"]["drop_replica"]["batch_after_over_before"] == pytest.approx(0.5)


@pytest.mark.parametrize("argv,needle", [
    (["--devices", "64", "--pp", "16", "--ep", "3"], "--ep=3 is invalid: must divide the pipelines (dp=4)"),
    (["--devices", "64", "--pp", "16", "--ep", "2", "--model", "llama3-8b"], "--ep=2 is invalid with llama3-8b"),
    (["--devices", "64", "--pp", "8", "--tp", "2"], "--tp=2 is invalid with mixtral-8x7b"),
])
def test_bad_expert_parallel_input_is_one_line(capsys, argv, needle):
    code, out = _simulate(capsys, *argv)
    assert code == 2 and needle in out.err and "Traceback" not in out.err, out.err


@pytest.mark.parametrize("ep", [1, 4])
def test_the_partition_and_the_plan_price_a_ranks_experts_alike(ep):
    """The partition prices a stage's experts at 1/ep before the plan places them
    (MemoryModel.expert_share); the plan's peak of each rank counts the experts it was given --
    its layers, sums, overlapped buckets: within 2 % of the partition's, and below ep = 1's."""
    from elaswave.plan.memory import rank_bytes
    from elaswave.runtime.memory import MIB
    from elaswave.sim.memory import job_memory
    cfg, model, memory = job_memory(["model.num_experts=8", "model.experts_per_token=2", "model.expert_ffn_dim=256",
                                     "model.d_model=128", "model.num_heads=4", "model.num_blocks=6", "model.seq_len=64",
                                     "train.precision=bf16", f"parallel.ep={ep}", "parallel.dp=4", "parallel.pp=2"])
    units = model_units(cfg.model)
    plan = initial_plan(8, 4, 2, [1.0] * model.num_layers, 8, list(units.numels), cfg.parallel.chunk_numel,
                        memory=memory, unit_layers=units.expert_layers, ep=ep)
    stage = memory.stage_memory(2, 4, 8)
    peaks = {}
    for r in plan.ranks:
        d, s = plan.position(r)
        i, j = plan.layer_ranges[d][s]
        peaks[r] = rank_bytes(memory, plan, r)["total"] / MIB
        assert peaks[r] == pytest.approx(stage(s, i, j), rel=0.02)
    if ep > 1:
        one = initial_plan(8, 4, 2, [1.0] * model.num_layers, 8, list(units.numels), cfg.parallel.chunk_numel,
                           memory=replace(memory, expert_share=1.0), unit_layers=units.expert_layers)
        assert all(peaks[r] < rank_bytes(memory, one, r)["total"] / MIB for r in plan.ranks)
