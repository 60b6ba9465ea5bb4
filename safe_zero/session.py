"""The state of one ``safe_zero.initialize`` call, seen by the wrappers it builds.

DeepSpeed constructs safe_zero's wrapper subclasses with its own arguments, so they cannot
be handed the options directly. ``safe_zero.initialize`` makes a :class:`Session` current
for the duration of the call (under the injection lock); each wrapper captures it in its
constructor and keeps it, because its hooks run long after ``initialize`` has returned.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fix import FIXES, Fix
from safe_zero.options import SafeZeroOptions
from safe_zero.patching import overrides, swapped
from safe_zero.ranks import ProcessGroupRanks, Ranks

if TYPE_CHECKING:  # the parts' types live in the modules above this one, which alone read and write them
    from safe_zero.checkpoint_layout import FlatOrder
    from safe_zero.fixes.gradless.adapter import Gradless
    from safe_zero.fixes.gradless.order import ModuleOrder
    from safe_zero.fixes.zero3_zero_element_params import ZeroElements
    from safe_zero.uneven_inputs import UnevenInputs


@dataclass
class Session:
    """Options of one initialize call, the fixes they switch on, and what those fixes did.

    Attributes:
        options: the validated ``"safe_zero"`` config block.
        report: fix name -> what it did in this run, each kind of event once, in the order first seen
            (only fixes that acted appear). Hooks that act every step add nothing after the first time.
        counts: fix name -> event -> how many times it happened (the repeats ``report`` leaves out).
        ranks: the collectives and the store, one per engine (``safe_zero.ranks``): it names the engine in the store
            for every protocol that meets there. The replays give their own.
    """

    options: SafeZeroOptions = field(default_factory=SafeZeroOptions)
    report: dict[str, list[str]] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    ranks: Ranks = field(default_factory=ProcessGroupRanks, repr=False)
    _uses: dict[str, bool] = field(default_factory=dict, repr=False)

    def uses(self, fix: Fix) -> bool:
        """Whether ``fix`` is on: forced by the options, or ``"auto"`` and needed on this DeepSpeed."""
        # Hooks ask this per parameter per step; the answer cannot change within a session.
        on = self._uses.get(fix.name)
        if on is None:
            setting = self.options.fixes.get(fix.name, "auto")
            on = self._uses[fix.name] = fix.needed(DEEPSPEED_VERSION) if setting == "auto" else bool(setting)
        return on

    def engaged(self, fix: Fix, what: str) -> None:
        """Record that ``fix`` acted: a new kind of event joins the report, a repeat only counts.

        The report is logged once initialize returns; hooks record from then on for every step, so the
        report's size is bounded by the kinds of events, not by the length of the run.
        """
        counts = self.counts.setdefault(fix.name, {})
        seen = counts.get(what, 0)
        counts[what] = seen + 1
        if not seen:
            self.report.setdefault(fix.name, []).append(what)

    def describe(self) -> str:
        """One line: which fixes are on, and what they did so far (repeats counted)."""
        on = [name for name, fix in FIXES.items() if self.uses(fix)]
        acted = ", ".join(f"{name} ({'; '.join(self._counted(name, what) for what in events)})"
                          for name, events in self.report.items())
        return f"fixes on for DeepSpeed {DEEPSPEED_VERSION}: {', '.join(on) or 'none'}; engaged: {acted or 'none yet'}"

    def _counted(self, name: str, what: str) -> str:
        times = self.counts[name][what]
        return f"{what} (x{times})" if times > 1 else what


_current: Session | None = None


def current_session() -> Session | None:
    return _current


def made_current(session: Session) -> ContextManager[Any]:
    """``session`` current for the ``with`` block (under the patching lock); the previous one after it."""
    return swapped(sys.modules[__name__], "_current", session)


class State:
    """Everything safe_zero keeps on one DeepSpeed object it extends, as ``obj._safe_zero`` (made by :func:`state_of`):
    the session it was built under, and one part per fix that keeps state there, which that fix's module alone reads
    and writes; ``None`` where that fix keeps nothing on this object."""

    __slots__ = ("session", "module_order", "gradless", "flat_order", "grouped_mm", "zero_element", "coalesced_gather",
                 "uneven")

    def __init__(self, session: Session) -> None:
        self.session = session
        #: The ZeRO-3 coordinator's module-order protocol.
        self.module_order: ModuleOrder | None = None
        #: A ZeRO-1/2/3 optimizer's planner, with what its hooks hand over to.
        self.gradless: Gradless | None = None
        #: A flattening optimizer's flat order, which checkpoints record.
        self.flat_order: FlatOrder | None = None
        #: ``fixes.grouped_mm_alignment``: the ZeRO-3 coordinator's guarded weights, ``{module id: weights}``.
        self.grouped_mm: dict[int, tuple[Any, ...]] | None = None
        #: The coordinator's per-module zero-element parameters, or how ``safe_zero.Init`` adopts parameters.
        self.zero_element: ZeroElements | None = None
        #: ``fixes.coalesced_gather_wait``: whether ``safe_zero.Init`` reported its one-at-a-time gathers.
        self.coalesced_gather = False
        #: The engine's, for ranks that run out of batches inside ``Join``.
        self.uneven: UnevenInputs | None = None


class CapturesSession:
    """First base of every safe class: binds the current session before DeepSpeed's constructor runs.

    Some wrappers first consult their session long after ``initialize`` returned (ZeRO-3 hooks
    run during training); capturing it at construction keeps them on the caller's options.
    """

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        state_of(self)
        super().__init__(*args, **kwargs)


def state_of(wrapper: Any, session: Session | None = None) -> State:
    """``wrapper``'s :class:`State`, made on first use with ``session`` (by default the current one).

    A wrapper built outside ``safe_zero.initialize`` (directly, in tests) gets default options.
    """
    state: State | None = getattr(wrapper, "_safe_zero", None)
    if state is None:
        state = State(session or _current or Session())
        object.__setattr__(wrapper, "_safe_zero", state)
    return state


def session_for(wrapper: Any) -> Session:
    """The session ``wrapper`` belongs to, captured on first use."""
    return state_of(wrapper).session
