"""Whether a recorded MTTR is honest: each recovery's and store move's recorded time to repair
against the gap the step records show around it (issue 58)."""
from tests.helpers.spawn import Result


def mttr_against_steps(records: list[dict]) -> list[dict]:
    """Every recovery's and store move's recorded MTTR beside what the step records show: the gap
    from the last step completed before it to the first completed after (``gap_s``), and one
    step's time (``step_s``, the median: the fault struck somewhere in the step under way)."""
    steps = [r for r in records if r["event"] == "step"]
    walls = {r["step"]: r["wall_time"] for r in steps}  # a step a change cut short is written once
    step_s = sorted(r["step_time_s"] for r in steps)[len(steps) // 2]
    moves = {r["step"] for r in records if r["event"] == "store_moved"}
    out = []
    for rec in records:
        if rec["event"] not in ("recovery", "store_moved"):
            continue
        # A recovery resumes at the step the fault broke; a store is moved after the step it froze in.
        first = rec["resume_step"] if rec["event"] == "recovery" else rec["step"]
        before = first - (1 if rec["event"] == "recovery" else 2)
        if first not in walls or before not in walls:
            raise AssertionError(f"no step records around the {rec['event']} of step {first}: {sorted(walls)}")
        # A death in the first step on a moved store may resume one step back (its snapshots not yet
        # verified): the gap then holds that step twice, done and redone -- lost work, not repair.
        redone = 1 if rec["event"] == "recovery" and first + 1 in moves else 0
        out.append({"event": rec["event"], "recorded_s": rec["mttr_s"], "from": rec.get("mttr_from"),
                    "gap_s": walls[first] - walls[before], "step_s": step_s, "lost_work_s": step_s * (1 + redone),
                    "record": rec})
    return out


def assert_honest_mttr(res: Result, at_least: float = 0.9, of=None, slack_s: float = 0.15) -> list[tuple[float, float]]:
    """Recorded >= ``at_least`` x (the gap between step records less one step) - ``slack_s`` for every recovery
    and store move (issue 58: a store lost with its host was recorded as 4.8 s against 15 s between
    steps), or those ``of(record)`` picks: the faults the test made. (On a loaded machine a starved
    rank's heartbeats can stop for longer than the timeout: a change of its own, whose broken step
    was itself slow, so one median step does not bound the work lost before the fault. The slack
    is for sub-second gaps, where one slow step write under load is a tenth of the gap: CI saw 0.29 s
    recorded against 0.41 s less a 0.08 s median step.) Returns (recorded, gap) for each."""
    out = []
    for m in [m for m in mttr_against_steps(res.records) if of is None or of(m["record"])]:
        assert m["recorded_s"] >= at_least * (m["gap_s"] - m["lost_work_s"]) - slack_s, (m["recorded_s"], m["gap_s"], m["lost_work_s"],
                                                                         m["record"])
        out.append((m["recorded_s"], m["gap_s"]))
    return out
