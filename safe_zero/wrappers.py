"""safe_zero's subclasses of the DeepSpeed classes that ``deepspeed.initialize`` builds.

Each class is the DeepSpeed class (its last base) with the mixins of the fixes that touch it before
it (see ``safe_zero/fixes/``), and ``CapturesSession`` first. A mixin overrides one or a few DeepSpeed
methods, each marked ``@overrides`` and checked against the installed DeepSpeed at import
(``verify_overrides``), and calls ``super()``. A mixin whose fix is off for the session passes its
calls through, with two exceptions that follow their own options instead: the grouped_mm alignment
guard (``"alignment_guard"``) checks the detected weights, and the optimizer state dict carries the
flat order (``safe_zero_flat_order``, ``None`` where nothing was reordered) so that a checkpoint is never
loaded into buffers laid out in another order.
"""

from __future__ import annotations

from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from safe_zero.fixes.flat_buffer_autograd import DetachFlatBuffers
from safe_zero.fixes.gradless_params import (AgreesOnModulesWhileRecording, KeepsOptionalModulesGathered,
                                             ReduceInOneOrderStage3, ReduceInOneOrderStage12, SafeZeROOrderedDict)
from safe_zero.fixes.grouped_mm_alignment import (AlignAllReduceFetch, AlignFlatGroups, AlignRoundRobinGroups,
                                                   AlignStage3SubGroups, GuardGatheredAlignment,
                                                   LoadsUnpaddedCheckpoints)
from safe_zero.fixes.zero3_zero_element_params import (AdoptZeroElementParams, MaterializeZeroElementOnFetch,
                                                        SafeCUDAQuantizer, SafeGatheredTensor)
from safe_zero.fixes.zero_element_groups import ExcludeZeroElementParams
from safe_zero.session import CapturesSession
from safe_zero.uneven_inputs import JoinableDeepSpeedEngine
from safe_zero.zero_init import Init as SafeZeroInit


class SafeFP16_Optimizer(CapturesSession, AlignFlatGroups, ExcludeZeroElementParams, FP16_Optimizer):
    """Fused fp16/bf16 stage-0 wrapper."""


class SafeFP16_UnfusedOptimizer(CapturesSession, FP16_UnfusedOptimizer):
    """Unfused fp16/bf16 stage-0 wrapper (the CPU route); it never flattens, so no fix touches it yet."""


class SafeBF16_Optimizer(CapturesSession, AlignFlatGroups, ExcludeZeroElementParams, BF16_Optimizer):
    """ZeRO-1 + bf16 + fp32 gradient accumulation wrapper."""


class SafeDeepSpeedZeroOptimizer(CapturesSession, AlignRoundRobinGroups, LoadsUnpaddedCheckpoints,
                                 ReduceInOneOrderStage12, ExcludeZeroElementParams, DetachFlatBuffers,
                                 DeepSpeedZeroOptimizer):
    """ZeRO-1/2 optimizer."""


class SafeDeepSpeedZeroOptimizer_Stage3(CapturesSession, AlignStage3SubGroups, ReduceInOneOrderStage3,
                                        DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 optimizer."""


class SafeDeepSpeedZeRoOffload(CapturesSession, AlignAllReduceFetch, AdoptZeroElementParams,
                               KeepsOptionalModulesGathered, DeepSpeedZeRoOffload):
    """ZeRO-3 parameter manager (also the inference-only ZeRO-3 route)."""


class SafePartitionedParameterCoordinator(CapturesSession, GuardGatheredAlignment, MaterializeZeroElementOnFetch,
                                          AgreesOnModulesWhileRecording, PartitionedParameterCoordinator):
    """ZeRO-3 fetch/release coordinator. The fetch overrides that have nothing to do on a model pass through
    (``patching.pass_through``), so their order puts the one that always has work (the module clock) last."""


SAFE_CLASSES = (
    SafeFP16_Optimizer,
    SafeFP16_UnfusedOptimizer,
    SafeBF16_Optimizer,
    SafeDeepSpeedZeroOptimizer,
    SafeDeepSpeedZeroOptimizer_Stage3,
    SafeDeepSpeedZeRoOffload,
    SafePartitionedParameterCoordinator,
    SafeZeroInit,
)

#: Every class whose mixins override DeepSpeed methods (``@overrides``), checked at import by ``verify_overrides``.
OVERRIDING = SAFE_CLASSES + (SafeCUDAQuantizer, SafeGatheredTensor, SafeZeROOrderedDict, JoinableDeepSpeedEngine)
