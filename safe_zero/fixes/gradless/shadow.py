"""A rank that skips what DeepSpeed's recorded ZeRO-3 module order has -- a tower its data does not need, a modality
run fewer times than in the recorded step -- shadows it: it makes those modules' fetches and releases without their
compute, so its gathers stay the recorded order's, as every other rank's do (docs/rank_agreement.md, "Shadowing").

Pure logic, no torch: ``order.ModuleOrder`` records the events of the forward and backward
DeepSpeed records its trace in, hands over each of this rank's own events once it has left that order, and carries
out the events returned; the tests replay per-rank event sequences through it in one process.
"""

from __future__ import annotations

from array import array
from typing import Callable, NamedTuple

#: The kinds of :class:`Event`: a module's fetch (DeepSpeed's ``fetch_sub_module``, one per entry of its trace) and
#: its release (``release_sub_module``).
FETCH, RELEASE = 0, 1


class Event(NamedTuple):
    """One call DeepSpeed's hooks make on the coordinator: ``kind`` of module ``module`` (its ``ds_id``), in a forward
    (``True``, a checkpointed block's recomputation included) or a backward."""

    kind: int
    module: int
    forward: bool


def _code(event: Event) -> int:
    """``event`` as one integer: the recorded step is kept as 2 bytes per event below 16,384 modules (it is state per
    module; ``tests/benchmarks/test_costs.py`` bounds safe_zero's state per tensor)."""
    return event.module << 2 | event.kind << 1 | event.forward


def _event(code: int) -> Event:
    return Event(code >> 1 & 1, code >> 2, bool(code & 1))


class Shadow:
    """The events of the recorded step, and where this rank's step stands among them once it left them.

    While a step follows the recorded order nothing is tracked (no cost). At this rank's first event off it,
    :meth:`start` finds its place from DeepSpeed's step (the fetches made so far); from then on each own event is
    looked up ahead (:meth:`catch_up`), and what lies before it is carried out first; :meth:`rest` is what is left at
    the end of the backward. An event not found ahead means this rank runs something the recorded step did not (more
    runs of a module than recorded): only the ranks together can handle that (``None``).
    """

    __slots__ = ("_recording", "recorded", "_fetches", "cursor", "_done")

    def __init__(self) -> None:
        self._recording = array("H")
        #: The events of the step DeepSpeed's trace was recorded in (``_code``), and (once this rank left the order in
        #: a step) the index of each fetch there.
        self.recorded = array("H")
        self._fetches: list[int] = []
        #: Where this step stands in :attr:`recorded` once it left the order (``None``: it follows the order).
        self.cursor: int | None = None
        #: Indices of recorded releases this rank made already, before it knew it left the order (skipped).
        self._done: frozenset[int] = frozenset()

    # -- recording -----------------------------------------------------------------------------------------------

    def record(self, event: Event) -> None:
        """An event of the step being recorded."""
        code = event.module << 2 | event.kind << 1 | event.forward  # _code, inlined: per event of a recording step
        try:
            self._recording.append(code)
        except OverflowError:  # 16,384 modules or more: 8 bytes per event
            self._recording = array("q", self._recording)
            self._recording.append(code)

    def commit(self) -> None:
        """The step just recorded is DeepSpeed's trace from now on (every rank's alike: DeepSpeed checked)."""
        self.recorded = self._recording
        self._fetches, self._recording, self.cursor, self._done = [], array("H"), None, frozenset()

    def discard(self) -> None:
        """No trace to follow (DeepSpeed invalidated it) until a step is recorded again."""
        self.recorded, self._fetches = array("H"), []
        self.restart()

    def restart(self) -> None:
        """A new step begins (``reset_step``): recorded again from scratch, or followed."""
        self._recording = array("H")
        self.cursor = None
        self._done = frozenset()

    # -- following -----------------------------------------------------------------------------------------------

    @property
    def shadowing(self) -> bool:
        return self.cursor is not None

    def start(self, fetched: int, still_held: Callable[[Event], bool]) -> None:
        """This rank leaves the recorded order after ``fetched`` fetches: its fetches so far were the recorded ones,
        and of the modules they left open, those it has released already (``still_held`` says no) are not released
        again (their next release ahead is done; a rank that skips a module's last child releases the module before
        the others fetch that child)."""
        if not self._fetches:
            self._fetches = [i for i, code in enumerate(self.recorded) if not code & 2]
        self.cursor = self._fetches[fetched - 1] + 1 if fetched else 0
        opened: dict[tuple[int, bool], int] = {}
        for kind, module, forward in map(_event, self.recorded[:self.cursor]):
            opened[module, forward] = opened.get((module, forward), 0) + (1 if kind == FETCH else -1)
        released = {key for key, count in opened.items() if count > 0 and not still_held(Event(RELEASE, *key))}
        done = set()
        for i in range(self.cursor, len(self.recorded)):
            kind, module, forward = _event(self.recorded[i])
            if kind == RELEASE and (module, forward) in released:
                released.discard((module, forward))
                done.add(i)
        self._done = frozenset(done)

    def catch_up(self, event: Event) -> list[Event] | None:
        """This rank's own ``event``, after it left the order: the recorded events before its next occurrence, to carry
        out first (none where it is next); ``None`` where it does not occur again (the cursor stays)."""
        assert self.cursor is not None
        recorded, code = self.recorded, _code(event)
        for i in range(self.cursor, len(recorded)):
            if recorded[i] == code:
                missed = [_event(recorded[j]) for j in range(self.cursor, i) if j not in self._done]
                self.cursor = i + 1
                return missed
        return None

    def rest(self) -> list[Event]:
        """The recorded events this rank has not made, at the end of its backward (the cursor moves past them)."""
        if self.cursor is None:
            return []
        missed = [_event(self.recorded[j]) for j in range(self.cursor, len(self.recorded)) if j not in self._done]
        self.cursor = len(self.recorded)
        return missed


__all__ = ["FETCH", "RELEASE", "Event", "Shadow"]
