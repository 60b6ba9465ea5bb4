"""Telling the ranks' collectives not pairing up from any other failure: what a rank says, and where a rank that never
returned was waiting."""

from __future__ import annotations

import re

#: What a rank says when the ranks' collectives do not pair up: DeepSpeed's trace check, gloo's size checks (raised,
#: or printed by a process gloo aborts), and gloo on a rank whose peer such an abort took away.
MISMATCH = re.compile(r"Detected a disagreement on list contents|collective mismatch|doesn't match expected size|"
                      r"op\.preamble\.length <= op\.nbytes|Connection reset by peer|Connection closed by peer")


def main_stack(log: str) -> list[str]:
    """The frames (``File "...", line N in f``, innermost first) of the rig's job thread in a faulthandler dump."""
    for block in re.split(r"\n(?=Thread 0x|Current thread 0x)", log):
        frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', block)
        if any(fn == "_worker" for _, fn in frames):
            return [f"{path}:{fn}" for path, fn in frames]
    return []
