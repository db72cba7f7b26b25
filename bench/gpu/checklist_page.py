"""The GPU checklist's report: tables from ``bench/results/gpu.json`` and BENCHMARKS.md's GPU
section (``python bench/gpu/checklist.py --page``). Kept apart from bench/gpu/checklist.py, which measures."""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import BENCHMARKS, page_blocks, put_section, write_page

HEADING = "## GPU checklist"


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + [
        "| " + " | ".join(map(_f, r)) + " |" for r in rows]


def markdown(doc: dict) -> list[str]:
    env, items = doc["env"], doc["items"]
    out = [f"`python bench/gpu/checklist.py{' --quick' if doc['quick'] else ''}` on {env['date']}: {env['device']} "
           f"({env['sm_count']} SMs, {env['memory_gib']} GiB), driver {env['driver']}, torch {env['torch']}, "
           f"CUDA {env['cuda']}, NCCL {env['nccl']}, "
           f"Python {env['python']}, {env['cpus']} CPUs; {doc.get('wall_s', 0):.0f} s.", ""]
    titles = {"nccl": "1. NCCL", "matmul": "2. Matrix products", "attention": "3. Fused against written-out attention",
              "determinism": "4. Deterministic mode on CUDA", "step_time": "5. Step time against a plain PyTorch loop",
              "mfu": "6. Model FLOPs utilisation", "nvml": "7. NVML"}
    for key, title in titles.items():
        out += [f"### {title}", ""]
        item = items.get(key, {"error": "not run"})
        if "result" not in item:
            out += [f"Failed: `{item['error']}`", ""]
            continue
        r = item["result"]
        if key == "nccl":
            out += _table(["world size 1, store", "construct (s)", "first all-reduce (s)", "all-reduce ok", "all-gather ok",
                           "reduce-scatter ok"], [[k, v["construct_s"], v["first_all_reduce_s"], v["all_reduce_correct"],
                                                  v["all_gather_correct"], v["reduce_scatter_correct"]]
                                                 for k, v in r["stores"].items()])
            two = r["two_ranks_one_gpu_elaswave"]
            out += ["", f"GPUs visible: {r['gpus_visible']}. Two NCCL ranks on this one GPU: "
                        + "; ".join(f"rank {i} exit {x['exit_code']}: `{x['output']}`"
                                    for i, x in enumerate(r["two_ranks_one_gpu_nccl"]))
                    + f". `elaswave run` with dp=2: exit {two['exit_code']}, {two['steps']} steps: `{two['error']}`."]
        elif key == "matmul":
            out += _table(["n", "precision", "ms", "TFLOP/s", "rel. error vs fp64"],
                          [[x["n"], x["precision"], x["ms"], x["tflops"], x["rel_err_vs_fp64"]] for x in r["rows"]])
        elif key == "attention":
            out += [f"{r['shape']}; forward+backward; differences from written-out attention in fp32.", ""]
            out += _table(["seq", "dtype", "kernel", "fwd+bwd (ms)", "peak extra (GiB)", "max abs diff out",
                           "max abs diff dq", "error"],
                          [[x["seq"], x["dtype"], x["impl"], x.get("fwd_bwd_ms"), x.get("peak_extra_gib"),
                            x.get("max_abs_diff_out"), x.get("max_abs_diff_dq"), x.get("error", "")] for x in r["rows"]])
            out += ["", f"Same bits over 4 runs (bf16, seq 2048): `{json.dumps(r['same_bits_4_runs_bf16_seq2048'])}`.",
                    "", "The same with `torch.use_deterministic_algorithms(True)`: "
                        f"`{json.dumps(r['under_deterministic_algorithms'])}`."]
        elif key == "determinism":
            out += _table(["run", "exit", "steps", "params_sha256", "wall (s)", "error"],
                          [[k, v["exit_code"], v["steps"], (v["params_sha256"] or "-")[:16], v["wall_s"], v["error"] or ""]
                           for k, v in r["runs"].items()])
            out += ["", f"`{' '.join(r['job'])}`: GPU run 1 == GPU run 2 (every loss, params_sha256): "
                        f"**{r['gpu_runs_identical']}**; GPU == CPU reference: **{r['gpu_equals_cpu']}**, "
                        f"max loss difference {_f(r['max_loss_diff_gpu_vs_cpu'])} "
                        f"(first losses {r['first_loss_gpu_cpu']})"
                    + (f"; with model.dropout=0: GPU == CPU **{r['dropout0_gpu_equals_cpu']}**, max loss difference "
                       f"{_f(r['dropout0_max_loss_diff'])}." if "dropout0_max_loss_diff" in r else ".")]
        elif key == "step_time":
            out += [f"`{' '.join(r['job'])}`; median step after {r['warmup_steps_dropped']} warm-up steps.", ""]
            out += _table(["trainer", "median step (s)", "over plain fp32", "GPU busy", "elaswave phases (s)", "final loss"],
                          [[k, v.get("step_time_s"), v.get("over_plain_fp32"), v.get("gpu_busy_fraction"),
                            ", ".join(f"{p} {_f(s, 2)}" for p, s in v.get("phases_s", {}).items()) or v.get("error") or "",
                            v.get("final_loss")] for k, v in r["rows"].items()])
        elif key == "mfu":
            out += [f"FLOPs per step = {r['formula']} = {_f(r['model_tflop_per_step'])} TFLOP "
                    f"(N = {r['non_embedding_params']}, "
                    f"T = {r['tokens_per_step']}); datasheet peaks {json.dumps(r['peaks_tflops'])} TFLOP/s.", ""]
            out += _table(["trainer", "TFLOP/s", "of fp32 peak", "of TF32 peak", "of bf16 peak"],
                          [[k, v["tflops"], v["of_fp32_peak"], v["of_tf32_peak"], v["of_bf16_peak"]]
                           for k, v in r["rows"].items()])
        elif key == "nvml":
            out += _table(["reading", "value"], [[k, f"`{json.dumps(v)}`"] for k, v in r.items()])
        if key == "step_time":
            out += [""] + [f"- {k}: {p} takes {v['phases_s'][p]:.3g} s of its {v['step_time_s']:.3g} s step."
                           for k, v in r["rows"].items() if v.get("phases_s")
                           for p in [max(v["phases_s"], key=v["phases_s"].get)]]
        out += ["", NOTES[key], ""] if key in NOTES else [""]
    return out


