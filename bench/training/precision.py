"""Precision on this CPU, measured: ``python bench/training/precision.py curve|windows|step|islands|floor|all [--runs N]``.

curve: the default job (the tiny Llama at dp=2 x pp=2, fast mode) for 200 steps in fp32 and in
       bf16, as real runs; the relative loss difference at every step after warm-up (goal: within
       2 %), and ``elaswave report`` of the bf16 run against the fp32 one (both curves in one plot).
windows: the goal restated (issue 38): bf16's loss averaged over each 10-step window after warm-up
       within 1 % of fp32's, and the final held-out loss within 1 %, over ``--runs`` seeds of the
       default job (dp=2 x pp=2, fast mode, 200 steps) on the same stdlib text it reads, prepared
       with a held-out split (``elaswave prepare --tokenizer bytes --eval-fraction 0.05``) so the
       last step is evaluated.
step:  one process (the reference trainer: the runtime's stage, accumulator and optimizer, one
       thread), a wider Llama without dropout: fp32 and bf16, each with fused attention (SDPA) and
       written out. Configurations alternate within each round; a configuration's time is the
       median step after warm-up, and each ratio is over the fp32 written-out step of the same
       round (median over rounds).
islands: whether float32 islands beyond the standard ones (RMSNorm, softmax and the loss already run
       in float32) bring bf16 closer to fp32: the single-process reference (fast mode, the default
       job's model and batch) for 200 steps in fp32, in bf16, in bf16 with a float32 residual stream
       (Megatron's --fp32-residual-connection) and in bf16 with float32 logits, for ``--runs``
       seeds; each bf16 variant's relative loss difference from fp32 after warm-up.
floor: how far bf16 is from fp32 against how far fp32 is from itself with another kernel's rounding:
       the same reference and model without dropout (so fast mode may fuse attention), for
       ``--runs`` seeds: fp32 with SDPA, fp32 with the attention written out (the same arithmetic
       rounded differently: the floor) and bf16 with SDPA; each one's difference from the first.
Results: bench/results/precision_{curve,windows,step,islands,floor}.json, the report in bench/results/precision_curve.report/.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, bench_args, run_job, write_named  # noqa: E402
from elaswave.model.llama import Block, Head  # noqa: E402

CURVE_STEPS, CURVE_WARMUP = 200, 20
STEP_SHAPE = ["model.arch=llama", "model.vocab_size=256", "model.d_model=256", "model.num_heads=8",
              "model.num_kv_heads=4", "model.num_blocks=4", "model.ffn_dim=704", "model.seq_len=128",
              "model.tie_embeddings=true", "model.dropout=0", "train.micro_batch_size=4", "train.num_micro_batches=4",
              "train.steps=12", "data.max_corpus_bytes=400000"]
STEP_WARMUP = 3
TINY_LLAMA = ["model.arch=llama", "model.num_kv_heads=2", "model.ffn_dim=128", "model.tie_embeddings=true"]
"""The default job's model (the llama-tiny preset) spelled out: a factory takes no preset."""


def written_out(cfg):
    """The Llama family with its attention written out (``model.factory``): what deterministic mode runs."""
    from elaswave.model.registry import family
    return family(cfg.model, fused_attention=False)


def curve() -> dict:
    runs = {}
    RESULTS.mkdir(exist_ok=True)
    for precision in ("fp32", "bf16"):
        metrics = RESULTS / f"precision_curve_{precision}.jsonl"
        metrics.unlink(missing_ok=True)
        records = run_job([f"train.precision={precision}", f"train.steps={CURVE_STEPS}"], metrics=metrics)
        runs[precision] = [r["loss"] for r in records if r["event"] == "step"]
    rel = [abs(b - f) / f for f, b in zip(runs["fp32"], runs["bf16"])]
    after = rel[CURVE_WARMUP:]
    subprocess.run([sys.executable, "-m", "elaswave.cli", "report", str(RESULTS / "precision_curve_bf16.jsonl"),
                    "--against", str(RESULTS / "precision_curve_fp32.jsonl"),
                    "--out", str(RESULTS / "precision_curve.report")], check=True, capture_output=True)
    out = {"steps": CURVE_STEPS, "warmup": CURVE_WARMUP, "losses": runs,
           "max_rel_diff_after_warmup": max(after), "median_rel_diff_after_warmup": statistics.median(after),
           "worst_step": CURVE_WARMUP + after.index(max(after)), "within_2_percent": max(after) <= 0.02}
    print(f"curve: bf16 vs fp32 loss, steps {CURVE_WARMUP}..{CURVE_STEPS - 1}: max {100 * max(after):.2f} %, "
          f"median {100 * statistics.median(after):.2f} %; final fp32 {runs['fp32'][-1]:.4f} bf16 {runs['bf16'][-1]:.4f}")
    return out


