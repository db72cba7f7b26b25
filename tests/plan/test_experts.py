"""Expert placement: groups of a stage's pipelines, contiguous blocks, the minimax by load, and
each expert's holders in a plan -- its owners, kept through losses and given back by joins."""
import itertools
import random
from dataclasses import replace

import pytest

from elaswave.plan.experts import busiest_share, by_load, contiguous, groups_of, place, team_layout, unite_recomputation
from elaswave.plan.plan import PlanError, initial_plan
from elaswave.plan.replan import replan


def test_groups_cut_the_pipelines_in_order_the_last_group_smaller():
    assert groups_of([3, 0, 2, 1], 2) == [(0, 1), (2, 3)]
    assert groups_of([0, 2, 3], 2) == [(0, 2), (3,)]
    assert groups_of([5], 4) == [(5,)]
    with pytest.raises(ValueError, match="parallel.ep=0"):
        groups_of([0, 1], 0)


def test_the_team_layout_puts_each_stages_group_side_by_side():
    """With ep > 1 a team of ep pipelines takes ep x pp consecutive ranks, each stage's ep side by
    side (one host's GPUs); otherwise a pipeline's stages are neighbours."""
    assert team_layout(4, 2, 2) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert team_layout(4, 2, 1) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert team_layout(3, 2, 2) == ((0, 1), (2, 3), (4, 5))  # (ep must divide dp: the configuration says so)


def test_contiguous_blocks_as_megatron_lays_them_out():
    assert contiguous(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert contiguous(8, 3) == (0, 0, 0, 1, 1, 1, 2, 2)
    assert place(8, 1) == (0,) * 8
    assert place(4, 2, [0.0] * 4) == (0, 0, 1, 1)  # no counts yet: blocks


def test_by_load_is_optimal_on_small_cases_within_lpts_bound():
    """LPT's makespan is at most 4/3 of the optimum; on these it is found exactly or nearly."""
    rng = random.Random(0)
    for _ in range(200):
        E, n = rng.randint(2, 7), rng.randint(2, 3)
        loads = [float(rng.randint(0, 20)) for _ in range(E)]
        owners = by_load(loads, n)
        busiest = max(sum(l for l, o in zip(loads, owners) if o == m) for m in range(n))
        best = min(max(sum(l for l, o in zip(loads, assign) if o == m) for m in range(n))
                   for assign in itertools.product(range(n), repeat=E))
        assert busiest <= best * 4 / 3 + 1e-9, (loads, owners)


def test_a_hot_expert_gets_a_member_to_itself():
    loads = [100.0, 10.0, 10.0, 10.0, 10.0, 10.0]
    owners = place(6, 2, loads)
    assert [e for e, o in enumerate(owners) if o == owners[0]] == [0]
    assert busiest_share(owners, loads, 2) == pytest.approx(100 / 75)
    assert busiest_share(contiguous(6, 2), loads, 2) == pytest.approx(120 / 75)


def test_every_rank_computes_the_same_placement_from_the_same_counts():
    loads = [5.0, 5.0, 5.0, 5.0]  # ties everywhere: broken by counts, then index
    assert by_load(loads, 2) == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="3 expert loads for 4 experts"):
        place(4, 2, [1.0, 2.0, 3.0])


# -- holders: each expert held by its owner in each group of its stage (Plan.expert_holders) --------

LAYERS = 6
UNIT_LAYERS = (2,) * 4 + (3,) * 4  # layers 2 and 3 have 4 experts each: units 6..9 and 10..13
NUMELS = [100] * LAYERS + [50] * 8


def _plan(world: int, dp: int, pp: int, mbs: int, ep: int):
    return initial_plan(world, dp, pp, [1.0] * LAYERS, mbs, NUMELS, 16, unit_layers=UNIT_LAYERS, ep=ep)


def _owner_in(plan, unit: int, group) -> list[int]:
    return [r for r in plan.holders(unit) if r in group]


def test_each_expert_has_one_owner_in_each_group_and_its_chunks_are_its_owners():
    plan = _plan(4, 4, 1, 8, 2)
    assert set(plan.expert_group.values()) == {(0, 1), (2, 3)}
    for u in range(LAYERS, LAYERS + 8):
        assert all(len(_owner_in(plan, u, g)) == 1 for g in [(0, 1), (2, 3)])
        assert set(plan.chunk_owners[u]) <= set(plan.holders(u))
    # Contiguous blocks (no counts yet): the first member the first two experts of each block.
    assert [plan.holders(u) for u in range(LAYERS, LAYERS + 4)] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    assert plan.experts_held(0) == frozenset({6, 7, 10, 11})
    # Without expert parallelism every holder of a layer holds its experts.
    assert _plan(4, 4, 1, 8, 1).experts_held(0) is None
    assert _plan(4, 4, 1, 8, 1).holders(6) == (0, 1, 2, 3)


