"""Failure traces: reproducible synthetic ones, replayed files, and clear errors."""
import pytest

from elaswave.sim import trace


def test_poisson_is_reproducible_consistent_and_about_the_asked_rate():
    events = trace.poisson(1000, mtbf_device_h=1000.0, hours=200.0, repair_h=2.0, seed=7)
    assert events == trace.poisson(1000, 1000.0, 200.0, 2.0, seed=7)
    assert events == sorted(events)
    trace.check(events, 1000)
    fails = [e for e in events if e.kind == "fail"]
    assert 150 <= len(fails) <= 250  # 1000 devices x 200 h / 1000 h = 200 expected
    for f in fails:  # every repaired device comes back repair_h later (or after the end)
        back = [e for e in events if e.kind == "join" and e.device == f.device and e.t_s > f.t_s]
        assert not back or back[0].t_s == pytest.approx(f.t_s + 7200.0)


def test_files_replay_and_bad_ones_are_named(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"t_s": 10, "kind": "fail", "device": 3}\n{"t_s": 70, "kind": "join", "device": 3}\n')
    assert trace.load(str(good), 8) == [trace.Event(10.0, "fail", 3), trace.Event(70.0, "join", 3)]
    csv = tmp_path / "t.csv"
    csv.write_text("t_s,kind,device\n5,fail,1\n")
    assert trace.load(str(csv), 8) == [trace.Event(5.0, "fail", 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t_s": 1, "kind": "explode", "device": 3}\n')
    with pytest.raises(trace.TraceError, match="kind must be fail or join"):
        trace.load(str(bad), 8)
    with pytest.raises(trace.TraceError, match="device in 0..2"):
        trace.load(str(good), 3)
    with pytest.raises(trace.TraceError, match="No such file"):
        trace.load(str(tmp_path / "none.jsonl"), 8)
    with pytest.raises(trace.TraceError, match="device 3 is up"):
        trace.check([trace.Event(1.0, "join", 3)], 8)
    short = tmp_path / "short.csv"
    short.write_text("t_s,kind,device\n5,fail,1\n7,fail\n")
    with pytest.raises(trace.TraceError, match=r"short.csv:3: \['7', 'fail'\] has 2 columns, not 3"):
        trace.load(str(short), 8)
    word = tmp_path / "word.csv"
    word.write_text("soon,fail,1\n")
    with pytest.raises(trace.TraceError, match="needs t_s \\(number\\)"):
        trace.load(str(word), 8)
