"""Calibrate the cluster model from a run's metrics, and check its predictions against other runs.

From one run's JSONL (its ``job`` record, step records and recovery record) the fit takes:

- each layer's forward time: the emulated time when the run was emulated (``emulate.*``), else
  (real compute) the model's cost profile (multiply-adds per token) scaled so that the runtime's
  1F1B order on the initial plan takes the measured compute phase before the failure -- exactly:
  the 1F1B makespan is proportional to the stage times;
- the fixed cost per micro-batch and stage: what the measured compute phase leaves after the
  layers' time, per 1F1B slot (emulated compute; in real compute the layers take it all: one run
  cannot tell a fixed cost from the layers' time, so it is 0);
- the fixed cost per step: step time minus the compute phase (and minus the holder groups'
  collectives when the links are fitted);
- the recovery's phases up to the first step (detect, agree, communicator, plan, state).

:func:`fit_links` fits the link -- a latency per ring hop and a bandwidth -- from the collectives
that runs of different sizes timed: each step record carries the metrics writer's gradient sum
(``reduce``) and parameter all-gather (``gather``); the bytes each moved follow from the job's
model and plan. The bandwidth is an effective one: it includes packing the bucket, as the step does.

:func:`predict` then prices another run's plans -- the one before its failure and the one its
recovery record describes -- and its MTTR, next to what that run measured. A run of another model
shape (width, depth, sequence length, micro-batch size) is priced by the fitted model carried to it
with :func:`for_run`: its layers' emulated times, or in real compute the fitted seconds per
multiply-add times its own layers' multiply-adds; its parameter bytes for the link.

What a real-compute fit cannot know: the backward's share of a layer (``emulate.backward_factor``
is taken, 2 by default: it shapes 1F1B's fill and drain only), how well another width uses the
processor (time per multiply-add is taken to be the same), and contention -- ranks that share
cores compute slower the more of them are busy, which per-rank compute times do not model.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from elaswave import config
from elaswave.model.contract import counted_numels, tie_pairs
from elaswave.model.registry import model_for
from elaswave.pipeline.emulate import layer_forward_s
from elaswave.plan.plan import Plan, initial_plan
from elaswave.plan.replan import replan
from elaswave.sim.model import ClusterModel, step_time


class CalibrationError(ValueError):
    """The metrics cannot calibrate or be predicted (what is missing is named)."""


def _config(records: list[dict]):
    job = next((r for r in records if r.get("event") == "job"), None)
    if job is None:
        raise CalibrationError("the metrics have no job record (written by elaswave run since this version)")
    return config.from_dict(job["config"])


def _parts(records: list[dict]):
    cfg = _config(records)
    rec = next((r for r in records if r.get("event") == "recovery"), None)
    steps = [r for r in records if r.get("event") == "step"]
    first_change = rec["resume_step"] if rec else len(steps)
    before = [r for r in steps if 2 <= r["step"] < first_change and r["epoch"] == 0]
    after = [r for r in steps if rec and r["epoch"] == rec["epoch"] and r["step"] >= rec["resume_step"] + 2]
    if not before:
        raise CalibrationError("the run has no steady steps before its first failure (need steps 2.. before it)")
    return cfg, rec, before, after


def _initial(cfg) -> Plan:
    model = model_for(cfg)
    return initial_plan(cfg.world_size, cfg.parallel.dp, cfg.parallel.pp, _flops(cfg), cfg.train.num_micro_batches,
                        ties=tie_pairs(model))


def _flops(cfg) -> list[float]:
    return [c.flops_per_token for c in model_for(cfg).layer_costs()]


def _writers_group(cfg, plan: Plan) -> tuple[int, float]:
    """(holders, parameter bytes) of the metrics writer's holder group (the writer is the plan's
    first rank; its phases are the ones recorded)."""
    numels = counted_numels(model_for(cfg))
    for holders, layers in plan.holder_groups().items():
        if plan.ranks[0] in holders:
            return len(holders), 4.0 * sum(numels[i] for i in layers)
    raise CalibrationError("the metrics writer holds no layers")


def _link_terms(cfg, plan: Plan) -> list[tuple[str, float, float]]:
    """Per timed phase: (phase, ring hops, bytes per hop summed over hops) -- the phase's time is
    ``hops * latency + bytes / bandwidth``."""
    n, param_bytes = _writers_group(cfg, plan)
    if n < 2:
        return []
    grad = param_bytes * (2 if cfg.train.deterministic else 1)  # fixed point: 8 bytes a value
    rings = 1 if cfg.parallel.backend == "nccl" else 2  # gloo sums with a whole all-reduce
    return [("reduce", rings * (n - 1), rings * (n - 1) * grad / n), ("gather", n - 1, (n - 1) * param_bytes / n)]


def fit_links(runs: list[list[dict]]) -> tuple[float, float]:
    """(latency per hop in s, bytes per s) by least squares over the timed collectives of ``runs``
    (per run, the median over the steady steps before its first change); both kept >= 0."""
    rows = []
    for records in runs:  # per run: gradient sum and parameter gather together (which one a wait lands in varies)
        cfg, _, before, _ = _parts(records)
        _refuse_overlapped_gathers(cfg, "fit a link from")
        terms = _link_terms(cfg, _initial(cfg))
        if terms:
            rows.append((sum(h for _, h, _ in terms), sum(b for _, _, b in terms),
                         statistics.median(r["phases_s"]["reduce"] + r["phases_s"]["gather"] for r in before)))
    scale = max((b for _, b, _ in rows), default=0.0) or 1.0  # bytes in units of the largest: well conditioned
    rows = [(h, b / scale, t) for h, b, t in rows]
    saa = sum(h * h for h, _, _ in rows)
    sab = sum(h * b for h, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sat = sum(h * t for h, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    if not rows or det <= 1e-9 * saa * sbb:
        raise CalibrationError("fitting a link needs runs whose collectives' hops and bytes are not in "
                               "one proportion: give runs of different model widths (dp >= 2)")
    lat, inv_bw = (sbb * sat - sab * sbt) / det, (saa * sbt - sab * sat) / det / scale
    if lat < 0:  # the data say "no latency": the best fit through the origin
        lat, inv_bw = 0.0, sbt / sbb / scale
    if inv_bw <= 0:
        raise CalibrationError("the timed collectives do not grow with their bytes: give runs whose "
                               "model widths differ more")
    return lat, 1.0 / inv_bw


def _refuse_overlapped_gathers(cfg, what: str) -> None:
    if cfg.parallel.overlap_param_gather:
        raise CalibrationError("a run with parallel.overlap_param_gather=true waits for its all-gathers inside its "
                               f"next step's forwards, so its timed phases put them in the compute: {what} runs "
                               "with parallel.overlap_param_gather=false")


def fit(records: list[dict], links: tuple[float, float] | None = None) -> ClusterModel:
    """``links``: (latency, bandwidth) from :func:`fit_links`; then the holder groups' collectives
    are priced from bytes, and the fixed cost per step is what they leave."""
    cfg, rec, before, _ = _parts(records)
    if links is not None:
        _refuse_overlapped_gathers(cfg, "price a link on")
    plan = _initial(cfg)
    beta = cfg.emulate.backward_factor
    compute = statistics.median(r["phases_s"]["compute"] for r in before)
    step = statistics.median(r["step_time_s"] for r in before)
    slots = len(plan.micro_batches[0]) + len(plan.pipelines[0]) - 1
    if cfg.emulate.enabled:
        forward = layer_forward_s(cfg)
    else:  # real compute: the cost profile, scaled so the plan's 1F1B takes the measured compute
        costs = _flops(cfg)
        unit = step_time(plan, ClusterModel(layer_forward_s=tuple(costs), backward_factor=beta)).compute_s
        forward = [c * compute / unit for c in costs]
    phases = rec["phases_s"] if rec else {}
    wire = {}
    if links is not None:
        numels = counted_numels(model_for(cfg))
        # No activation bytes: the runtime's sends overlap its compute, so they stay in the
        # measured fixed cost per micro-batch and stage rather than priced over the link.
        wire = dict(layer_param_bytes=tuple(4.0 * n for n in numels), devices_per_node=cfg.world_size,
                    intra_node_latency_s=links[0], intra_node_bytes_per_s=links[1],
                    gradient_bytes_factor=2.0 if cfg.train.deterministic else 1.0,
                    reduce_is_all_reduce=cfg.parallel.backend != "nccl")
    model = ClusterModel(
        layer_forward_s=tuple(forward), backward_factor=beta,
        detect_s=phases.get("detect", 0.0), agree_s=phases.get("agree", 0.0),
        communicator_s=phases.get("communicator", 0.0), plan_s=phases.get("plan", 0.0) + phases.get("state", 0.0),
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, overlap_param_gather=cfg.parallel.overlap_param_gather,
        **wire)
    # What the layers leave of each 1F1B slot is a fixed cost per micro-batch and stage; what
    # compute and collectives leave of the step, a fixed cost per step.
    priced = step_time(plan, model)
    return replace(model, per_microbatch_stage_s=max(0.0, (compute - priced.compute_s) / slots),
                   step_overhead_s=max(0.0, step - compute - priced.collective_s))


def after_plan(records: list[dict]) -> Plan:
    """The plan a run's first recovery made, rebuilt from its recovery record."""
    cfg, rec, _, _ = _parts(records)
    if rec is None:
        raise CalibrationError("the run has no recovery record")
    initial = _initial(cfg)
    doc = rec["plan"]
    if cfg.elastic.policy == "reroute" or doc.get("detours"):
        # The routes do not depend on measured speeds: re-derive them. elaswave's detours are
        # reroute's plan (survivors in place, the same routes), taken when predicted faster.
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


