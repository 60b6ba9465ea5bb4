"""The shadow of a recorded ZeRO-3 step, replayed in one process.

A step is a tree of module calls: DeepSpeed's hooks fetch a module at its entry and release it at its exit, in the
forward and again, last entered first, in the backward. The recorded step is one every rank ran; a later step of a
rank skips calls (a tower its data does not need) or runs a module fewer times. Each rank's own events go through
:class:`Shadow` as the coordinator hands them over -- nothing until its first fetch off the recorded order, which
``start``s it with the releases it already made -- and the replay checks what the real ranks rely on: the events it
makes (its own, with the missed ones carried out before each) are exactly the recorded step's, on every rank, whatever
it skipped.
"""

from __future__ import annotations

import random

import pytest

from safe_zero.fixes.gradless.shadow import FETCH, RELEASE, Event, Shadow

#: A call: (module id, its calls in order).
Call = tuple[int, list]

ROOT, EMBED, TOWER, PATCH, BLOCK, MERGER, LM, LAYER, HEAD = range(9)
#: A VLM's step with an image and a video through one tower (twice), as the recorded step.
TOWER_CALL: Call = (TOWER, [(PATCH, []), (BLOCK, []), (MERGER, [])])
RECORDED: Call = (ROOT, [(EMBED, []), TOWER_CALL, TOWER_CALL, (LM, [(LAYER, []), (LAYER, [])]), (HEAD, [])])


def events(step: Call) -> list[Event]:
    """DeepSpeed's hook calls for ``step``: the forward, then the backward (the calls in reverse, each module fetched
    before its children's backward and released after them, as its pre- and post-backward hooks fire)."""
    forward: list[Event] = []
    backward: list[Event] = []

    def walk(call: Call, into: list[Event], direction: bool) -> None:
        module, children = call
        into.append(Event(FETCH, module, direction))
        for child in (children if direction else reversed(children)):
            walk(child, into, direction)
        into.append(Event(RELEASE, module, direction))

    walk(step, forward, True)
    walk(step, backward, False)
    return forward + backward


def without(step: Call, skipped: set[int]) -> Call:
    """``step`` with the calls at the given positions (preorder index of each call) left out."""
    counter = iter(range(10**6))

    def keep(call: Call) -> Call | None:
        index = next(counter)
        module, children = call
        kept = [c for c in (keep(child) for child in children) if c is not None]
        return None if index in skipped else (module, kept)

    return keep(step) or (ROOT, [])


def replay(recorded: list[Event], own: list[Event]) -> list[Event]:
    """What a rank makes: its ``own`` events as the coordinator hands them to a :class:`Shadow` of ``recorded``."""
    shadow = Shadow()
    for event in recorded:
        shadow.record(event)
    shadow.commit()
    recorded_fetches = [e for e in recorded if e.kind == FETCH]
    made: list[Event] = []
    held: dict[tuple[int, bool], int] = {}
    fetches = 0
    for event in own:
        key = (event.module, event.forward)
        if not shadow.shadowing and event.kind == FETCH:
            following = fetches < len(recorded_fetches) and recorded_fetches[fetches] == event
            if not following:
                shadow.start(fetches, lambda e: held.get((e.module, e.forward), 0) > 0)
        if shadow.shadowing:
            missed = shadow.catch_up(event)
            assert missed is not None or event.kind == RELEASE, f"{event} is not ahead in the recorded step"
            for m in missed or ():
                made.append(m)
                held[(m.module, m.forward)] = held.get((m.module, m.forward), 0) + (1 if m.kind == FETCH else -1)
        made.append(event)
        held[key] = held.get(key, 0) + (1 if event.kind == FETCH else -1)
        fetches += event.kind == FETCH
    made += shadow.rest()
    return made


def calls(step: Call) -> int:
    return 1 + sum(calls(child) for child in step[1])


def test_a_rank_that_follows_the_recorded_step_tracks_nothing():
    recorded = events(RECORDED)
    assert replay(recorded, recorded) == recorded


@pytest.mark.parametrize("skipped", [{2}, {6}, {2, 6}, {1, 2, 6, 14}], ids=["image", "video", "text", "head-too"])
def test_a_rank_that_skips_towers_makes_the_recorded_step(skipped):
    """Preorder positions: 2 the first tower call, 6 the second, 14 the head."""
    assert replay(events(RECORDED), events(without(RECORDED, skipped))) == events(RECORDED)


def test_random_skips_make_the_recorded_fetches():
    """Whatever a rank skips, it makes the recorded fetches in the recorded order (its gathers are the others') and
    each recorded release once. Exactly the recorded step too, except where it skipped a module's last children: it
    released that module before its first fetch off the order told it that it left (so that module's parameters were
    freed early on that rank; no collective depends on it but the prefetch budget, ``stage3_max_live_parameters``)."""
    rng = random.Random(0)
    recorded = events(RECORDED)
    exact = 0
    for _ in range(300):
        skipped = {i for i in range(1, calls(RECORDED)) if rng.random() < 0.3}
        made = replay(recorded, events(without(RECORDED, skipped)))
        assert [e for e in made if e.kind == FETCH] == [e for e in recorded if e.kind == FETCH], skipped
        assert sorted(e for e in made if e.kind == RELEASE) == sorted(e for e in recorded if e.kind == RELEASE)
        exact += made == recorded
    assert exact > 150, exact


def test_a_rank_that_runs_a_module_more_often_than_the_recorded_step_is_not_shadowed():
    once = without(RECORDED, {6})
    shadow = Shadow()
    for event in events(once):
        shadow.record(event)
    shadow.commit()
    shadow.start(6, lambda e: False)  # the root, embed (fetch + release), tower, patch, block, merger: then the tower
    assert shadow.catch_up(Event(FETCH, TOWER, True)) is None


def test_a_model_of_more_modules_than_two_bytes_count_records_them_all():
    """2 bytes an event up to 16,383 modules; beyond, the recording widens and loses none."""
    shadow = Shadow()
    events = [Event(FETCH, 7, True), Event(FETCH, 20_000, True), Event(RELEASE, 20_000, True), Event(RELEASE, 7, True)]
    for event in events:
        shadow.record(event)
    shadow.commit()
    shadow.start(1, lambda e: True)
    assert shadow.catch_up(Event(RELEASE, 7, True)) == events[1:3]
