"""Bad input: one clear line on stderr, a non-zero exit, no traceback, no hang, nothing left running."""
import pytest

from tests.helpers.spawn import TINY, run_cli


@pytest.mark.parametrize("args,expected", [
    (["run", "--set", "parallel.pp=9"], "parallel.pp=9 is invalid"),
    (["run", "--nproc", "3"], "--nproc=3 is invalid: parallel.dp=2 x parallel.pp=2 x parallel.tp=1 needs 4 ranks"),
    (["run", "--set", "parallel.sp=2"], "parallel.sp='2' is invalid: unknown key"),
    (["run", "--set", "train.steps=-5"], "train.steps=-5 is invalid: must be >= 0"),
    (["run", "--set", "data.source=bin", "--set", "data.path=/missing/tokens.bin"], "no such file or folder"),
    (["run", "--config", "/missing.toml"], "--config='/missing.toml' is invalid: no such file"),
    (["run", "--set", "parallel.bind_address=203.0.113.7"],
     "parallel.bind_address='203.0.113.7' is invalid: it is not an address of this host"),
])
def test_bad_input_gives_one_error_line(tmp_path, args, expected):
    res = run_cli(args, tmp_path, timeout_s=60)
    assert res.returncode == 2
    lines = [l for l in res.stderr.strip().splitlines() if l]
    assert lines == [lines[0]] and lines[0].startswith("elaswave: error: ") and expected in lines[0], res.stderr


def test_token_file_with_ids_beyond_vocab(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes([0x10, 0x27]) * 200)  # token 10000 as little-endian uint16
    res = run_cli(["run", "--set", "data.source=bin", "--set", f"data.path={path}"], tmp_path, timeout_s=60)
    assert res.returncode == 2
    assert "model.vocab_size=256 is invalid: the corpus" in res.stderr and "use >= 10001" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_toml(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[train\nsteps=")
    res = run_cli(["run", "--config", str(cfg)], tmp_path, timeout_s=60)
    assert res.returncode == 2 and "not valid TOML" in res.stderr and "Traceback" not in res.stderr


def test_a_job_with_a_token_budget_trains_the_steps_it_means(tmp_path):
    sets = [*TINY, "parallel.dp=1", "parallel.pp=1", "train.num_micro_batches=2", "train.tokens=300"]
    res = run_cli(["run", *[x for s in sets for x in ("--set", s)]], tmp_path)  # 128 tokens a step: 3 steps
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in res.steps] == [0, 1, 2] and res.summary["steps"] == 3
