"""What a session records: each kind of event once, however long the run."""

from __future__ import annotations

import pytest

from tests.support.models import ZeroSized, build, ds_config, train

STEPS = 60


def _long_zero3_run(steps: int) -> dict:
    import safe_zero

    engine, *_ = safe_zero.initialize(model=build(ZeroSized), config=ds_config(3))
    session = engine.safe_zero_session
    after_initialize = {name: list(events) for name, events in session.report.items()}
    losses = train(engine, steps)
    return {"after_initialize": after_initialize, "report": session.report, "counts": session.counts,
            "losses": losses, "line": session.describe()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_report_does_not_grow_with_the_number_of_steps(ranks, world_size):
    for r in ranks.run(world_size, _long_zero3_run, steps=STEPS):
        events = r["report"]["zero3_zero_element_params"]
        assert len(events) == len(set(events)), "each kind of event is reported once"
        # After each step ZeRO-3 gathers its persistent parameters, the zero-element one among them:
        # that event happens every step, and must be counted, not appended.
        assert max(r["counts"]["zero3_zero_element_params"].values()) >= STEPS
        assert sum(len(e) for e in r["report"].values()) <= sum(len(e) for e in r["after_initialize"].values()) + 2
        assert len(r["losses"]) == STEPS and r["losses"][-1] < r["losses"][0]
        assert f"(x{max(r['counts']['zero3_zero_element_params'].values())})" in r["line"]


def test_describe_names_the_fixes_on_and_what_they_did():
    from safe_zero import Session
    from safe_zero.fixes import FIXES

    session = Session()
    fix = FIXES["gradless_params"]
    assert session.describe().endswith("engaged: none yet")
    for _ in range(3):
        session.engaged(fix, "parameter of shape (4, 8) had no gradient; reduced as zeros")
    assert session.report == {"gradless_params": ["parameter of shape (4, 8) had no gradient; reduced as zeros"]}
    assert "gradless_params (parameter of shape (4, 8) had no gradient; reduced as zeros (x3))" in session.describe()
    assert "gradless_params" in session.describe().split(";")[0], "gradless_params is on in every release"
