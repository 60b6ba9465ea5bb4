"""``gradless_params``: every rank reduces every trainable parameter in one order, with zeros where it has no
gradient (DDP's rule for unused parameters), on ZeRO-1/2/3. The design: ``docs/rank_agreement.md``.

- ``planner``: the protocol as a pure state machine (agreement, agreed order, walk), no torch.
- ``collectives``: what the planner needs from autograd and the process groups; zero gradients.
- ``adapter``: what the ZeRO-1/2 and ZeRO-3 optimizer mixins share: feed the planner, carry out its hand-overs.
- ``stage12``, ``stage3``: those mixins.
- ``module_order``: ZeRO-3's coordinator and parameter-manager mixins: the module clock, one module order,
  optional modules kept gathered, MoE blocks gathered whole.
- ``shadow``: the recorded step's fetches and releases, which a rank that skips some of them makes without compute.

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
