"""The Python API runs a real job (worker processes, a real SIGKILL) and gives its metrics back."""
import pytest

import elaswave
from elaswave.config import ConfigError
from examples.custom_model import build

JOB = ["train.steps=6", "train.num_micro_batches=4", "parallel.dp=2", "parallel.pp=2", "train.deterministic=true",
       "model.d_model=32", "model.seq_len=32", "data.max_corpus_bytes=200000", "parallel.timeout_s=60"]


def test_train_with_a_model_factory_equals_the_reference_through_a_kill():
    run = elaswave.train(overrides=[*JOB, "elastic.inject=kill:rank=0,step=3,phase=forward"], model=build)
    ref = elaswave.train_reference(overrides=JOB, model="examples.custom_model:build")
    assert run.exit_code == 0 and len(run.recoveries) == 1
    assert run.losses == ref.losses
    assert run.summary["params_sha256"] == ref.summary["params_sha256"]


def test_a_factory_the_workers_cannot_import_is_refused():
    def local(cfg):
        return build(cfg)
    with pytest.raises(ConfigError, match="defined at the top level"):
        elaswave.train(overrides=JOB, model=local)
