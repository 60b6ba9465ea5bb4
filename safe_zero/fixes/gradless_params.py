"""Trainable parameters without a gradient on some or all ranks (every DeepSpeed release up to 0.19.8).

DDP's rule (``find_unused_parameters=True``) is the reference: a parameter a rank did not use contributes a zero
gradient to the average. Stock ZeRO breaks it: a hook that fires with no gradient crashes ZeRO-2/3, and ranks that
use different parameters fill their reduce buckets in different orders, so the all-reduce adds unrelated gradients
(ZeRO-1/2, and ZeRO-3 outside leaf modules) or the gathers no longer pair up (ZeRO-3, a module some ranks skip).

The fix makes every rank hand DeepSpeed every trainable parameter in one agreed order, with zeros where it has no
gradient. How, and why it holds: ``docs/rank_agreement.md``. The code lives in :mod:`safe_zero.fixes.gradless`
(a pure planner, and the mixins that feed it); this module is its public face.
"""

from __future__ import annotations

from safe_zero.fixes.gradless import FIX
from safe_zero.fixes.gradless.gradients import zero_grads_for
from safe_zero.fixes.gradless.module_order import (AgreesBeforeReadingAParameter, AgreesOnModulesWhileRecording,
                                                   KeepsOptionalModulesGathered, SafeZeROOrderedDict,
                                                   blocks_to_gather_whole, make_leaves)
from safe_zero.fixes.gradless.order import ModuleClock, ModuleOrder, TracePhase
from safe_zero.fixes.gradless.planner import AT_EPILOGUE, Mode, Planner, ReductionOrder, WalkPhase
from safe_zero.fixes.gradless.stage3 import ReduceInOneOrderStage3
from safe_zero.fixes.gradless.stage12 import ReduceInOneOrderStage12

__all__ = ["AT_EPILOGUE", "FIX", "AgreesBeforeReadingAParameter", "AgreesOnModulesWhileRecording",
           "KeepsOptionalModulesGathered", "Mode", "ModuleClock", "ModuleOrder", "Planner", "ReduceInOneOrderStage12",
           "ReduceInOneOrderStage3", "ReductionOrder", "SafeZeROOrderedDict", "TracePhase", "WalkPhase",
           "blocks_to_gather_whole", "make_leaves", "zero_grads_for"]
