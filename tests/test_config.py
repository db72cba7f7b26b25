import pytest

from elaswave import config
from elaswave.config import ConfigError


def test_defaults_are_valid_and_overrides_apply(tmp_path):
    cfg = config.load(None, ["parallel.dp=3", "train.lr=1e-3", "train.deterministic=true", "data.source=stdlib"])
    assert (cfg.parallel.dp, cfg.train.lr, cfg.train.deterministic) == (3, 1e-3, True)
    f = tmp_path / "job.toml"
    f.write_text("[parallel]\ndp = 1\npp = 3\n[train]\nsteps = 7\n")
    cfg = config.load(str(f), ["train.steps=9"])
    assert (cfg.parallel.dp, cfg.parallel.pp, cfg.train.steps) == (1, 3, 9)
    assert config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("overrides,message", [
    (["parallel.pp=9"], "parallel.pp=9 is invalid: must be <= the model's 6 layers"),
    (["elastic.spares=-1"], "elastic.spares=-1 is invalid: must be >= 0"),
    (["elastic.snapshot_copies=0"], "elastic.snapshot_copies=0 is invalid: must be >= 1"),
    (["elastic.snapshot_copies=2", "parallel.dp=2", "parallel.pp=1"], "elastic.snapshot_copies=2 is invalid: must be <= 1"),
    (["train.steps=-1"], "train.steps=-1 is invalid: must be >= 0"),
    (["train.stepz=3"], "train.stepz='3' is invalid: unknown key; train has steps"),
    (["data.position_ids=restart"], "data.position_ids='restart' is invalid: must be one of continuous, per_document"),
    (["data.position_ids=per_document"], "data.position_ids='per_document' is invalid: restarts positions at each "
                                         "document, which needs data.document_masking in effect"),
    (["model.d_model=30"], "model.d_model=30 is invalid: must be divisible by model.num_heads=4"),
    (["parallel.dp=abc"], "parallel.dp='abc' is invalid: must be a int"),
    (["data.source=bin", "data.path=/nope.bin"], "data.path='/nope.bin' is invalid: no such file"),
    (["train.num_micro_batches=2", "parallel.dp=4"], "train.num_micro_batches=2 is invalid: must be >= parallel.dp=4"),
    (["dp=2"], "dp='2' is invalid: unknown key; sections are"),
    (["data.path=corpus.bin"], "data.path='corpus.bin' is invalid: no such file or folder"),
    (["data.source=stdlib", "data.path=."], "data.path='.' is invalid: has no effect with data.source=stdlib"),
    (["train.precision=fp16"], "train.precision='fp16' is invalid: must be one of auto, fp32, bf16"),
    (["parallel.schedule=gpipe"], "parallel.schedule='gpipe' is invalid: must be one of 1f1b, zb-h1"),
    (["train.activation_checkpointing=some"], "train.activation_checkpointing='some' is invalid: must be none, full"),
    (["train.measure_memory_step=-2"], "train.measure_memory_step=-2 is invalid: must be >= 0, or -1 for none"),
    (["train.steps=9", "train.tokens=8192"], "train.steps=9 is invalid: set one of train.steps and train.tokens: "
                                              "train.tokens=8192 means 4 steps"),
    (["train.tokens=9", "train.epochs=1"], "train.epochs=1.0 is invalid: set one of train.tokens=9 and train.epochs"),
    (["train.tokens=-9"], "train.tokens=-9 is invalid: must be >= 0"),
    (["train.epochs=nan"], "train.epochs=nan is invalid: must be a finite number"),
    (["elastic.inject=kill:rank=4,step=3"], "elastic.inject='kill:rank=4,step=3' is invalid: rank 4 does not exist: "
                                             "the job has ranks 0..3"),
    (["elastic.inject=flip:rank=1,step=3,what=replica"], "elastic.inject='flip:rank=1,step=3,what=replica' is "
                                                          "invalid: needs parallel.tp > 1"),
    (["frequency.power_cap_w=1.5"], "frequency.power_cap_w=1.5 is invalid: below what the 4 ranks draw at the lowest "
                                    "frequency level (1.805)"),
])
def test_bad_values_name_key_value_and_what_is_valid(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert message in str(err.value)


def test_a_token_or_epoch_budget_sets_the_steps(tmp_path):
    corpus = tmp_path / "c.bin"
    corpus.write_bytes(bytes(2 * (64 * 100 + 1)))  # 6,401 uint16 tokens: 100 windows of 64 + 1
    sets = [f"data.path={corpus}", "model.seq_len=64", "train.num_micro_batches=4", "train.micro_batch_size=2"]
    # 8 windows, 512 tokens a step; an epoch budget stays inside its epochs (100 windows: 12 steps
    # and 4 windows unread), a token budget is rounded up.
    for budget, steps in (("train.epochs=1", 12), ("train.epochs=2", 25), ("train.epochs=0.08", 1),
                          ("train.tokens=1024", 2), ("train.tokens=1025", 3)):
        cfg = config.load(None, [*sets, budget])
        assert cfg.train.steps == steps, budget
        assert config.from_dict(cfg.to_dict()).train.steps == steps  # what the launcher hands its ranks
    with pytest.raises(ConfigError, match="train.epochs=0.05 is invalid: is less than one step: the corpus holds 100"):
        config.load(None, [*sets, "train.epochs=0.05"])
    with pytest.raises(ConfigError, match="train.epochs=1.0 is invalid: is ambiguous with data.mix"):
        config._budgeted(config.JobConfig(data=config.DataConfig(mix=("a=1",)), train=config.TrainConfig(epochs=1.0)))


def test_a_fault_at_admission_names_a_joiners_rank_past_the_world_size():
    assert config.load(None, ["elastic.inject=stop:rank=4,step=0,phase=admission"]).elastic.faults[0].rank == 4
