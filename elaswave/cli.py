"""``elaswave run | reference | demo | export | report | simulate | prepare | data``: the command line."""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import signal
import sys

from elaswave import config, preflight
from elaswave.errors import ConfigError
from elaswave.runtime.metrics import MetricsWriter, print_error


def _config_args(ap: argparse.ArgumentParser, config_help: str = "TOML file with [model] [data] [train] "
                                                                  "[parallel] sections") -> None:
    ap.add_argument("--config", help=config_help)
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="override one key, e.g. --set parallel.dp=4 (repeatable)")


def _job_args(ap: argparse.ArgumentParser) -> None:
    _config_args(ap)
    ap.add_argument("--deterministic", action="store_true",
                    help="bit-identical results across every dp x pp layout")
    ap.add_argument("--metrics-out", metavar="F.jsonl", help="write one JSON line per step and a summary (%%n: "
                                                            "the host's node rank, for one file per host)")
    ap.add_argument("--emulate", action="store_true",
                    help="emulated compute: each layer also takes a modelled time (emulate.*), so many ranks "
                         "fit on a few cores")
    ap.add_argument("--inject", action="append", default=[], metavar="FAULT",
                    help="kill:rank=R,step=S[,phase=forward|backward|reduce|optimizer|snapshot] or "
                         "stop:rank=R,step=S[,phase=...]: the rank SIGKILLs (SIGSTOPs) itself there; "
                         "join:step=S[,count=N]: N new ranks join from step S (repeatable)")


def _load(args: argparse.Namespace) -> config.JobConfig:
    overrides = list(args.overrides) + (["train.deterministic=true"] if args.deterministic else [])
    if getattr(args, "emulate", False):
        overrides.append("emulate.enabled=true")
    if args.inject:
        overrides.append("elastic.inject=" + ";".join(args.inject))
    if getattr(args, "respawn_after", None) is not None:
        overrides.append(f"elastic.respawn_after_s={args.respawn_after}")
    return config.load(args.config, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from elaswave.control import slurm
    slurm.fill_host_flags(args, cfg)  # (and --log: this host's output into its file from here on)
    _rdzv_conf(args, args.rdzv_backend == "etcd")
    if args.nproc is not None and args.nproc != cfg.world_size:
        raise ConfigError(f"--nproc={args.nproc} is invalid: parallel.dp={cfg.parallel.dp} x "
                          f"parallel.pp={cfg.parallel.pp} x parallel.tp={cfg.parallel.tp} needs {cfg.world_size} ranks")
    if args.nproc_per_node and cfg.parallel.tp > args.nproc_per_node:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} is invalid with --nproc-per-node={args.nproc_per_node}: a "
                          "tensor-parallel group's ranks must share a host (its products all-reduce every layer); "
                          f"use parallel.tp <= {args.nproc_per_node}")
    per_host = args.nproc_per_node or cfg.world_size // max(1, args.nnodes - args.spare_nodes)
    if per_host % cfg.parallel.tp:
        raise ConfigError(f"--nproc-per-node={per_host} is invalid with parallel.tp={cfg.parallel.tp}: a host must hold "
                          "whole tensor-parallel groups; use a multiple of parallel.tp")
    preflight.check(cfg)
    from elaswave.control.admission import job_token
    from elaswave.control.agents import Node
    from elaswave.launch import launch
    from elaswave.runtime.metrics import TENSORBOARD_ENV

    node = Node(args.nnodes, args.node_rank, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id,
                args.rdzv_backend, args.spare_nodes, args.signpost)
    node.validate(cfg.world_size, job_token())

    if args.tensorboard:  # the workers' writer reads it (under torchrun, set it yourself)
        if not args.metrics_out:
            raise ConfigError(f"--tensorboard={args.tensorboard} is invalid without --metrics-out F.jsonl: the scalars "
                              "are written by the rank that writes the metrics; give both")
        os.environ[TENSORBOARD_ENV] = args.tensorboard
    health = None
    if args.health_file:
        from elaswave.control.health import HostHealth
        health = HostHealth(args.health_file)
        os.environ.update(health.env)  # the workers' word goes where the agent reads it
    ranks = node.founding_ranks(cfg.world_size)
    where = (f", this host node {node.node_rank} of {node.nnodes} " + (
        f"(ranks {ranks.start}-{ranks.stop - 1})" if ranks else f"(a spare: {node.workers(cfg.world_size)} ranks stand by)")
        if node.is_multi_host else "")
    tp = f" tp={cfg.parallel.tp}" if cfg.parallel.tp > 1 else ""
    print(f"elaswave: dp={cfg.parallel.dp} pp={cfg.parallel.pp}{tp} ({cfg.world_size} ranks{where}), "
          f"{cfg.model.num_layers} layers, global batch {cfg.train.num_micro_batches} x "
          f"{cfg.train.micro_batch_size} sequences, {'deterministic' if cfg.train.deterministic else 'fast'} mode",
          flush=True)
    outcome: dict = {}
    code = launch(cfg, args.metrics_out, timeout_s=args.timeout_s, node=node, health=health, outcome=outcome)
    # Only an agent that followed the store can have lost the batch host (node 0's): no scontrol from the others.
    if code == 0 and args.slurm_step is not None and "watching" in outcome and outcome["watching"].followed:
        said = slurm.end_if_batch_host_lost(args.slurm_step.job_id, args.slurm_step.node_name, grace_s=5.0)
        if said:
            print(f"elaswave: {said}", flush=True)
    if args.metrics_out and os.path.exists(args.metrics_out):
        print(f"elaswave: metrics in {args.metrics_out}; plots and a page: elaswave report {args.metrics_out}", flush=True)
    return code