def test_a_loss_keeps_every_survivors_experts_and_places_the_lost_owners_by_load():
    plan = _plan(4, 4, 1, 12, 4)
    assert [plan.holders(u) for u in range(LAYERS, LAYERS + 4)] == [(0,), (1,), (2,), (3,)]
    loads = (1.0, 1.0, 1.0, 9.0) + (5.0, 1.0, 1.0, 1.0)  # expert 3 of layer 2 is hot; expert 0 of layer 3
    after = replan(replace(plan, expert_loads=loads), [0, 1, 3], 1, 12)
    assert after.expert_group[0] == (0, 1, 3)
    kept = {u: plan.holders(u) for u in range(LAYERS, LAYERS + 8) if plan.holders(u) != (2,)}
    assert all(after.holders(u) == h for u, h in kept.items())
    # Rank 2's experts (units 8 and 12) go to the least loaded member of each block by the counts:
    # in layer 2 not to rank 3 (the hot expert's); in layer 3 not to rank 0 (its hot one).
    assert after.holders(8) == (0,) and after.holders(12) == (1,)
    assert after.chunk_owners[8] == (0,) * len(after.chunk_owners[8])


def test_a_pipeline_running_its_own_schedule_holds_every_expert_and_a_join_gives_them_back():
    plan = _plan(4, 4, 1, 8, 2)
    after = replan(plan, [0, 1, 3], 1, 8)  # rank 2 lost: rank 3 alone in its team (2, 3)
    assert after.expert_group[3] == (3,)
    assert all(3 in after.holders(u) for u in range(LAYERS, LAYERS + 8))
    joined = replan(after, [0, 1, 3, 4], 2, 8)
    assert joined.expert_group[3] == (3, 4) and joined.teams == (0, 0, 1, 1)  # the joiner fills team 1
    for layer_units in (range(6, 10), range(10, 14)):
        mine = [u for u in layer_units if 3 in joined.holders(u)]
        theirs = [u for u in layer_units if 4 in joined.holders(u)]
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs)


def test_a_loss_leaves_the_other_teams_groups_and_experts_where_they_were():
    """dp = 8 x pp = 2 at ep = 2 loses rank 3 (team 0): every rank of teams 1-3 keeps its group and
    its experts, and within each group the counts are evened by ghosts. 17 micro-batches: at first
    pipeline 0 runs 3, its team mate 2 and a ghost (numbered after every real id)."""
    plan = _plan(16, 8, 2, 17, 2)
    assert [len(m) for m in plan.micro_batches] == [3] + [2] * 7 and plan.ghosts == ((), (17,)) + ((),) * 6
    after = replan(plan, [r for r in range(16) if r != 3], 1, 17)
    for r in range(4, 16):
        assert after.expert_group[r] == plan.expert_group[r] and after.experts_held(r) == plan.experts_held(r)
    for p, pipe in enumerate(after.pipelines):
        if after.micro_batches[p]:
            mates = {after.position(m)[0] for m in after.expert_group[pipe[0]]}
            assert {len(after.schedule_of(q)) for q in mates} == {max(len(after.micro_batches[q]) for q in mates)}
    assert sum(map(len, after.micro_batches)) == 17


def test_a_ghost_is_in_flight_in_the_memory_model():
    """dp = 4 x pp = 4 at ep = 2, 5 micro-batches: 2, 1, 1, 1, pipeline 1 running a ghost. Its
    first stage keeps two micro-batches in flight as its mate's does (the ghost's experts work on
    the mate's rows), and is modelled so."""
    from elaswave.plan.memory import MIB, MemoryModel, rank_bytes
    memory = MemoryModel(layer_numels=tuple(NUMELS[:LAYERS]), layer_activation_bytes=(50.0 * MIB,) * LAYERS,
                         boundary_bytes=4.0 * MIB, param_bytes=2, sum_bytes=4, chunk_numel=16)
    plan = initial_plan(16, 4, 4, [1.0] * LAYERS, 5, NUMELS, 16, memory=memory, unit_layers=UNIT_LAYERS, ep=2)
    assert [len(m) for m in plan.micro_batches] == [2, 1, 1, 1] and plan.ghosts[1] == (5,)
    first = [rank_bytes(memory, plan, plan.pipelines[p][0])["activations"] for p in range(4)]
    assert first[0] == first[1] > first[2] == first[3]


