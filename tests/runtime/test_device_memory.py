"""The device memory a job plans within: ``parallel.stage_memory_mb`` auto / off / MiB, and the
founding ranks' agreement on the smallest GPU through a real store."""
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave import config
from elaswave.errors import ConfigError
from elaswave.runtime import device_memory
from tests.helpers.spawn import run_job

GPUS_MIB = [81559.0, 40960.0, 81559.0, 97871.0]  # H100 80GB, A100 40GB, H100, H200: what CUDA reports


def _agree_all(values, cfg, port_store, ranks=None):
    """Every rank's (limit, record) from ``stage_limit_mb``, each rank a thread with its own client."""
    out, errors = {}, []

    def rank(r):
        try:
            store = dist.TCPStore("127.0.0.1", port_store.port, is_master=False, timeout=timedelta(seconds=20))
            out[r] = device_memory.stage_limit_mb(cfg, store, r, len(values), values[r])
        except Exception as exc:  # noqa: BLE001 - said by the assert below
            errors.append(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (range(len(values)) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out, errors


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    yield server


def test_every_rank_plans_within_the_smallest_gpu_less_the_reserve(store):
    cfg = config.load(None, ["parallel.memory_reserve_mb=4096"])
    out, errors = _agree_all(GPUS_MIB, cfg, store)
    assert not errors, errors
    assert {limit for limit, _ in out.values()} == {40960.0 - 4096.0}
    assert all(doc["smallest_device_mb"] == 40960.0 and doc["source"] == "auto" for _, doc in out.values())


def test_a_reserve_the_smallest_gpu_cannot_keep_is_one_line(store):
    cfg = config.load(None, ["parallel.memory_reserve_mb=50000"])
    _, errors = _agree_all(GPUS_MIB, cfg, store)
    assert errors and all(isinstance(e, ConfigError) for e in errors)
    assert "parallel.memory_reserve_mb=50000 is invalid" in str(errors[0]) and "40960 MiB" in str(errors[0])


def test_a_founding_rank_that_never_posts_is_named_not_waited_for_forever(store):
    cfg = config.load(None, ["parallel.timeout_s=1"])
    _, errors = _agree_all(GPUS_MIB, cfg, store, ranks=[0, 1, 2])  # rank 3 died before posting
    said = sorted(str(e) for e in errors)
    assert len(said) == 3 and all(isinstance(e, TimeoutError) for e in errors)
    assert any("ranks [3] never posted theirs" in s for s in said), said


def test_a_configured_limit_or_off_needs_no_agreement_and_cpu_ranks_have_none():
    for value, limit, source in (("off", 0.0, "off"), ("0", 0.0, "off"), ("1234.5", 1234.5, "configured")):
        cfg = config.load(None, [f"parallel.stage_memory_mb={value}"])
        assert device_memory.stage_limit_mb(cfg, None, 0, 4, 81559.0) == (limit, {"source": source, "limit_mb": limit})
    got, doc = device_memory.stage_limit_mb(config.load(None, []), None, 0, 4, None)
    assert got == 0.0 and doc["source"] == "auto" and "CPU" in doc["why"]


@pytest.mark.parametrize("value", ["lots", "-5", "inf", "nan"])
def test_a_bad_stage_memory_is_one_line_naming_what_is_valid(value):
    with pytest.raises(ConfigError, match=rf"parallel.stage_memory_mb='{value}' is invalid.*auto.*off"):
        config.load(None, [f"parallel.stage_memory_mb={value}"])


def test_a_toml_number_is_a_limit(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[parallel]\nstage_memory_mb = 512\n")
    assert config.load(str(path), []).parallel.stage_memory_limit_mb == 512.0


def test_the_default_cpu_job_records_where_its_limit_came_from(tmp_path):
    res = run_job(tmp_path, 2, 1, 1, False)
    job = next(r for r in res.records if r["event"] == "job")
    assert job["memory_limit"]["source"] == "auto" and job["memory_limit"]["limit_mb"] == 0.0


def test_a_layout_the_agreed_memory_cannot_hold_names_the_least_it_needs():
    import torch

    from elaswave.runtime.memory import config_memory_model, least_stage_memory_mb
    cfg = config.load(None, [])
    model, memory = config_memory_model(cfg, torch.device("cpu"))
    least = least_stage_memory_mb(cfg, cfg.parallel.pp, cfg.parallel.dp)
    err = device_memory.unfit(cfg, {"limit_mb": least / 2, "smallest_device_mb": least / 2 + 8192},
                              model, memory)
    assert isinstance(err, ConfigError) and f"the least any needs is {least:.0f} MiB" in str(err)
    assert f"fits the {least / 2:.0f} MiB a rank" in str(err)


def test_the_least_memory_under_auto_recomputation_is_a_limit_the_planner_meets():
    """Where the plan recomputes what it must (train.activation_checkpointing=auto) it partitions by
    cost: the least named is that plan's largest rank with every block recomputed, and a plan at it
    fits (a memory-aware partition's minimax named less than any plan met)."""
    import torch

    from elaswave.model.contract import counted_numels, tie_pairs
    from elaswave.plan.plan import PlanError, initial_plan
    from elaswave.runtime.memory import config_memory_model, least_stage_memory_mb
    for dp, pp in ((1, 2), (1, 3), (2, 4)):
        cfg = config.load(None, ["train.activation_checkpointing=auto", f"parallel.dp={dp}", f"parallel.pp={pp}",
                                 "elastic.snapshot_copies=1"])
        model, memory = config_memory_model(cfg, torch.device("cpu"))
        least = least_stage_memory_mb(cfg, pp, dp)

        def plan(limit):
            return initial_plan(dp * pp, dp, pp, [c.flops_per_token for c in model.layer_costs()],
                                cfg.train.num_micro_batches, counted_numels(model), cfg.parallel.chunk_numel,
                                stage_memory_limit=limit, ties=tie_pairs(model), memory=memory,
                                units_per_micro_batch=cfg.train.micro_batch_size if cfg.elastic.reshape else 1)
        assert plan(least * 1.0001).recomputed
        with pytest.raises(PlanError, match="every block it runs recomputed"):
            plan(least * 0.999)
