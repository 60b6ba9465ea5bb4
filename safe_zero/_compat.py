"""Which DeepSpeed this is, and whether safe_zero supports it."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

import deepspeed

SUPPORTED_DEEPSPEED = SpecifierSet(">=0.18.0,<0.20")


class SafeZeroError(RuntimeError):
    """Base class of every error safe_zero raises on purpose."""


class UnsupportedDeepSpeedError(SafeZeroError):
    """The installed DeepSpeed is outside the range safe_zero was built and tested for."""


def _parse(version: str) -> Version:
    # "0.19.8+abc123" and similar local builds compare by their release part.
    return Version(Version(version).base_version)


DEEPSPEED_VERSION: Version = _parse(deepspeed.__version__)


def check_deepspeed_supported(version: Version = DEEPSPEED_VERSION) -> None:
    if version not in SUPPORTED_DEEPSPEED:
        raise UnsupportedDeepSpeedError(
            f"safe_zero supports DeepSpeed {SUPPORTED_DEEPSPEED} but found {version}. "
            f"Install a supported release, e.g. `pip install 'deepspeed{SUPPORTED_DEEPSPEED}'`.")