def test_the_reroute_baseline_and_reshaping_hold_every_expert_where_computed():
    plan = _plan(4, 2, 2, 4, 2)
    routed = replan(plan, [0, 1, 2], 1, 4, policy="reroute")
    assert routed.routes and all(routed.expert_group[r] == (r,) for r in routed.ranks)
    for u in range(LAYERS, LAYERS + 8):
        layer = UNIT_LAYERS[u - LAYERS]
        assert set(routed.holders(u)) == {r for r in routed.ranks if any(a <= layer < b for a, b in routed.chunk_ranges(r))}


def test_a_group_recomputes_the_union_of_its_members_blocks():
    plan = replace(_plan(4, 4, 1, 8, 2), recomputed=(((2,),), ((3,),), ((),), ((),)))
    united = unite_recomputation(plan)
    assert united.recomputed == (((2, 3),), ((2, 3),), ((),), ((),))


def test_a_dropped_pipeline_holds_no_expert_and_drop_replica_drops_the_expert_parallel_group():
    """TorchFT keeps expert parallelism inside a replica group: losing rank 3 (pipeline 1) takes
    pipeline 0, its group mate, out too; the idle pipelines hold no expert, the others keep theirs."""
    plan = _plan(8, 4, 2, 8, 2)
    after = replan(plan, [r for r in range(8) if r != 3], 1, 8, policy="drop_replica")
    assert after.micro_batches[:2] == ((), ()) and after.micro_batches[2:] == plan.micro_batches[2:]
    assert all(after.experts_held(r) == frozenset() for r in (0, 1, 2))
    assert all(after.experts_held(r) == plan.experts_held(r) for r in (4, 5, 6, 7))
    with pytest.raises(PlanError, match="drops the expert-parallel groups"):
        replan(after, [r for r in after.ranks if r != 5], 2, 8, policy="drop_replica")


def test_a_new_groups_experts_are_placed_by_load_not_by_count():
    from elaswave.plan.experts import _keep_and_place
    assert _keep_and_place([[], [], [], []], (0, 2), [10, 1, 1, 1]) == [0, 1, 1, 1]  # loads 10 and 3
    assert _keep_and_place([[3]] * 4, (3, 4), []) == [0, 0, 1, 1]  # a joiner takes its share
    # The static-expert-map baseline: orphans to the first member, nothing moves.
    assert _keep_and_place([[5], [], [6], []], (5, 6, 7), [], static=True) == [0, 0, 1, 0]
    assert _keep_and_place([[5], [], [6], []], (5, 6, 7), []) == [0, 2, 1, 0]  # (by load: one each first)


def test_the_busiest_owner_is_measured_against_an_even_share():
    """dp = 4 at ep = 4, 8 experts a block: 2 a member (even: 1.0). Rank 2 lost: by load its two
    experts go to two members (3, 3, 2 of 8 among 3: 3 x 3 / 8); with a static map both go to rank 0
    (4 x 3 / 8)."""
    plan = initial_plan(4, 4, 1, [1.0] * LAYERS, 8, NUMELS[:LAYERS] + [NUMELS[LAYERS]] * 16, 16,
                        unit_layers=(2,) * 8 + (3,) * 8, ep=4)
    assert set(plan.expert_imbalance.values()) == {1.0}
    for expert_map, busiest in (("load", 9 / 8), ("static", 12 / 8)):
        after = replan(replace(plan, expert_map=expert_map), [0, 1, 3], 1, 8)
        assert after.expert_map == expert_map and after.expert_group[0] == (0, 1, 3)
        assert after.expert_imbalance == {((0, 1, 3), 2): busiest, ((0, 1, 3), 3): busiest}


