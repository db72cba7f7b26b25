"""Real data at size: ``python bench/training/data.py prepare|rss|all [--work DIR]``.

prepare: ``elaswave prepare`` throughput (MB of text per second) on the standard library's folder
         (~240 MB of text files on this box): the byte tokenizer (in-process, no workers: read
         twice, the first time from a cold page cache), and a byte-level BPE of 8,192 trained on
         it (training timed apart), with 1 and 2 worker processes.
scale:   ``elaswave prepare`` (the command, a process of its own) on generated plain text of ~200 MB
         and ~2 GB (paragraphs between blank lines) and a ~200 MB JSONL, with the byte tokenizer
         (1 process) and a byte-level BPE's tokenizer.json (trained first on a 20 MB sample; 2
         workers): MB of text per second, and the peak RSS of the whole process tree (parent and
         workers, summed, sampled every 0.2 s); goal: <= 500 MB for the 2 GB input.
         ``--scale-mb 200,2000`` sets the text sizes, ``--bpe-up-to-mb N`` leaves BPE off larger ones.
rss:     per-rank peak RSS of the default job (40 steps, dp=2) reading a prepared corpus of ~200 MB
         and one of ~4.3 GB (both made by ``elaswave prepare`` from generated text), and the
         default in-memory corpus as context; goal: the two prepared corpora within 20 MB.
Results: bench/results/data_{prepare,scale,rss}.json. The big corpora are deleted afterwards.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import run_job, write_named  # noqa: E402
from elaswave.data.corpus import stdlib_root  # noqa: E402
from elaswave.data.prepare import prepare  # noqa: E402

RSS_TEXT_MB = {"200 MB": 100, "4.3 GB": 2150}  # bytes tokenize to uint16: shards are twice the text


def _text(path: Path, megabytes: int) -> None:
    """Generated words in lines, ``megabytes`` MB: what is read does not matter for RSS, only its size."""
    rnd = random.Random(0)
    words = _words(rnd)
    _repeated(path, "\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(20_000)).encode() + b"\n",
              megabytes)


def _words(rnd: random.Random) -> list[str]:
    return ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(1, 9))) for _ in range(4000)]


def _repeated(path: Path, block: bytes, megabytes: int) -> None:
    """``block`` written again and again until the file holds ``megabytes`` MB."""
    with open(path, "wb") as fh:
        written = 0
        while written < megabytes * 10 ** 6:
            fh.write(block)
            written += len(block)


def bench_prepare(work: Path) -> dict:
    rows = []
    for tokenizer in ("bytes", "train-bpe:8192"):
        for workers in (1, 2):  # bytes take no workers: the second run is the same work from a warm cache
            out = work / f"prep-{tokenizer.replace(':', '-')}-{workers}"
            began = time.perf_counter()
            m = prepare([stdlib_root()], str(out), tokenizer, workers=workers, progress=False)
            total = time.perf_counter() - began
            rows.append({"tokenizer": tokenizer, "workers": workers, "text_mb": m["text_bytes"] / 1e6,
                         "tokens": m["splits"]["train"]["tokens"], "vocab_size": m["vocab_size"],
                         "tokenize_write_s": m["prepare_s"], "total_s": total,
                         "mb_per_s": m["text_bytes"] / 1e6 / m["prepare_s"]})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out)
    return {"rows": rows}


def _paragraphs(path: Path, megabytes: int, jsonl: bool = False) -> None:
    """Generated paragraphs (1-6 lines) between blank lines, or one JSONL record each."""
    rnd = random.Random(1)
    words = _words(rnd)
    paras = ["\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(rnd.randint(1, 6)))
             for _ in range(5000)]
    block = "".join(json.dumps({"text": p}) + "\n" for p in paras) if jsonl else "\n\n".join(paras) + "\n\n"
    _repeated(path, block.encode(), megabytes)


def _tree_rss_mb(pid: int) -> float:
    """The resident memory of ``pid`` and its descendants, summed (MB)."""
    import os
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def _prepare_measured(args: list[str]) -> dict:
    import subprocess
    proc = subprocess.Popen([sys.executable, "-m", "elaswave.cli", "prepare", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    peak, began = 0.0, time.perf_counter()
    while proc.poll() is None:
        peak = max(peak, _tree_rss_mb(proc.pid))
        time.sleep(0.2)
    took = time.perf_counter() - began
    out = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"prepare {args} failed ({proc.returncode})")
    return {"wall_s": took, "peak_rss_mb": peak, "said": out.strip().splitlines()[-1]}


def bench_scale(work: Path, sizes: list[int], bpe_up_to_mb: int) -> dict:
    sample = work / "sample.txt"
    _paragraphs(sample, 20)
    spec_dir = work / "bpe"
    prepare([str(sample)], str(spec_dir), "train-bpe:8192", progress=False)
    rows = []
    inputs = [(f"text {mb} MB", mb, False) for mb in sizes] + [(f"jsonl {sizes[0]} MB", sizes[0], True)]
    for label, mb, jsonl in inputs:
        src = work / ("in.jsonl" if jsonl else "in.txt")
        _paragraphs(src, mb, jsonl)
        for tokenizer, workers in (("bytes", 1), (str(spec_dir / "tokenizer.json"), 2))[:2 if mb <= bpe_up_to_mb else 1]:
            out = work / "out"
            got = _prepare_measured([str(src), "--out", str(out), "--tokenizer", tokenizer, "--workers", str(workers)])
            m = json.loads((out / "manifest.json").read_text())
            rows.append({"input": label, "input_bytes": src.stat().st_size, "tokenizer": "bytes" if tokenizer == "bytes"
                         else "bpe-8192", "workers": workers, "documents": m["splits"]["train"]["documents"],
                         "tokens": m["splits"]["train"]["tokens"], "mb_per_s": m["text_bytes"] / 1e6 / m["prepare_s"],
                         "peak_rss_mb": got["peak_rss_mb"], "wall_s": got["wall_s"]})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out)
        src.unlink()
    biggest = max(r["peak_rss_mb"] for r in rows if r["input"] == f"text {max(sizes)} MB")
    return {"rows": rows, "peak_rss_mb_largest_text": biggest, "goal_mb": 500}


def bench_rss(work: Path) -> dict:
    rows = []
    sets = ["parallel.dp=2", "parallel.pp=1", "train.steps=40"]
    for label, mb in [("in-memory default (stdlib, 4 MB as int64)", None), *RSS_TEXT_MB.items()]:
        extra = []
        if mb is not None:
            text, out = work / "text.txt", work / "prepared"
            _text(text, mb)
            m = prepare([str(text)], str(out), "bytes", progress=False)
            text.unlink()
            shard_bytes = sum(p.stat().st_size for p in out.glob("*.bin"))
            extra = [f"data.path={out}"]
        summary = run_job(sets + extra)[-1]
        row = {"corpus": label, "peak_rss_mb_per_rank": [b / 2 ** 20 for b in summary["peak_rss_bytes_per_rank"]]}
        if mb is not None:
            row.update(shard_bytes=shard_bytes, tokens=m["splits"]["train"]["tokens"])
            shutil.rmtree(out)
        rows.append(row)
        print(json.dumps(row), flush=True)
    small, big = (max(r["peak_rss_mb_per_rank"]) for r in rows[1:])
    return {"rows": rows, "big_minus_small_mb": big - small, "goal_mb": 20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "scale", "rss", "all"])
    ap.add_argument("--work", help="a folder with ~7 GB free (default: a temporary one)")
    ap.add_argument("--scale-mb", default="200,2000", help="scale: the plain-text sizes, MB")
    ap.add_argument("--bpe-up-to-mb", type=int, default=10 ** 6, help="scale: the BPE runs only on inputs this small")
    args = ap.parse_args()
    sizes = [int(x) for x in args.scale_mb.split(",")]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        write_named(args.what, {"prepare": lambda: bench_prepare(Path(tmp)), "scale": lambda: bench_scale(Path(tmp), sizes, args.bpe_up_to_mb),
                                "rss": lambda: bench_rss(Path(tmp))}, "data", end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
