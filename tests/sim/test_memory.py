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
