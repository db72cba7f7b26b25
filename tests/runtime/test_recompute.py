"""The planner's recomputation in a real job (train.activation_checkpointing=auto): after a loss the
survivor that must hold the whole pipeline recomputes blocks to fit the memory limit and trains on
with the reference's bits, and keeps what the memory model says it keeps."""
import pytest
import torch

from elaswave import config
from elaswave.runtime.memory import least_stage_memory_mb
from tests.helpers.spawn import TINY, assert_same_run, run_job, run_reference

STEPS = 12
MBS = 4
# Larger micro-batches than the tiny job's, so activations are most of a rank's peak.
SHAPE = ["train.micro_batch_size=8", "data.max_corpus_bytes=50000"]
EXTRA = [*SHAPE, f"train.num_micro_batches={MBS}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_reference(tmp_path_factory.mktemp("ref"), STEPS, deterministic=True, num_micro_batches=MBS, extra=SHAPE)


def _rank_0(res, step: int = 7) -> dict:
    (measured,) = [m for r, m in zip(res.summary["ranks"], res.summary["memory_measured_per_rank"]) if r == 0]
    assert measured["step"] == step
    return measured


def test_a_survivor_recomputes_to_hold_its_pipeline_alone_with_the_reference_bits(tmp_path, reference):
    cfg = config.load(None, [*TINY, *EXTRA, "train.deterministic=true"])
    one = least_stage_memory_mb(cfg, 1, 2)  # the whole model on one rank, nothing recomputed
    auto = config.load(None, [*TINY, *EXTRA, "train.deterministic=true", "train.activation_checkpointing=auto"])
    least = least_stage_memory_mb(auto, 1, 2)  # the same, every block recomputed
    assert least < 0.8 * one, (least, one)
    limit = round((least + one) / 2, 2)
    sets = [*EXTRA, "elastic.detours=false", "elastic.inject=kill:rank=1,step=4", "train.measure_memory_step=7"]
    (tmp_path / "auto").mkdir()
    (tmp_path / "none").mkdir()
    res = run_job(tmp_path / "auto", 2, 2, STEPS, True, extra=[
        *sets, "train.activation_checkpointing=auto", f"parallel.stage_memory_mb={limit}"])
    assert_same_run(res, reference, STEPS)
    (rec,) = [r for r in res.records if r["event"] == "recovery"]
    plan = rec["plan"]
    assert plan["pipelines"][0] == [0] and plan["micro_batches"][0], "rank 0 trains on, alone"
    assert plan["recomputed"], "it recomputes to fit"
    # Measured, not only planned: rank 0 alone at step 7 keeps less than the same run keeping every
    # activation, by what the memory model says its recomputed blocks save.
    kept = run_job(tmp_path / "none", 2, 2, STEPS, True, extra=sets)
    assert_same_run(kept, reference, STEPS)
    got, full = _rank_0(res), _rank_0(kept)
    saved = full["peak_bytes"] - got["peak_bytes"]
    predicted = full["predicted"]["total"] - got["predicted"]["total"]
    assert predicted > 0 and 0.85 <= saved / predicted <= 1.15, (saved, predicted, got, full)


def test_interleaved_ranks_recompute_what_their_chunks_need_with_the_reference_bits(tmp_path, reference):
    """dp=1 x pp=2 x V=2 with a limit between what rank 0 keeps with every block recomputed and with
    none: it recomputes some of its chunks' blocks, bit-identical, and its measured peak falls by
    what the memory model says those blocks save."""
    from dataclasses import replace

    from elaswave.model.contract import counted_numels, tie_pairs
    from elaswave.plan.memory import MIB, rank_bytes
    from elaswave.plan.plan import initial_plan
    from elaswave.runtime.memory import config_memory_model

    layout = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    cfg = config.load(None, [*TINY, *EXTRA, *layout, "train.deterministic=true", "train.activation_checkpointing=auto",
                             "parallel.dp=1", "parallel.pp=2"])
    model, memory = config_memory_model(cfg, torch.device("cpu"))
    plan = initial_plan(2, 1, 2, [c.flops_per_token for c in model.layer_costs()], MBS, counted_numels(model),
                        cfg.parallel.chunk_numel, ties=tie_pairs(model), memory=memory, virtual_stages=2,
                        units_per_micro_batch=cfg.train.micro_batch_size if cfg.elastic.reshape else 1)
    blocks = tuple(range(1, model.num_layers - 1))
    keep, least = (rank_bytes(memory, replace(plan, recomputed=r), 0)["total"] / MIB for r in ((), blocks))
    limit = round((keep + least) / 2, 3)
    sets = [*EXTRA, *layout, "train.measure_memory_step=3"]
    (tmp_path / "auto").mkdir()
    (tmp_path / "none").mkdir()
    res = run_job(tmp_path / "auto", 1, 2, STEPS, True, extra=[
        *sets, "train.activation_checkpointing=auto", f"parallel.stage_memory_mb={limit}"])
    kept = run_job(tmp_path / "none", 1, 2, STEPS, True, extra=sets)
    for run in (res, kept):
        assert_same_run(run, reference, STEPS)
    got, full = (_rank_0(r, 3) for r in (res, kept))
    saved = full["peak_bytes"] - got["peak_bytes"]
    predicted = full["predicted"]["total"] - got["predicted"]["total"]
    assert predicted > 0 and 0.85 <= saved / predicted <= 1.15, (saved, predicted, got, full)
    assert got["predicted"]["total"] / MIB <= limit
