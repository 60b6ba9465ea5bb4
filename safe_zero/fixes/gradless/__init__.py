"""``gradless_params``: every rank reduces every trainable parameter in one order, with zeros where it has no
gradient (DDP's rule for unused parameters), on ZeRO-1/2/3. The design: ``docs/rank_agreement.md``.

Two protocols, each one object with its own phase enum, each driven by thin DeepSpeed hooks:

- The rank agreement (the optimizer's): ``planner.Planner`` (``WalkPhase``), a pure state machine (agreement, agreed
  order, walk); ``gradients`` gives it autograd's reachability and the optimizer's parameters, and zero gradients;
  ``adapter`` (what the ZeRO-1/2 and ZeRO-3 optimizer hooks share) and ``stage12``, ``stage3`` (those hooks) feed it
  and carry out its hand-overs.
- ZeRO-3's module order (the coordinator's): ``order.ModuleOrder`` (``TracePhase``): one module order on every rank,
  optional modules kept gathered, a skipped module shadowed; its pure parts ``lockstep`` and ``shadow``;
  ``module_order`` holds the coordinator's, the parameter manager's and the parameter dictionaries' hooks.

Every collective and store wait of both goes through the session's ``safe_zero.ranks.Ranks``.

Data flows one way between them: the coordinator's ``ModuleOrder`` owns the module clock (``order.ModuleClock``) and
alone moves it; the ZeRO-3 optimizer's planner (``adapter.Gradless``) follows it, told of each backward module entry
from its ``wake_at`` on and of the ranks leaving the order, and reads the clock's position. Within the optimizer, the
planner offers the in-order fast path (``Planner.step``) and the stage hooks take it: a step along the chain per hook,
written in the hook itself because a call per gradient hook is what the fast path saves (``Planner.step``'s protocol).

``safe_zero.fixes.gradless_params`` is the public face of this package.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from safe_zero.fix import Fix

FIX = Fix(
    name="gradless_params",
    summary="reduce every trainable parameter in one order on every rank, with a zero gradient where a rank has "
            "none (DDP's rule for unused parameters; ZeRO-1/2/3)",
    needed_on=SpecifierSet(">=0.18.0"),
    probe="safe_zero.probes:probe_gradless_params",
)
