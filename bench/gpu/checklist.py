"""The GPU checklist: what elaswave's parts, and elaswave itself, do on one CUDA GPU.

    python bench/gpu/checklist.py [--out DIR] [--quick]   # measure: DIR/gpu.json (raw) and DIR/gpu.md (tables)
    python bench/gpu/checklist.py --page                  # BENCHMARKS.md's GPU section from bench/results/gpu.json

Seven independent items (one that fails records its error; the rest still run):
1 nccl: a world-size-1 ProcessGroupNCCL from elaswave's comm/backend.py over a TCPStore and a HashStore;
  all-reduce, all-gather, reduce-scatter checked; time to construct it and to its first collective
  (where NCCL builds its communicator). Two ranks on the one GPU, through NCCL and through `elaswave run`.
2 matmul: n^3 products in bf16, fp32 (TF32 off: torch's default, what elaswave trains in) and TF32;
  TFLOP/s and the relative error against float64.
3 attention: scaled_dot_product_attention with the flash and the memory-efficient kernel forced,
  against the written-out causal attention of elaswave's Block; forward+backward time, peak memory,
  difference from written-out fp32; same bits over repeats; behaviour under deterministic algorithms.
4 determinism: `elaswave run --deterministic` (dp=1 pp=1) twice on the GPU and `elaswave reference
  --deterministic` on this machine's CPU; every loss and params_sha256 compared.
5 step time: one GPT trained by elaswave (dp=1 pp=1, fast mode, elastic on and off) and by a plain
  loop (nn.ModuleList of the same layers, AdamW, same micro-batches and clipping), and the plain loop
  in bf16 autocast with fused attention and fused AdamW (what a real run would do).
6 mfu: model FLOPs per step / step time / the datasheet peak of each precision.
7 nvml: name, power, clocks, application clocks, whether setting them is restricted; elaswave's NVML
  actuator. Read-only: lent machines must be left as found, so no clock is set, and whether a set
  would be allowed is read from NVML's API restriction instead.

bf16 training (bf16 layers with fp32 master shards against a plain autocast loop, deterministic mode's
cost, snapshots staged to pinned host memory) is bench/gpu/precision.py; the Llama family against
transformers' model is bench/gpu/llama.py. The items that train are bench/gpu/checklist_training.py;
the tables and the page, bench/gpu/checklist_page.py.

Timing: kernels with CUDA events, the median of repeats after warm-up; training steps on the host
clock (each step ends in a synchronisation), the median after WARMUP_STEPS. Without CUDA it says so,
writes nothing and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, ROOT, error_tail, short_error, try_job  # noqa: E402
from bench.gpu.checklist_page import markdown, write_section  # noqa: E402  the report, kept apart
from bench.gpu.checklist_training import item_determinism, item_mfu, item_step_time  # noqa: E402


def _median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def environment() -> dict:
    p, nccl = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()
    env = {"device": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
           "memory_gib": round(p.total_memory / 2 ** 30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), "python": platform.python_version(),
           "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}
    try:
        import pynvml
        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        env["driver"] = f"unknown ({short_error(exc)})"
    return env


# -- 1. NCCL -----------------------------------------------------------------------------------------
TWO_RANKS = """import sys, torch, torch.distributed as dist
from elaswave.comm import backend
rank, device = int(sys.argv[1]), torch.device("cuda", 0)
torch.cuda.set_device(device)
pg = backend.make_process_group(dist.FileStore(sys.argv[2], 2), "two", rank, 2, "nccl", 30.0, device)
x = torch.ones(4, device=device)
backend.wait(backend.all_reduce(pg, x), 30.0, "all-reduce")
print("all-reduce gave", x.tolist(), flush=True)
"""


def item_nccl(quick: bool) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from elaswave.comm import backend

    name, device = backend.choose("auto")
    out = {"backend_auto_chooses": name, "gpus_visible": torch.cuda.device_count(), "stores": {}}
    for kind in ("TCPStore", "HashStore"):
        store = (dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60)) if kind == "TCPStore" else dist.HashStore())
        began = time.perf_counter()
        pg = backend.make_process_group(store, "gpu-bench", 0, 1, "nccl", 60.0, device)
        construct_s = time.perf_counter() - began
        x = torch.arange(1 << 20, dtype=torch.float32, device=device) * 1.5
        expect = x.clone()
        began = time.perf_counter()
        backend.wait(backend.all_reduce(pg, x), 60.0, "all-reduce")
        torch.cuda.synchronize()
        first_s = time.perf_counter() - began
        gathered, scattered = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))  # poisoned
        backend.wait(backend.all_gather(pg, gathered, expect), 60.0, "all-gather")
        backend.wait(backend.reduce_scatter(pg, scattered, expect), 60.0, "reduce-scatter")
        torch.cuda.synchronize()
        out["stores"][kind] = {"construct_s": construct_s, "first_all_reduce_s": first_s,
                               "all_reduce_correct": torch.equal(x, expect),
                               "all_gather_correct": torch.equal(gathered, expect),
                               "reduce_scatter_correct": torch.equal(scattered, expect)}
        if hasattr(pg, "shutdown"):
            pg.shutdown()
    # Two ranks on the one GPU: straight through NCCL, then through elaswave's launcher.
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_DEBUG="WARN")
        procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), os.path.join(tmp, "store")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        res = []
        for p in procs:
            try:
                res.append({"exit_code": p.wait(timeout=60), "output": error_tail(p.stdout.read())})
            except subprocess.TimeoutExpired:
                p.kill()
                res.append({"exit_code": "hung for 60 s; killed", "output": ""})
        out["two_ranks_one_gpu_nccl"] = res
    run = try_job("run", ["parallel.dp=2", "parallel.pp=1", "train.steps=2", "train.num_micro_batches=2",
                            "elastic.enabled=false", "parallel.timeout_s=30"], False, timeout_s=90)
    out["two_ranks_one_gpu_elaswave"] = {"exit_code": run["exit_code"], "steps": len(run["losses"]), "error": run["error"]}
    return out


# -- 2. matmul ---------------------------------------------------------------------------------------
def item_matmul(quick: bool) -> dict:
    rows = []
    try:
        for n in [4096] if quick else [4096, 8192]:
            for label, dtype, precision in (("bf16", torch.bfloat16, "highest"), ("fp32", torch.float32, "highest"),
                                            ("tf32", torch.float32, "high")):
                torch.set_float32_matmul_precision(precision)
                # Random data (zeros run faster) in two input sets, alternated.
                sets = [[torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2)] for _ in range(2)]
                turn = iter(range(10 ** 9))
                ms = _median_ms(lambda: torch.mm(*sets[next(turn) % 2]), warmup=3, reps=6 if quick else 12)
                a, b = sets[0]
                ref = a.double() @ b.double()
                rel = float(torch.linalg.norm(torch.mm(a, b).double() - ref) / torch.linalg.norm(ref))
                rows.append({"n": n, "precision": label, "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9, "rel_err_vs_fp64": rel})
                sets = a = b = ref = None
    finally:
        torch.set_float32_matmul_precision("highest")
    return {"rows": rows}


# -- 3. attention ------------------------------------------------------------------------------------
def written_attention(q, k, v, mask):
    """elaswave's Block: softmax(QK^T / sqrt(d)) masked causal, times V (its dropout left out here)."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def _sdpa(kernel):
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v, mask):
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend


