"""Which DeepSpeed this is, and whether safe_zero supports it."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

import deepspeed

from safe_zero.errors import SafeZeroError, UnsupportedDeepSpeedError  # noqa: F401  (re-exported)
from safe_zero.versions import SUPPORTED

SUPPORTED_DEEPSPEED: SpecifierSet = SUPPORTED["deepspeed"].allowed

# Finer facts about the supported releases, named where safe_zero and its tests decide by them.
#: ZeRO-1/2 has ``zero_optimization.parameter_alignment`` (DeepSpeed pads parameter boundaries itself).
PARAMETER_ALIGNMENT_OPTION = SpecifierSet(">=0.19.7")
#: ``stage3_use_all_reduce_for_fetch_params`` packs a module's parameters by ``ds_numel``, with no slack to pad
#: (measured on 0.18.9; 0.19.8 advances by the ``ds_numel_aligned`` safe_zero rounds up).
UNPADDED_ALL_REDUCE_FETCH = SpecifierSet("<0.19.8")


def _parse(version: str) -> Version:
    # "0.19.8+abc123" and similar local builds compare by their release part.
    return Version(Version(version).base_version)


DEEPSPEED_VERSION: Version = _parse(deepspeed.__version__)
#: This DeepSpeed pads parameter boundaries in ZeRO-1/2 flat buffers when asked (``parameter_alignment``).
DEEPSPEED_PADS_PARAMETERS: bool = DEEPSPEED_VERSION in PARAMETER_ALIGNMENT_OPTION


def check_deepspeed_supported(version: Version = DEEPSPEED_VERSION) -> None:
    if version not in SUPPORTED_DEEPSPEED:
        raise UnsupportedDeepSpeedError(
            f"safe_zero supports DeepSpeed {SUPPORTED_DEEPSPEED} but found {version}. "
            f"Install a supported release, e.g. `pip install 'deepspeed{SUPPORTED_DEEPSPEED}'`.")
