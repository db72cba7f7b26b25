"""The simulator's memory: the runtime's memory model and planner at a scale that cannot run here."""

from elaswave import cli
from elaswave.sim.memory import survival

TINY = ["model.preset=llama-tiny", "train.precision=bf16", "train.num_micro_batches=8", "model.seq_len=64"]


def test_a_layout_either_re_partitions_after_a_loss_or_its_survivors_stand_by():
    (roomy,) = survival(TINY, [(2, 3)], 1e6)
    assert roomy["starts"] and roomy["after_loss"] == {"re-partitions": 3}
    # Just above the first layout's peak: a pipeline of two stages after a loss needs more.
    (tight,) = survival(TINY, [(2, 3)], roomy["peak_gib"] * 1024 * 1.0001)
    assert tight["starts"] and tight["after_loss"] == {"stands by": 3}
    (small,) = survival(TINY, [(2, 3)], roomy["peak_gib"] * 1024 * 0.3)
    assert not small["starts"] and "the least any needs is" in small["why"]


def test_simulate_keeps_every_plan_within_the_device_memory(capsys):
    argv = ["simulate", "--devices", "16", "--dp", "2", "--pp", "8", "--model", "llama3-8b", "--checkpointing", "full"]
    assert cli.main(argv + ["--device-gib", "80"]) == 0
    assert "memory: modelled peak" in capsys.readouterr().out
    assert cli.main(argv + ["--device-gib", "10", "--reserve-gib", "2"]) == 2
    err = capsys.readouterr().err
    assert "--device-gib=10 is too small for dp=2 x pp=8" in err and "with the 2 GiB reserve" in err


def test_without_a_layout_simulate_takes_the_first_that_fits_80_gib_by_default(capsys):
    """No --dp/--pp: the preferred layout (16 stages) when it fits the default device memory,
    else the first deeper pipeline that does; none fitting names the least memory that would."""
    import json
    base = ["simulate", "--devices", "96", "--model", "llama3-70b", "--checkpointing", "full", "--policies",
            "elaswave", "--json"]
    assert cli.main(base + ["--device-gib", "0"]) == 0  # no limit: the preferred layout
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["dp"], config["pp"]) == (6, 16) == tuple(config["preferred_layout"])
    assert cli.main(base) == 0  # 80 GiB by default; 16 stages fit it
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["device_gib"] == 80 and (config["dp"], config["pp"]) == (6, 16)
    assert cli.main(["simulate", "--devices", "96", "--dp", "6", "--pp", "16", "--model", "llama3-70b",
                     "--checkpointing", "full", "--device-gib", "76"]) == 2  # less the 8 GiB reserve: they do not
    assert "--device-gib=76 is too small for dp=6 x pp=16" in capsys.readouterr().err
    assert cli.main(base + ["--device-gib", "76"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["device_gib"] == 76 and config["pp"] > 16 and config["dp"] * config["pp"] == 96
    assert cli.main(base[:-1] + ["--checkpointing", "none"]) == 2  # no layout fits without checkpointing
    err = capsys.readouterr().err
    assert "--device-gib=80 is too small" in err and "of the layouts tried, pp=16, 24, 32, 48" in err


def test_simulate_prices_the_schedule_it_is_given_and_reports_it(capsys):
    """``--schedule zb-h1``: a shorter failure-free step than 1F1B on the same plan, the schedule
    in the JSON config; an unknown one is one line naming it and what is valid."""
    import json
    base = ["simulate", "--devices", "8", "--dp", "2", "--pp", "4", "--model", "gpt-1.3b", "--policies",
            "elaswave_no_dvfs", "--no-dvfs", "--json"]
    steps = {}
    for schedule in ("1f1b", "zb-h1"):
        assert cli.main(base + ["--schedule", schedule]) == 0
        config = json.loads(capsys.readouterr().out)["config"]
        assert config["pipeline_schedule"] == schedule
        steps[schedule] = config["failure_free"]["step_s"]
    assert steps["zb-h1"] < steps["1f1b"]
    assert cli.main(base + ["--schedule", "zb-h2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--schedule=zb-h2 is invalid: choose from 1f1b, zb-h1, interleaved") and "\n" not in err


def test_zb_h1_is_given_the_activations_its_stages_really_hold(capsys):
    """Each stage keeps as many micro-batches in flight as the runtime's schedule has at its peak
    (ZB-H1: every stage as many as 1F1B's first), so a plan that fits under 1F1B need not fit under
    ZB-H1 -- and the simulator says so instead of pricing it."""
    import argparse

    from elaswave.pipeline.schedule import one_f_one_b, peak_in_flight, zb_h1
    from elaswave.plan.partition import least_memory
    from elaswave.sim import run

    ap = argparse.ArgumentParser()
    run.add_arguments(ap)
    need = {}
    for schedule, generate in (("1f1b", one_f_one_b), ("zb-h1", zb_h1)):
        args = ap.parse_args(["--devices", "8", "--dp", "2", "--pp", "4", "--model", "gpt-1.3b", "--schedule", schedule])
        memory = run._memory(args, 12)
        for m in (2, 6):  # per pipeline: fewer micro-batches than stages, and more
            for s in range(4):
                assert memory.in_flight(s, 4, m) == peak_in_flight(generate(s, 4, range(m)))
        need[schedule] = least_memory(len(memory.layer_numels), 4, memory.stage_memory(4, 2, 12)) / 1024
    assert need["1f1b"] < need["zb-h1"]
    between = (need["1f1b"] + need["zb-h1"]) / 2
    argv = ["simulate", "--devices", "8", "--dp", "2", "--pp", "4", "--model", "gpt-1.3b", "--micro-batches", "12",
            "--policies", "elaswave_no_dvfs", "--no-dvfs", "--reserve-gib", "1", "--device-gib", f"{between + 1:.3f}"]
    assert cli.main(argv) == 0
    assert cli.main(argv + ["--schedule", "zb-h1"]) == 2
    err = capsys.readouterr().err
    assert "is too small for dp=2 x pp=4" in err and "zb-h1)" in err and "--schedule 1f1b" in err