def item_attention(quick: bool) -> dict:
    from torch.nn.attention import SDPBackend

    warnings.filterwarnings("ignore", category=UserWarning)  # sdpa_kernel explains every refusal at length
    impls = {"written": written_attention, "flash": _sdpa(SDPBackend.FLASH_ATTENTION),
             "mem_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    batch, heads, head_dim = 4, 32, 128
    rows, repeatable = [], {}
    for seq in [2048] if quick else [2048, 4096]:
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)
        base = [torch.randn(batch, heads, seq, head_dim, device="cuda") for _ in range(4)]  # q, k, v, grad out
        q, k, v = (t.clone().requires_grad_() for t in base[:3])
        ref = written_attention(q, k, v, mask)  # the yardstick: elaswave's arithmetic in fp32
        ref.backward(base[3])
        ref, ref_dq = ref.detach(), q.grad
        del q, k, v
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (t.to(dtype).requires_grad_() for t in base[:3])
            g = base[3].to(dtype)
            for name, attend in impls.items():
                row = {"seq": seq, "dtype": str(dtype).removeprefix("torch."), "impl": name}
                rows.append(row)
                step = _fwd_bwd(attend, q, k, v, mask, g)
                try:
                    q.grad = k.grad = v.grad = None
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    out = step()
                    torch.cuda.synchronize()
                    row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - held) / 2 ** 30
                    row["max_abs_diff_out"] = float((out.float() - ref).abs().max())
                    row["max_abs_diff_dq"] = float((q.grad.float() - ref_dq).abs().max())
                    del out
                    row["fwd_bwd_ms"] = _median_ms(step, warmup=2, reps=3 if quick else 8)
                    if seq == 2048 and dtype == torch.bfloat16:
                        repeatable[name] = _repeatable(step, q, k, v)
                except Exception as exc:  # noqa: BLE001 - flash has no fp32 kernel; an OOM is a finding too
                    row["error"] = short_error(exc)
                torch.cuda.empty_cache()
            del q, k, v, g
        del base, ref, ref_dq, mask
        torch.cuda.empty_cache()
    return {"shape": f"batch {batch}, heads {heads}, head_dim {head_dim}, causal", "rows": rows,
            "same_bits_4_runs_bf16_seq2048": repeatable, "under_deterministic_algorithms": _under_deterministic(impls)}