WINDOW, GOAL = 10, 0.01


def _held_out_corpus(folder: Path) -> Path:
    """The default job's stdlib text, prepared as byte tokens with 5 % of its documents held out."""
    from elaswave.data import corpus
    from elaswave.data.config import DataConfig
    cfg = DataConfig()
    root, suffix = corpus._text_source(cfg)
    text = folder / "stdlib.txt"
    text.write_bytes(corpus._read_bytes(corpus._text_files(root), cfg.max_corpus_bytes, suffix))
    out = folder / "tokens"
    subprocess.run([sys.executable, "-m", "elaswave.cli", "prepare", "--out", str(out), "--tokenizer", "bytes",
                    "--eval-fraction", "0.05", str(text)], check=True, capture_output=True)
    return out


def windows(seeds: int) -> dict:
    out: dict = {"steps": CURVE_STEPS, "warmup": CURVE_WARMUP, "window": WINDOW, "goal": GOAL, "seeds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = _held_out_corpus(Path(tmp))
        for seed in range(seeds):
            runs = {}
            for precision in ("fp32", "bf16"):
                records = run_job([f"train.precision={precision}", f"train.steps={CURVE_STEPS}", f"train.seed={seed}",
                                   f"data.path={data}", f"train.eval_every={CURVE_STEPS}"])
                runs[precision] = {"losses": [r["loss"] for r in records if r["event"] == "step"],
                                   "eval_loss": [r["eval_loss"] for r in records if r["event"] == "eval"][-1]}
            means = {p: [statistics.fmean(r["losses"][w:w + WINDOW]) for w in range(CURVE_WARMUP, CURVE_STEPS, WINDOW)]
                     for p, r in runs.items()}
            rel = [abs(b - f) / f for f, b in zip(means["fp32"], means["bf16"])]
            held = abs(runs["bf16"]["eval_loss"] - runs["fp32"]["eval_loss"]) / runs["fp32"]["eval_loss"]
            out["seeds"][seed] = {"window_means": means, "window_rel_diff": rel, "max_window_rel_diff": max(rel),
                                  "worst_window_start": CURVE_WARMUP + WINDOW * rel.index(max(rel)),
                                  "eval_loss": {p: r["eval_loss"] for p, r in runs.items()}, "eval_rel_diff": held,
                                  "within_goal": max(rel) <= GOAL and held <= GOAL}
            print(f"windows seed {seed}: {WINDOW}-step windows max {100 * max(rel):.2f} % (from step "
                  f"{out['seeds'][seed]['worst_window_start']}), held-out loss fp32 {runs['fp32']['eval_loss']:.4f} "
                  f"bf16 {runs['bf16']['eval_loss']:.4f} ({100 * held:.2f} %)", flush=True)
    out["all_within_goal"] = all(s["within_goal"] for s in out["seeds"].values())
    return out


class _Fp32ResidualBlock(Block):
    def forward(self, x, gen):
        dt = self.mlp.up_proj.weight.dtype
        x = x.float()
        x = x + self.self_attn(self.input_layernorm(x).to(dt), gen).float()
        return x + self.mlp(self.post_attention_layernorm(x).to(dt)).float()


class _Fp32ResidualHead(Head):
    def forward(self, x, gen):
        return self.lm_head(self.norm(x.float()).to(self.lm_head.weight.dtype))


class _Fp32LogitsHead(Head):
    def forward(self, x, gen):
        return F.linear(self.norm(x.float()), self.lm_head.weight.float())


def _with_layers(cfg, block: type | None, head: type):
    """The job's Llama with its blocks and head computing as ``block`` and ``head`` do: the same
    parameters, built and initialised as the family builds them."""
    from elaswave.model.registry import family
    model = family(cfg.model, fused_attention=not cfg.train.deterministic)
    build = model.build_layer

    def build_layer(index: int, seed: int, init: bool = True):
        layer = build(index, seed, init)
        for base, cls in ((Block, block), (Head, head)):
            if cls is not None and type(layer) is base:
                layer.__class__ = cls
        return layer
    model.build_layer = build_layer
    return model


def fp32_residual(cfg):
    return _with_layers(cfg, _Fp32ResidualBlock, _Fp32ResidualHead)


def fp32_logits(cfg):
    return _with_layers(cfg, None, _Fp32LogitsHead)


def _rel_after_warmup(fp32: list[float], other: list[float]) -> dict:
    after = [abs(b - f) / f for f, b in zip(fp32, other)][CURVE_WARMUP:]
    return {"max": max(after), "median": statistics.median(after), "worst_step": CURVE_WARMUP + after.index(max(after)),
            "steps_over_2_percent": sum(r > 0.02 for r in after)}


def islands(seeds: int) -> dict:
    tiny = TINY_LLAMA
    variants = {"fp32": tiny + ["train.precision=fp32"], "bf16": tiny + ["train.precision=bf16"],
                "bf16_fp32_residual": tiny + ["train.precision=bf16", "model.factory=bench.training.precision:fp32_residual"],
                "bf16_fp32_logits": tiny + ["train.precision=bf16", "model.factory=bench.training.precision:fp32_logits"]}
    return {"steps": CURVE_STEPS, "warmup": CURVE_WARMUP, "trainer": "the single-process reference, fast mode",
            "seeds": _against_first(variants, seeds, "islands")}


def floor(seeds: int) -> dict:
    tiny = TINY_LLAMA + ["model.dropout=0"]
    variants = {"fp32": tiny + ["train.precision=fp32"],
                "fp32_written": tiny + ["train.precision=fp32", "model.factory=bench.training.precision:written_out"],
                "bf16": tiny + ["train.precision=bf16"]}
    return {"steps": CURVE_STEPS, "warmup": CURVE_WARMUP, "trainer": "the single-process reference, fast mode, no dropout",
            "seeds": _against_first(variants, seeds, "floor")}


def _against_first(variants: dict, seeds: int, label: str) -> dict:
    """Each variant's relative loss difference after warm-up from the first, per seed."""
    from elaswave import config
    from elaswave.reference import train_reference
    first, out = next(iter(variants)), {}
    for seed in range(seeds):
        losses = {name: train_reference(config.load(None, sets + [f"train.seed={seed}", f"train.steps={CURVE_STEPS}"]))["losses"]
                  for name, sets in variants.items()}
        out[seed] = {name: _rel_after_warmup(losses[first], losses[name]) for name in variants if name != first}
        print(f"{label} seed {seed}: " + ", ".join(f"{n} max {100 * r['max']:.3f} %, median {100 * r['median']:.3f} % "
                                                   f"(step {r['worst_step']}, {r['steps_over_2_percent']} over 2 %)"
                                                   for n, r in out[seed].items()), flush=True)
    return out


def _median_step(sets: list[str]) -> float:
    from elaswave import config
    from elaswave.reference import train_reference
    times: list[float] = []
    train_reference(config.load(None, sets), on_step=lambda r: times.append(r["step_time_s"]))
    return statistics.median(times[STEP_WARMUP:])


def step(runs: int) -> dict:
    variants = {"fp32_written": ["train.precision=fp32", "model.factory=bench.training.precision:written_out"],
                "fp32_sdpa": ["train.precision=fp32"],
                "bf16_written": ["train.precision=bf16", "model.factory=bench.training.precision:written_out"],
                "bf16_sdpa": ["train.precision=bf16"]}
    rounds = []
    for k in range(runs):
        order = list(variants) if k % 2 == 0 else list(reversed(variants))
        times = {name: _median_step(STEP_SHAPE + variants[name]) for name in order}
        rounds.append({"step_s": times, "over_fp32_written": {n: t / times["fp32_written"] for n, t in times.items()}})
        print(f"step round {k}: " + ", ".join(f"{n} {t * 1000:.0f} ms" for n, t in times.items()), flush=True)
    ratios = {n: statistics.median(r["over_fp32_written"][n] for r in rounds) for n in variants}
    print("step: over fp32 written-out: " + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()))
    return {"job": STEP_SHAPE, "warmup": STEP_WARMUP, "rounds": rounds, "median_over_fp32_written": ratios}


def main() -> int:
    ap = bench_args(__doc__, parts=("curve", "windows", "step", "islands", "floor"))
    ap.add_argument("--runs", type=int, default=3, help="step: rounds; windows, islands and floor: seeds")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    write_named(args.what, {"curve": curve, "windows": lambda: windows(args.runs), "step": lambda: step(args.runs),
                            "islands": lambda: islands(args.runs),
                            "floor": lambda: floor(args.runs)}, "precision", indent=2, in_all=("curve", "step"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