def _rdzv_conf(args: argparse.Namespace, on_etcd: bool) -> None:
    """``--rdzv-conf`` into the environment the workers inherit; on etcd, the credentials checked
    now (a password that would go in clear is one line before anything starts)."""
    from elaswave.control import rendezvous

    if args.rdzv_conf:
        rendezvous.apply_conf(args.rdzv_conf)
    if on_etcd:
        rendezvous.tls()
        rendezvous.credentials()


def cmd_join(args: argparse.Namespace) -> int:
    """Add this machine's process to a running job as a new rank: it asks the job's leader for
    admission with ELASWAVE_TOKEN and, once admitted, trains in the job's next epoch."""
    import json
    import subprocess
    import tempfile

    from elaswave.control import rank_numbers, rendezvous, seal
    from elaswave.control.admission import JOIN_ENV, STARTED_ENV, TOKEN_ENV
    from elaswave.control.membership import PREFIX

    if bool(args.store) == bool(args.slurm_job):
        raise ConfigError("elaswave join needs one of --store HOST:PORT (as `elaswave run` printed it) and --slurm-job JOBID")
    if args.slurm_job:
        from elaswave.control import slurm
        args.store = slurm.job_endpoint(args.slurm_job, args.timeout_s)
    _rdzv_conf(args, rendezvous.is_etcd(args.store))
    if ":" not in args.store:
        raise ConfigError(f"--store={args.store!r} is invalid: use HOST:PORT, as `elaswave run` prints it")
    if not os.environ.get(TOKEN_ENV):
        raise ConfigError(f"{TOKEN_ENV} is not set: a job admits only ranks that know its token")
    try:
        store = seal.open_job(rendezvous.connect(args.store, args.timeout_s, args.timeout_s),
                              os.environ[TOKEN_ENV], found=True)
        doc = json.loads(store.get(PREFIX + "config"))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for the user
        raise ConfigError(f"--store={args.store!r}: no elaswave job answers there ({type(exc).__name__}: {exc})") from None
    rank, claim = rank_numbers.claim(store)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="elaswave-join-", delete=False) as fh:
        json.dump(doc, fh)
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="0", LOCAL_RANK="0", ELASWAVE_STORE=args.store,
               OMP_NUM_THREADS="1", **{JOIN_ENV: "1", STARTED_ENV: repr(__import__("time").time()),
                                       rank_numbers.CLAIM_ENV: claim})
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"elaswave: joining the job at {args.store} as rank {rank}", flush=True)
    cmd = [sys.executable, "-m", "elaswave.runtime.worker", "--config", fh.name]
    if args.metrics_out:
        cmd += ["--metrics-out", args.metrics_out]
    try:
        return subprocess.call(cmd, env=env)
    finally:
        os.unlink(fh.name)


