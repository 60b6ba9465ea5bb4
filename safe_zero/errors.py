"""Every error and warning safe_zero raises on purpose, in one leaf module (it imports nothing of safe_zero).

The modules that raise them re-export their own, so ``safe_zero.injection.InjectionError`` and
``safe_zero.errors.InjectionError`` are the same class.
"""

from __future__ import annotations


class SafeZeroError(RuntimeError):
    """Base class of every error safe_zero raises on purpose."""


class UnsupportedDeepSpeedError(SafeZeroError):
    """The installed DeepSpeed is outside the range safe_zero was built and tested for."""


class UnsupportedVersionError(SafeZeroError, ImportError):
    """A framework safe_zero integrates with is older than the floor of its supported range."""


class DeepSpeedDriftError(SafeZeroError):
    """A DeepSpeed name safe_zero rebinds or overrides is missing, or is not what safe_zero expects."""


class UnreachableModeError(SafeZeroError):
    """The config selects a DeepSpeed mode whose classes safe_zero's injection cannot reach."""


class InjectionError(SafeZeroError):
    """``initialize`` returned an engine that is not running safe_zero's classes."""


class UnsupportedPrecisionError(SafeZeroError):
    """The config asks for a precision the current accelerator cannot run."""


class SafeZeroConfigError(SafeZeroError, ValueError):
    """The ``"safe_zero"`` config block is malformed."""


class AlignmentError(SafeZeroError):
    """A grouped_mm weight is, or would be, off the 16-byte grid on this DeepSpeed route."""


class RankDivergenceError(SafeZeroError):
    """Under ZeRO-3 the ranks entered different modules at the same point of a forward: their parameter
    gathers would no longer match."""


class UnusedParameterError(SafeZeroError):
    """``"find_unused_parameters": false`` and a trainable parameter got no gradient on this rank."""


class ReentrantCheckpointWarning(UserWarning):
    """Reentrant activation checkpointing at several ranks: checkpointed blocks' gradients wait for the epilogue."""


class AlignmentWarning(UserWarning):
    """Alignment is needed by the model but was turned off by the user."""


class StaleBuildLockError(SafeZeroError):
    """A JIT build lock that no process holds: every process loading that op would wait on it forever."""


class WorldSizeMismatchError(SafeZeroError):
    """Accelerate's state counts a different number of processes than the DeepSpeed process group."""


class SafeLightningError(SafeZeroError):
    """A Lightning setting the safe DeepSpeed strategies cannot run with, or a Lightning they do not fit."""


class PrecisionFallbackWarning(UserWarning):
    """``precision="16-mixed"`` on a CPU without fp16 support: bf16 mixed precision runs instead."""


class UnevenInputsError(SafeZeroError):
    """The ranks ran different numbers of batches without ``Join``, or a rank cannot shadow the others inside it."""