def _fwd_bwd(attend, q, k, v, mask, g):
    """One forward+backward of ``attend`` on these inputs (their gradients cleared first): returns the output."""
    def step():
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v, mask)
        out.backward(g)
        return out
    return step


def _repeatable(step, q, k, v, runs: int = 4) -> dict:
    """Whether ``runs`` forward+backward passes on the same inputs give the same bits."""
    first, same = None, {}
    for _ in range(runs):
        got = {"out": step().detach(), "dq": q.grad.clone(), "dk": k.grad.clone(), "dv": v.grad.clone()}
        first = first or got
        same = {key: same.get(key, True) and torch.equal(got[key], first[key]) for key in got}
    return same


def _under_deterministic(impls) -> dict:
    """Each kernel under torch.use_deterministic_algorithms(True) (bf16, batch 4, heads 32, seq 2048):
    whether it runs, and whether 4 runs then give the same bits."""
    res = {}
    q, k, v = (torch.randn(4, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="cuda"), diagonal=1)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses deterministic mode without it
    torch.use_deterministic_algorithms(True)
    try:
        for name, attend in impls.items():
            try:
                res[name] = _repeatable(_fwd_bwd(attend, q, k, v, mask, g), q, k, v)
            except Exception as exc:  # noqa: BLE001
                res[name] = short_error(exc)
    finally:
        torch.use_deterministic_algorithms(False)
    return res