def cmd_reference(args: argparse.Namespace) -> int:
    cfg = _load(args)
    preflight.check_model_and_data(cfg)
    _write_reference(cfg, args.metrics_out)
    return 0


def _write_reference(cfg: config.JobConfig, path: str, show_progress: bool = True) -> dict:
    from elaswave.reference import train_reference

    writer = MetricsWriter(path, show_progress=show_progress, total_steps=cfg.train.steps)
    result = train_reference(cfg, on_step=writer.write)
    writer.write({"event": "summary", "steps": cfg.train.steps, "final_loss": result["losses"][-1] if result["losses"] else None,
                  "params_sha256": result["params_sha256"], "state_sha256": result["state_sha256"],
                  "world_size": 1, "dp": 1, "pp": 1,
                  "deterministic": cfg.train.deterministic, "precision": result["precision"]})
    writer.close()
    return result


def _demo_kills(args: argparse.Namespace, base: config.JobConfig) -> list[tuple[int, int]]:
    """(rank, step) of every kill: as asked, else the last rank a fifth of the way in and rank 1
    three quarters of the way in (another stage, after the first replacement had time to join)."""
    if args.kill:
        kills = []
        for text in args.kill:
            rank, sep, step = text.partition("@")
            if not sep or not rank.isdigit() or not step.isdigit():
                raise ConfigError(f"--kill {text!r}: expected RANK@STEP, e.g. 3@8")
            kills.append((int(rank), int(step)))
        return kills
    steps, last = base.train.steps, base.world_size - 1
    kills = [(last, max(1, steps // 5))]
    if base.world_size > 2:
        kills.append((1, max(kills[0][1] + 1, 3 * steps // 4)))
    return kills


def _demo_story(kills: list[tuple[int, int]], joins: list[dict]) -> str:
    lost = " and ".join(f"rank {r} (step {s})" for r, s in kills)
    took = ", ".join(f"rank {j['joined_ranks'][0]} (step {j['resume_step']})" if len(j["joined_ranks"]) == 1
                     else f"ranks {j['joined_ranks']} (step {j['resume_step']})" for j in joins)
    return f"lost {lost}, and took in {took or 'no rank before the end'}"


def cmd_demo(args: argparse.Namespace) -> int:
    """Train with ranks SIGKILLed partway and replaced, train the failure-free reference, compare, draw."""
    base = config.load(args.config, list(args.overrides))
    kills = _demo_kills(args, base)
    cfg = config.load(args.config, list(args.overrides) + [
        "train.deterministic=true", f"elastic.respawn_after_s={args.respawn_after}",
        "elastic.inject=" + ";".join(f"kill:rank={r},step={s},phase=backward" for r, s in kills)])
    preflight.check_model_and_data(cfg)
    out = args.out
    os.makedirs(out, exist_ok=True)
    run_path, ref_path = os.path.join(out, "run.jsonl"), os.path.join(out, "reference.jsonl")
    from elaswave.launch import launch
    from elaswave.report import compare, render
    from elaswave.runtime.metrics import read_jsonl

    replaced = (f"each replaced by a new process {args.respawn_after:g} s after it dies" if args.respawn_after >= 0
                else "not replaced")
    print(f"elaswave demo 1/3: training dp={cfg.parallel.dp} x pp={cfg.parallel.pp} ({cfg.world_size} ranks, "
          f"deterministic); " + ", ".join(f"rank {r} is SIGKILLed at step {s}" for r, s in kills) + f", {replaced}",
          flush=True)
    code = launch(cfg, run_path)
    if code != 0:
        return code
    print("elaswave demo 2/3: training the same job failure-free, in one process (the reference)", flush=True)
    # The run wrote the export; the reference is a comparison, not a second export into the same folder.
    _write_reference(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, export_hf="")), ref_path,
                     show_progress=False)
    print("elaswave demo 3/3: comparing and drawing", flush=True)
    render(run_path, ref_path, os.path.join(out, "report"))
    run = read_jsonl(run_path)
    c = compare(run, read_jsonl(ref_path))
    story = _demo_story(kills, [r for r in run if r.get("event") == "join"])
    if c["bit_identical"]:
        print(f"\nThe run that {story} is bit-identical to the failure-free run: all "
              f"{c['steps_compared']} losses and the final parameters are equal.")
    else:
        print(f"\nThe run that {story} is NOT bit-identical to the failure-free run "
              f"(max |loss difference| {c['max_abs_dloss']:.3g}, final parameters "
              f"{'equal' if c['same_params'] else 'differ'}).")
    print(f"Plots and a page: {os.path.join(out, 'report', 'report.md')}", flush=True)
    return 0 if c["bit_identical"] else 1


BENCH_CLAIMS = ("mttr", "deviation", "overhead", "all")


def cmd_bench(args: argparse.Namespace) -> int:
    """``bench/peers/peers.py CLAIM`` of a source checkout: elaswave and its real peers side by side."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "peers", "peers.py")
    if not os.path.exists(script):
        raise ConfigError(f"elaswave bench runs bench/peers/peers.py from a source checkout, and there is none at "
                          f"{script}: clone the repository and `pip install -e '.[bench]'` there")
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs} is invalid: at least 1 (medians want 5)")
    import subprocess

    return subprocess.call([sys.executable, script, args.claim, "--runs", str(args.runs)])


def cmd_report(args: argparse.Namespace) -> int:
    from elaswave.report import render

    out = args.out or os.path.splitext(args.run)[0] + ".report"
    for path in render(args.run, args.against, out):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from elaswave.checkpoint.export import export_checkpoint

    if not args.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb {args.max_shard_gb} is invalid: must be > 0")
    out = export_checkpoint(args.checkpoint, args.out, int(args.max_shard_gb * 2 ** 30), args.dtype, args.overwrite,
                            args.source or "", args.merge)
    what = "a peft adapter folder" if (out / "adapter_config.json").is_file() else "config.json, the weights"
    print(f"elaswave: wrote {out} ({what}, the source's tokenizer files)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from elaswave.data.prepare import prepare

    m = prepare(args.inputs, args.out, args.tokenizer, args.text_field, args.workers, args.eval_fraction,
                args.eod_token, args.shard_tokens, args.overwrite, fmt=args.format, train_on=args.train_on,
                separator=args.separator, pack_to=args.pack_to, overlong=args.overlong)
    train, held = m["splits"]["train"], m["splits"]["eval"]
    print(f"elaswave: wrote {args.out}: {train['tokens']:,} train tokens in {train['documents']:,} documents, "
          f"{held['tokens']:,} eval tokens in {held['documents']:,}; vocabulary {m['vocab_size']:,} ({m['dtype']}); "
          f"{m['text_bytes'] / 1e6 / max(m['prepare_s'], 1e-9):.2f} MB of text per second")
    if m.get("packing"):
        p = m["packing"]["train"]
        print(f"elaswave: packed {p['conversations']:,} train conversations whole into {p['windows']:,} windows of "
              f"{m['packing']['window']} tokens (padding {100 * p['padding_share']:.1f} %); {p['overlong']:,} longer "
              f"than a window (--overlong {m['packing']['overlong']}: {p['dropped']:,} dropped, {p['pieces']:,} pieces)")
    elif m.get("input_format") == "chat":
        print("elaswave: note: one stream, cut at any window's edge; --pack-to SEQ_LEN packs each conversation whole")
    return 0


def cmd_data_batches(args: argparse.Namespace) -> int:
    import json

    from elaswave.data.lookup import batches, parse_steps

    # What the data is does not depend on the export: a finished run's folder exists and is not
    # empty, which the job's own check refuses.
    args.overrides = [*args.overrides, "checkpoint.export_hf="]
    cfg = _load(args)
    for record in batches(cfg, parse_steps(args.steps), args.text):
        print(json.dumps(record, ensure_ascii=False))
    return 0


RDZV_CONF_HELP = ("etcd over TLS, the way to run on several hosts: cacert=CA.pem,cert=CLIENT.pem,key=CLIENT.key "
                  "(torchrun's and etcdctl's names); user=NAME with password_file=PATH for a password (never in "
                  "clear: without cacert it is refused unless plain_password=1); the same as the ELASWAVE_ETCD_* "
                  "variables, which the workers inherit")


def cmd_etcd_role(args: argparse.Namespace) -> int:
    from elaswave.control.rendezvous import role_commands

    print("\n".join(role_commands(args.rdzv_id, args.user or f"elaswave-{args.rdzv_id}")))
    return 0


def _pet(name: str, default=None):
    """torchrun's flags default to its environment, ``PET_<FLAG>`` (how Kubeflow's PyTorchJob passes
    them); a flag on the command line wins, and a bad value is argparse's one line naming the flag."""
    return os.environ.get(f"PET_{name}") or default


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:  # an exec probe: answered without the other commands' imports (~0.2 s, not 3)
        from elaswave.control import health
        probe = argparse.ArgumentParser(prog="elaswave health")
        health.add_arguments(probe)
        return health.probe(probe.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(prog="elaswave", description="Elastic hybrid-parallel training on PyTorch.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with dp x pp worker processes on this host")
    _job_args(run)
    run.add_argument("--nproc", type=int, help="number of ranks (must equal dp x pp)")
    hosts = run.add_argument_group("several hosts: one `elaswave run` (an agent) per host, torchrun's flag names; "
                                   "as torchrun, each defaults to PET_<FLAG> (PET_NNODES, ...: Kubeflow's PyTorchJob)")
    hosts.add_argument("--nnodes", type=int, default=_pet("NNODES"), help="hosts in the job (default 1, or Slurm's)")
    hosts.add_argument("--node-rank", type=int, default=_pet("NODE_RANK"),
                       help="this host's number, 0..nnodes-1 (0 hosts the store; default 0, or Slurm's)")
    hosts.add_argument("--nproc-per-node", type=int, default=_pet("NPROC_PER_NODE"),
                       help="workers on each host (default: dp x pp x tp / (nnodes - spare nodes))")
    hosts.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                       help="the last K hosts train only once a host is lost: their ranks stand by, warm (default 0)")
    hosts.add_argument("--rdzv-backend", default=_pet("RDZV_BACKEND", "c10d"), metavar="c10d|etcd",
                       help="c10d: node 0's agent holds the job's store (a TCPStore); etcd: an etcd cluster holds "
                            "it, and a majority of its members decides (any value is checked: one line if invalid)")
    master = f"{_pet('MASTER_ADDR')}:{_pet('MASTER_PORT')}" if _pet("MASTER_ADDR") and _pet("MASTER_PORT") else None
    hosts.add_argument("--rdzv-endpoint", default=_pet("RDZV_ENDPOINT", master), metavar="HOST:PORT[,...]",
                       help="c10d: node 0's address and a free port for the job's store; etcd: the cluster's members "
                            "(default PET_RDZV_ENDPOINT, else PET_MASTER_ADDR:PET_MASTER_PORT)")
    hosts.add_argument("--rdzv-id", default=_pet("RDZV_ID"), help="the job's id; every agent must give the same "
                                                                  "(default elaswave, or slurm-JOBID)")
    hosts.add_argument("--rdzv-conf", default=_pet("RDZV_CONF", ""), metavar="KEY=VALUE,...", help=RDZV_CONF_HELP)
    hosts.add_argument("--launcher", default="auto", choices=("auto", "slurm", "none"),
                       help="where the hosts come from: slurm reads them from the srun step this agent is a task of "
                            "(one task per node); auto does so in a step of more than one node; none: the flags alone")
    run.add_argument("--timeout-s", type=float, default=None, help="stop the job after this many seconds")
    run.add_argument("--tensorboard", metavar="DIR", help="also log TensorBoard scalars in DIR (needs tensorboard)")
    run.add_argument("--log", metavar="FILE", help="append this host's output (its workers' too) to FILE, not the "
                                                   "terminal: %%n the node rank, %%N the Slurm node, %%j the Slurm job")
    run.add_argument("--health-file", metavar="FILE", help="keep this host's state in FILE (starting, training, "
                                                           "recovering, stopped) for a probe: `elaswave health FILE`")
    run.add_argument("--respawn-after", type=float, default=None, metavar="S",
                     help="start a replacement rank (it joins the job) S seconds after a rank dies")
    run.set_defaults(func=cmd_run)
    bench = sub.add_parser("bench", help="elaswave against torchrun restarts and TorchFT, side by side "
                                         "(needs a source checkout and its [bench] extra)")
    bench.add_argument("claim", choices=BENCH_CLAIMS, help="mttr | deviation | overhead | all")
    bench.add_argument("--runs", type=int, default=5, help="runs per system (figures are medians)")
    bench.set_defaults(func=cmd_bench)
    join = sub.add_parser("join", help="add a rank to a running job (needs the job's ELASWAVE_TOKEN)")
    join.add_argument("--store", metavar="HOST:PORT", help="the job's store, as `elaswave run` prints it")
    join.add_argument("--slurm-job", metavar="JOBID", help="instead of --store: the Slurm job the training runs as "
                                                          "(its nodes say where its store is)")
    join.add_argument("--metrics-out", metavar="F.jsonl", help="where to write metrics if this rank becomes the writer")
    join.add_argument("--timeout-s", type=float, default=30.0, help="how long to wait for the store")
    join.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...", help=RDZV_CONF_HELP)
    join.set_defaults(func=cmd_join)
    role = sub.add_parser("etcd-role", help="the etcdctl commands that give a job's etcd user what it needs and "
                                            "nothing more (read-write under the job's prefix)")
    role.add_argument("--rdzv-id", default="elaswave", help="the job's id, as `elaswave run --rdzv-id` takes it")
    role.add_argument("--user", default=None, help="the etcd user (default: elaswave-ID)")
    role.set_defaults(func=cmd_etcd_role)
    ref = sub.add_parser("reference", help="train with the single-process reference oracle")
    _job_args(ref)
    ref.set_defaults(func=cmd_reference)
    demo = sub.add_parser("demo", help="the first run: train with ranks killed and replaced, train the reference, "
                                       "compare, draw")
    _config_args(demo, "TOML file (default: the embedded job)")
    demo.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                      help="SIGKILL RANK at STEP (repeatable; default: the last rank a fifth of the way in, "
                           "rank 1 three quarters of the way in)")
    demo.add_argument("--respawn-after", type=float, default=0.0, metavar="S",
                      help="start a replacement S seconds after each death (default 0; negative: never)")
    demo.add_argument("--out", default="elaswave-demo", help="folder for the metrics and the report")
    demo.set_defaults(func=cmd_demo)
    exp = sub.add_parser("export", help="a disk checkpoint (any layout) as a Hugging Face directory")
    exp.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="checkpoint.dir of a run, or one of its step_* folders")
    exp.add_argument("out", metavar="OUT_DIR")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (whole layers)")
    exp.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp16"),
                     help="the weights' dtype (auto: the source's, bf16 for a model built from a preset)")
    exp.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    exp.add_argument("--source", metavar="HF_DIR", help="the folder whose config.json and tokenizer files to carry "
                     "(default: the run's model.init_from, if it still exists)")
    exp.add_argument("--merge", action="store_true", help="a LoRA run's checkpoint: its adapters merged into the "
                     "base's weights, as a whole folder (default: a peft adapter folder)")
    exp.set_defaults(func=cmd_export)
    rep = sub.add_parser("report", help="plots and a page for a run's metrics (RUN.jsonl), against a reference")
    rep.add_argument("run", metavar="RUN.jsonl")
    rep.add_argument("--against", metavar="REF.jsonl", help="a failure-free run or `elaswave reference` metrics")
    rep.add_argument("--out", help="folder for the report (default: RUN.report/ next to RUN.jsonl)")
    rep.set_defaults(func=cmd_report)
    prep = sub.add_parser("prepare", help="tokenize text once into memory-mapped shards (data.path for a job)")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, folders of them, .jsonl files")
    prep.add_argument("--out", required=True, metavar="DIR", help="a new folder for the prepared corpus")
    prep.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                      help="bytes | PATH/tokenizer.json | MODEL_DIR | train-bpe:VOCAB (default bytes)")
    prep.add_argument("--text-field", default="text", help="the field of each .jsonl line that holds the text")
    prep.add_argument("--format", default="text", choices=("text", "chat"),
                      help="text: documents; chat: .jsonl lines of {\"messages\": [{\"role\", \"content\"}, ...]} "
                           "rendered with --tokenizer MODEL_DIR's chat template")
    prep.add_argument("--separator", default="blank-line", metavar="SEP",
                      help="what splits a text file into documents: blank-line (default), file (the whole file is "
                           "one document), or a text such as '<|endoftext|>'")
    prep.add_argument("--pack-to", type=int, default=0, metavar="L",
                      help="--format chat: pack whole conversations into windows of L tokens (the model.seq_len to "
                           "train with), so none is cut at a window's edge (default 0: one stream, cut anywhere)")
    prep.add_argument("--overlong", default="truncate", choices=("truncate", "split", "drop"),
                      help="with --pack-to, a conversation longer than a window: its first L - 1 tokens (default), "
                           "pieces of L - 1, or left out")
    prep.add_argument("--train-on", default="assistant", choices=("assistant", "all"),
                      help="--format chat: the tokens that are trained (default: what the assistant says)")
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)), help="tokenizing processes")
    prep.add_argument("--eval-fraction", type=float, default=0.0, help="share of documents held out for eval")
    prep.add_argument("--eod-token", help="the end-of-document token's text (default: the tokenizer's own)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    prep.add_argument("--overwrite", action="store_true", help="replace an earlier prepared corpus at --out")
    prep.set_defaults(func=cmd_prepare)
    data = sub.add_parser("data", help="what the job's data is: `data batches --steps A:B`")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    look = data_sub.add_parser("batches", help="each micro-batch's samples: epoch, window, shard, document, offset")
    _config_args(look)
    look.add_argument("--steps", required=True, metavar="A:B", help="steps A..B-1 (or one step A)")
    look.add_argument("--text", action="store_true", help="also each window, decoded")
    look.set_defaults(func=cmd_data_batches, deterministic=False, inject=[])
    from elaswave.control import health
    probe = sub.add_parser("health", help="exit 0 while the host's agent (`run --health-file FILE`) is alive, else 1")
    health.add_arguments(probe)
    probe.set_defaults(func=health.probe)
    sim = sub.add_parser("simulate", help="replay failures on a modelled cluster with the same planner, per policy")
    from elaswave.sim import run as sim_run

    sim_run.add_arguments(sim)
    sim.set_defaults(func=sim_run.run)
    args = ap.parse_args(argv)
    if args.command in ("run", "join"):
        # `kill -USR1` of a job's processes shows where each is, the agent's threads too: the
        # signal's default action would end the agent (its workers outlive it by design).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = args.func(args)
    except ConfigError as exc:
        print_error(str(exc))
        code = 2
    except KeyboardInterrupt:
        code = 130
    if args.command == "run":
        # An agent's helper threads may still sit in torch's C++ store calls (a connect to a frozen or
        # silent store): finalizing the interpreter under them aborted the process (SIGABRT, -6)
        # and lost the exit code. The workers end the same way (elaswave.runtime.worker).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
