"""Calibrate the cluster model from a run's metrics, and check its predictions against other runs.

From one run's JSONL (its ``job`` record, step records and recovery record) the fit takes:

- each layer's forward time: the emulated time when the run was emulated (``emulate.*``), else the
  cost profile scaled so the predicted compute matches the measured one before the failure;
- the fixed cost per micro-batch and stage: what the measured compute phase leaves after the
  layers' time, per 1F1B slot;
- the fixed cost per step: step time minus the compute phase;
- the recovery's phases up to the first step (detect, agree, communicator, plan, state).

:func:`predict` then prices another run's plans -- the one before its failure and the one its
recovery record describes -- and its MTTR, next to what that run measured.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from elaswave import config
from elaswave.model.gpt import layer_flops
from elaswave.pipeline.emulate import layer_forward_s
from elaswave.plan.plan import Plan, initial_plan, replan
from elaswave.sim.model import ClusterModel, step_time


class CalibrationError(ValueError):
    """The metrics cannot calibrate or be predicted (what is missing is named)."""


def _parts(records: list[dict]):
    job = next((r for r in records if r.get("event") == "job"), None)
    if job is None:
        raise CalibrationError("the metrics have no job record (written by elaswave run since this version)")
    cfg = config.from_dict(job["config"])
    rec = next((r for r in records if r.get("event") == "recovery"), None)
    steps = [r for r in records if r.get("event") == "step"]
    first_change = rec["resume_step"] if rec else len(steps)
    before = [r for r in steps if 2 <= r["step"] < first_change and r["epoch"] == 0]
    after = [r for r in steps if rec and r["epoch"] == rec["epoch"] and r["step"] >= rec["resume_step"] + 2]
    if not before:
        raise CalibrationError("the run has no steady steps before its first failure (need steps 2.. before it)")
    return cfg, rec, before, after


def _initial(cfg) -> Plan:
    m = cfg.model
    return initial_plan(cfg.world_size, cfg.parallel.dp, cfg.parallel.pp,
                        [layer_flops(m, i) for i in range(m.num_layers)], cfg.train.num_micro_batches)


def fit(records: list[dict]) -> ClusterModel:
    cfg, rec, before, _ = _parts(records)
    plan = _initial(cfg)
    beta = cfg.emulate.backward_factor
    compute = statistics.median(r["phases_s"]["compute"] for r in before)
    step = statistics.median(r["step_time_s"] for r in before)
    slots = len(plan.micro_batches[0]) + len(plan.pipelines[0]) - 1
    if cfg.emulate.enabled:
        forward = layer_forward_s(cfg)
    else:  # scale the cost profile: the slowest stage takes the whole slot
        costs = [layer_flops(cfg.model, i) for i in range(cfg.model.num_layers)]
        slowest = max(sum(costs[i:j]) for i, j in plan.layer_ranges[0])
        forward = [c * compute / slots / (1 + beta) / slowest for c in costs]
    slowest_s = max(sum(forward[i:j]) for i, j in plan.layer_ranges[0]) * (1 + beta)
    phases = rec["phases_s"] if rec else {}
    return ClusterModel(
        layer_forward_s=tuple(forward), backward_factor=beta,
        per_microbatch_stage_s=max(0.0, compute / slots - slowest_s),
        step_overhead_s=max(0.0, step - compute),
        detect_s=phases.get("detect", 0.0), agree_s=phases.get("agree", 0.0),
        communicator_s=phases.get("communicator", 0.0), plan_s=phases.get("plan", 0.0) + phases.get("state", 0.0))


def after_plan(records: list[dict]) -> Plan:
    """The plan a run's first recovery made, rebuilt from its recovery record."""
    cfg, rec, _, _ = _parts(records)
    if rec is None:
        raise CalibrationError("the run has no recovery record")
    initial = _initial(cfg)
    doc = rec["plan"]
    if cfg.elastic.policy == "reroute":  # the routes do not depend on measured speeds: re-derive them
        return replan(initial, [r for p in doc["pipelines"] for r in p], rec["epoch"], cfg.train.num_micro_batches,
                      policy="reroute")
    ids, start = [], 0
    for count in doc["micro_batches"]:
        ids.append(tuple(range(start, start + count)))
        start += count
    return replace(initial, epoch=rec["epoch"], pipelines=tuple(tuple(p) for p in doc["pipelines"]),
                   layer_ranges=tuple(tuple(tuple(r) for r in rs) for rs in doc["layer_ranges"]),
                   micro_batches=tuple(ids), chunk_owners=(),
                   frequencies=tuple(tuple(f) for f in doc["frequencies"]) if doc["frequencies"] else ())


def predict(records: list[dict], model: ClusterModel) -> dict:
    """Predicted vs measured for a run: step time before and after its first recovery, the
    throughput ratio after/before, and the MTTR. Errors are relative (predicted / measured - 1)."""
    cfg, rec, before, after = _parts(records)
    out = {}
    pred_before = step_time(_initial(cfg), model)
    meas_before = statistics.median(r["step_time_s"] for r in before)
    out["step_before_s"] = (pred_before.step_s, meas_before)
    if rec is not None and after:
        pred_after = step_time(after_plan(records), model)
        meas_after = statistics.median(r["step_time_s"] for r in after)
        out["step_after_s"] = (pred_after.step_s, meas_after)
        ratio = lambda est_b, est_a: (est_a.samples / est_a.step_s) / (est_b.samples / est_b.step_s)  # noqa: E731
        meas_ratio = (statistics.median(r["num_samples"] / r["step_time_s"] for r in after)
                      / statistics.median(r["num_samples"] / r["step_time_s"] for r in before))
        out["after_over_before"] = (ratio(pred_before, pred_after), meas_ratio)
        recovery = model.detect_s + model.agree_s + model.communicator_s + model.plan_s
        out["mttr_s"] = (recovery + pred_after.step_s, rec["mttr_s"])
    return {k: {"predicted": p, "measured": m, "error": p / m - 1} for k, (p, m) in out.items()}
