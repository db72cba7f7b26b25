"""A model's units (model/units.py): a dense model's are its layers; a mixture of experts' experts
are units of their own, each its own flat vector, held, summed, sharded and checkpointed by key --
and a run exported offline from its disk checkpoint equals the run's own export."""
import pytest
import torch
from safetensors.torch import load_file

from elaswave import config
from elaswave.model.contract import counted_numels
from elaswave.model.moe import SparseMoE
from elaswave.model.registry import model_for
from elaswave.model.units import units_of
from elaswave.pipeline.stage import Stage
from elaswave.plan.buckets import size_starts
from elaswave.plan.plan import initial_plan
from tests.helpers.spawn import run_cli

MOE = ["model.num_experts=6", "model.experts_per_token=3", "model.expert_ffn_dim=24", "model.qk_norm=true",
       "model.moe_sparse_step=2", "parallel.pp=1", "train.deterministic=true"]


def _model(sets):
    cfg = config.load(None, sets)
    return cfg, model_for(cfg)


def test_a_dense_models_units_are_its_layers():
    _, model = _model(["parallel.pp=1"])
    units = units_of(model)
    assert units.experts == () and units.count == model.num_layers
    assert list(units.numels) == counted_numels(model)


def test_each_expert_is_a_unit_whose_values_are_the_modules():
    cfg, model = _model(MOE)
    units = units_of(model)
    blocks = [i for i in range(model.num_layers)
              if any(isinstance(m, SparseMoE) for m in model.build_layer(i, 0, init=False).modules())]
    assert blocks and len(blocks) < model.num_layers - 2  # every other block (moe_sparse_step=2)
    assert units.experts == tuple((i, e) for i in blocks for e in range(6))
    assert units.layer_numels == tuple(counted_numels(model))
    stage = Stage(cfg, (0, model.num_layers), torch.device("cpu"), model)
    assert [u.index for u in stage.layers] == list(range(units.count))
    assert [u.numel for u in stage.layers] == list(units.numels)
    # Every trainable tensor of the model lives in exactly one unit's flat vector.
    owner = {}
    for unit in stage.layers:
        for p in unit.params:
            assert p.data_ptr() not in owner
            owner[p.data_ptr()] = unit.index
    for i in range(model.num_layers):
        block = next((m for m in stage.layers[i].module.modules() if isinstance(m, SparseMoE)), None)
        if block is None:
            assert i not in stage.followers
            continue
        experts = stage.followers[i]
        assert [u.index for u in experts] == units.of_layer(i)[1:]
        for e, expert in enumerate(block.experts):
            assert {owner[p.data_ptr()] for p in expert.parameters()} == {experts[e].index}
        # A new value in an expert's unit is the module's, which the forward reads.
        with torch.no_grad():
            experts[1].flat.add_(1.0)
        assert float(next(block.experts[1].parameters()).detach().min()) > 0.5
        assert owner[block.gate.weight.data_ptr()] == i


def test_a_plans_expert_units_are_held_with_their_layer_and_bucketed_in_layer_order():
    _, model = _model(MOE)
    units = units_of(model)
    plan = initial_plan(4, 2, 2, [1.0] * model.num_layers, 4, units.numels, 512, unit_layers=units.expert_layers,
                        bucket_starts=size_starts(units.numels, 3000, units.expert_layers))
    assert plan.num_units == units.count and len(plan.chunk_owners) == units.count
    for u in range(plan.num_layers, plan.num_units):
        assert plan.holders(u) == plan.holders(units.layer_of(u))
        assert set(plan.chunk_owners[u]) <= set(plan.holders(u))
    for holders, bucket in plan.gradient_buckets():
        layers = [units.layer_of(u) for u in bucket]
        assert layers == sorted(layers)
        assert sum(units.numels[u] for u in bucket) <= 3000 or len(bucket) == 1
    # Each holder group's units, once each, in layer order (a layer's own before its experts').
    seen = [u for _, bucket in plan.gradient_buckets() for u in bucket]
    assert sorted(seen) == list(range(units.count))


@pytest.mark.parametrize("ep", [1, 2])
def test_an_moe_runs_checkpoint_exports_offline_as_the_run_exported_it(tmp_path, ep):
    """At ep=2 each expert is held by its owner alone: its owner writes it into the run's export."""
    sets = [*MOE, "model.dropout=0", "parallel.dp=2", f"parallel.ep={ep}", "train.steps=3", "train.num_micro_batches=2",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=3", "checkpoint.export_dtype=fp32",
            f"checkpoint.export_hf={tmp_path / 'run'}"]
    res = run_cli(["run", *[x for s in sets for x in ("--set", s)]], tmp_path)
    assert res.returncode == 0, res.stderr
    res = run_cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "offline"), "--dtype", "fp32"], tmp_path)
    assert res.returncode == 0, res.stderr
    ran, offline = (load_file(tmp_path / d / "model.safetensors") for d in ("run", "offline"))
    assert sorted(ran) == sorted(offline) and any(".experts.5." in k for k in ran)
    assert all(torch.equal(ran[k], offline[k]) for k in ran)