NOTES = {  # what a reader needs to read the figures; true of the code, whatever the figures
    "nccl": "NCCL builds its communicator at the first collective, not in the constructor; the TCPStore group, made "
            "first, also pays for loading NCCL in the process. Two ranks need two GPUs: "
            "NCCL refuses two ranks on one device, and elaswave's launcher gives rank r the GPU LOCAL_RANK=r "
            "(comm/backend.py choose), which does not exist here, so multi-rank NCCL was not measured.",
    "attention": "'Same bits' over 4 runs shows no difference was seen, not that the kernel is deterministic. "
                 "The written-out rows in fp32 are the yardstick run again (hence 0).",
    "determinism": "At dp=1 pp=1 elaswave makes no process group (a group of one member is None in "
                   "comm/groups.py), so this exercises CUDA compute, the fixed-point sums and AdamW, not NCCL. "
                   "With dropout the GPU draws its masks from CUDA's generator and the CPU from its own, so the "
                   "runs see different masks; with model.dropout=0 the difference is arithmetic alone.",
    "step_time": "GPU busy: kernel and copy time over wall time of 3 profiled steps of the plain loop; far under 1 "
                 "means the host's launching, not the GPU, sets the step at this size. The norm phase computes one "
                 "squared norm per ZeRO chunk (zero/optimizer.py chunk_sumsq), each read back to the host: "
                 "elaswave_fast_chunk_1m has 256x fewer chunks.",
    "mfu": "elaswave trains in fp32 with TF32 off (bf16 with fp32 masters is open issue 16), so its peak is the "
           "fp32 one; plain_bf16_sdpa is measured against bf16's.",
    "nvml": "No clock was set: the machine is lent and must be left as found. elaswave's NvmlActuator was "
            "constructed (it only reads clocks); apply() would call nvmlDeviceSetApplicationsClocks, which was "
            "not called, and would_set_mhz is what it would ask for.",
}


def write_section(results: Path) -> Path:
    """Replace (or add at the end) BENCHMARKS.md's GPU checklist section, up to the next section."""
    doc = json.loads(results.read_text())
    section = [f"{HEADING} ({doc['env']['device']}, {doc['env']['date']})", "", "Written by `python bench/gpu/checklist.py "
               "--page` from `bench/results/gpu.json`; what is measured and how: the docstring of "
               "`bench/gpu/checklist.py`.", ""] + markdown(doc)
    while section and not section[-1].strip():
        section.pop()
    blocks = page_blocks(BENCHMARKS.read_text() if BENCHMARKS.exists() else "")
    put_section(blocks, [*section, ""], lambda line: line.startswith(HEADING))
    return write_page(blocks, BENCHMARKS)