# -- 7. NVML -----------------------------------------------------------------------------------------
def item_nvml(quick: bool) -> dict:
    import pynvml as nv

    from elaswave.runtime.actuator import NvmlActuator

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)

    def read(fn, *args, scale=1):
        try:
            value = fn(h, *args)
            return value / scale if scale != 1 else value
        except nv.NVMLError as exc:
            return f"NVMLError: {exc}"
    mem_clocks = read(nv.nvmlDeviceGetSupportedMemoryClocks)
    graphics = read(nv.nvmlDeviceGetSupportedGraphicsClocks, mem_clocks[0]) if isinstance(mem_clocks, list) else []
    graphics = graphics if isinstance(graphics, list) else []
    restricted = read(nv.nvmlDeviceGetAPIRestriction, nv.NVML_RESTRICTED_API_SET_APPLICATION_CLOCKS)
    out = {"name": read(nv.nvmlDeviceGetName), "power_draw_w": read(nv.nvmlDeviceGetPowerUsage, scale=1e3),
           "power_limit_w": read(nv.nvmlDeviceGetPowerManagementLimit, scale=1e3),
           "sm_clock_mhz": read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
           "sm_clock_max_mhz": read(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
           "app_clock_sm_mhz": read(nv.nvmlDeviceGetApplicationsClock, nv.NVML_CLOCK_SM),
           "default_app_clock_sm_mhz": read(nv.nvmlDeviceGetDefaultApplicationsClock, nv.NVML_CLOCK_SM),
           "supported_memory_clocks_mhz": mem_clocks, "supported_graphics_clocks": len(graphics),
           "graphics_clock_range_mhz": [min(graphics), max(graphics)] if graphics else None,
           "set_app_clocks_root_only": restricted == nv.NVML_FEATURE_ENABLED if isinstance(restricted, int) else restricted,
           "running_as_root": os.geteuid() == 0, "clock_set_attempted": False}
    # elaswave's actuator: its constructor only reads; apply() and close() set and reset application
    # clocks, which are not ours to change here, so the clocks it would pick are computed instead.
    try:
        act = NvmlActuator(torch.device("cuda", 0))
        pick = {str(lv): max((c for c in act.clocks if c <= act.nominal * lv), default=act.clocks[0])
                for lv in (0.7, 0.85, 1.0, 1.15)}
        out["actuator"] = {"constructs": True, "nominal_mhz": act.nominal, "mem_clock_mhz": act.mem_clock,
                           "levels": len(act.clocks), "would_set_mhz": pick}
    except Exception as exc:  # noqa: BLE001
        out["actuator"] = {"constructs": False, "error": short_error(exc)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--quick", action="store_true", help="fewer sizes, repeats and runs")
    ap.add_argument("--page", action="store_true", help="only rewrite BENCHMARKS.md's GPU section from OUT/gpu.json")
    ap.add_argument("--only", default="", help="comma-separated items to run (results in OUT/gpu-only.json)")
    args = ap.parse_args(argv)
    if args.page:  # the tables again from the raw results (e.g. after the notes changed), and the page
        results = Path(args.out) / "gpu.json"
        (results.parent / "gpu.md").write_text("\n".join(markdown(json.loads(results.read_text()))))
        print(f"wrote {results.parent / 'gpu.md'} and {write_section(results)}")
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu/checklist.py: no CUDA device here; nothing measured (run it on a machine with a GPU)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    doc = {"quick": args.quick, "env": environment(), "items": {}}
    items = {"nccl": item_nccl, "matmul": item_matmul, "attention": item_attention, "determinism": item_determinism,
             "step_time": item_step_time, "mfu": lambda q: item_mfu(doc["items"]["step_time"].get("result"), doc["env"]),
             "nvml": item_nvml}
    only = [x for x in args.only.split(",") if x]
    if only:
        items = {k: v for k, v in items.items() if k in only}
    results = out / ("gpu-only.json" if only else "gpu.json")
    for name, fn in items.items():
        print(f"[gpu] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            doc["items"][name] = {"result": fn(args.quick)}
        except Exception as exc:  # noqa: BLE001 - one item's failure is a finding; the rest still run
            doc["items"][name] = {"error": short_error(exc), "traceback": traceback.format_exc()[-3000:]}
        doc["items"][name]["s"] = time.perf_counter() - t0
        print(f"[gpu] {name}: {doc['items'][name].get('error', 'ok')} ({doc['items'][name]['s']:.1f} s)", flush=True)
        torch.cuda.empty_cache()
        doc["wall_s"] = time.perf_counter() - began
        results.write_text(json.dumps(doc, indent=1))  # after every item: a cut-off run keeps what it had
    if only:
        return 0
    (out / "gpu.md").write_text("\n".join(markdown(doc)))
    print("\n".join(markdown(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