def test_a_loss_leaves_the_other_teams_groups_whole_and_concentration_past_the_limit_is_refused_in_words():
    """Four pipelines of two stages at ep = 2 (teams (0, 1) and (2, 3)) lose rank 3, pipeline 1's
    second stage: pipeline 1 stands by, pipeline 0 is left alone in its team and holds every expert
    of its layers; team 1 keeps its groups, its pipeline dealt 2 micro-batches running a ghost to
    match the other's 3. That fits 9000 MiB. Under 8500 pipeline 0 stands by too: team 0's ranks
    keep the experts they held (their state where it was, no holder group shrinking), and team 1
    takes the batch. Under 8100 that leaves rank 7 (holding rank 3's experts' whole state) over the
    limit: a refusal naming the way out, where ep = 1 fits (the memory model's own peaks)."""
    from elaswave.plan.memory import MIB, MemoryModel, rank_bytes
    layers, moe = 6, [1, 2, 3, 4]
    unit_layers = tuple(layer for layer in moe for _ in range(4))
    own, experts, m = [20 << 20] * layers, [25 << 20] * len(unit_layers), 1 << 20
    whole = list(own)
    for layer, n in zip(unit_layers, experts):
        whole[layer] += n
    memory = MemoryModel(layer_numels=tuple(whole), layer_activation_bytes=(50.0 * MIB,) * layers,
                         boundary_bytes=4.0 * MIB, param_bytes=2, sum_bytes=4, chunk_numel=m, expert_numels=tuple(experts))

    def lose_rank_3(ep: int, limit: float):
        plan = initial_plan(8, 4, 2, [1.0] * layers, 8, own + experts, m, memory=memory, unit_layers=unit_layers,
                            ep=ep, stage_memory_limit=limit)
        return replan(plan, [r for r in range(8) if r != 3], 1, 8)
    after = lose_rank_3(2, 9000.0)
    assert after.pipelines == ((0, 2), (1,), (4, 6), (5, 7)) and after.micro_batches[1] == ()
    assert [len(m) for m in after.micro_batches] == [3, 0, 3, 2] and after.ghosts == ((), (), (), (8,))
    assert [after.expert_group[r] for r in (0, 2, 4, 6)] == [(0,), (2,), (4, 5), (6, 7)]
    assert after.experts_held(0) == frozenset(u for u in range(layers, layers + 16) if unit_layers[u - layers] < 3)
    assert max(rank_bytes(memory, after, r)["total"] for r in after.ranks) / MIB <= 9000.0
    first = initial_plan(8, 4, 2, [1.0] * layers, 8, own + experts, m, memory=memory, unit_layers=unit_layers, ep=2)
    tight = lose_rank_3(2, 8500.0)
    assert [len(m) for m in tight.micro_batches] == [0, 0, 4, 4]
    assert all(tight.experts_held(r) == first.experts_held(r) for r in (0, 1, 2))
    assert max(rank_bytes(memory, tight, r)["total"] for r in tight.ranks) / MIB <= 8500.0
    assert max(rank_bytes(memory, lose_rank_3(1, 8100.0), r)["total"] for r in range(8) if r != 3) / MIB <= 8100.0
    with pytest.raises(PlanError, match=r"rank 7 would hold \d+ MiB at its peak with the experts the plan gives it.*"
                                        r"parallel.ep=1"):
        lose_rank_3(2, 8100.0)


# -- groups: cut among the pipelines that run one schedule, so every member issues the same exchanges --
def _group(plan, rank: int, ep: int) -> tuple[int, ...]:
    return replace(plan, ep=ep).expert_group[rank]


def test_groups_are_cut_among_pipelines_with_one_schedule():
    plan = initial_plan(4, 4, 1, [1.0] * 6, 8)
    assert [_group(plan, r, 2) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [_group(plan, r, 4) for r in range(4)] == [(0, 1, 2, 3)] * 4
    assert _group(plan, 2, 1) == (2,)
    # 8 micro-batches over 3 survivors: 3, 3 and 2 -- one group, the pipeline of 2 running a ghost.
    after = replace(replan(plan, [0, 1, 3], 1, 8), ep=4)
    assert sorted(map(len, after.micro_batches)) == [2, 3, 3]
    assert [after.expert_group[r] for r in (0, 1, 3)] == [(0, 1, 3)] * 3
    assert [len(m) + len(g) for m, g in zip(after.micro_batches, after.ghosts)] == [3, 3, 3]
    assert sorted(after.schedule_of(p) for p in range(3))[-1][-1] == 8  # a ghost, after every real id


def test_a_stage_groups_with_the_same_stage_of_pipelines_split_alike():
    plan = initial_plan(4, 2, 2, [1.0] * 6, 4)
    assert [_group(plan, r, 2) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    after = replan(plan, [0, 1, 2], 1, 4)  # pipeline 1 lost its second stage: another schedule
    assert all(_group(after, r, 2) == (r,) for r in after.ranks)