def for_run(model: ClusterModel, fitted: list[dict], records: list[dict]) -> ClusterModel:
    """``model``, fitted on the run ``fitted``, carried to the run ``records`` (another model shape
    or mode of gradient sums; the same model where both runs are alike): each layer's forward time is
    the run's emulated time, or in real compute the fitted seconds per multiply-add (per token)
    times the run's multiply-adds per micro-batch (per token times ``micro_batch_size x seq_len``);
    with a fitted link, the collectives are priced on the run's parameter bytes. The fixed costs
    (per micro-batch and stage, per step) and the recovery stay as fitted."""
    src, dst = _config(fitted), _config(records)
    if dst.emulate.enabled:
        forward = layer_forward_s(dst)
    elif src.emulate.enabled:
        raise CalibrationError("a model fitted on emulated compute knows the sleeps it was given, not this "
                               "run's compute: fit it on a real-compute run")
    else:
        per_madd = sum(model.layer_forward_s) / sum(_flops(src)) / (src.train.micro_batch_size * src.model.seq_len)
        forward = [c * per_madd * dst.train.micro_batch_size * dst.model.seq_len for c in _flops(dst)]
    out = replace(model, layer_forward_s=tuple(forward),
                  backward_factor=dst.emulate.backward_factor if dst.emulate.enabled else model.backward_factor,
                  overlap_grad_reduce=dst.parallel.overlap_grad_reduce,
                  overlap_param_gather=dst.parallel.overlap_param_gather)
    if model.layer_param_bytes:
        out = replace(out, layer_param_bytes=tuple(4.0 * n for n in counted_numels(model_for(dst))),
                      devices_per_node=dst.world_size, gradient_bytes_factor=2.0 if dst.train.deterministic else 1.0,
                      reduce_is_all_reduce=dst.parallel.backend != "nccl")
    return out


def predict(records: list[dict], model: ClusterModel) -> dict:
    """Predicted vs measured for a run: step time before and after its first recovery, the
    throughput ratio after/before, and the MTTR. Errors are relative (predicted / measured - 1)."""
    cfg, rec, before, after = _parts(records)
    out = {}
    pred_before = step_time(_initial(cfg), model)
    meas_before = statistics.median(r["step_time_s"] for r in before)
    out["step_before_s"] = (pred_before.step_s, meas_before)
    terms = _link_terms(cfg, _initial(cfg))
    # The writer's collectives, over the fitted link, in this run's mode (timed only where its
    # all-gathers end within the step).
    if model.layer_param_bytes and terms and not cfg.parallel.overlap_param_gather:
        out["collectives_s"] = (sum(h * model.intra_node_latency_s + b / model.intra_node_bytes_per_s
                                    for _, h, b in terms),
                                statistics.median(r["phases_s"]["reduce"] + r["phases_s"]["gather"] for r in before))
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
