"""Print ``name==floor`` for every requirement of the core and the given extras (``make test-floor``'s constraints).

Reads ``pyproject.toml``; a name required by several of them gets the highest floor. torch included: the floor
leg installs PyPI's build of its floor (a CUDA build that runs on CPU).

    python scripts/floors.py dev,lightning,accelerate,transformers
"""

from __future__ import annotations

import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def floors(extras: list[str]) -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    found: dict[str, str] = {}
    for requirement in requirements:
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*[^;]*?>=\s*([0-9][0-9A-Za-z.]*)", requirement)
        if not match:
            continue
        name, floor = match.group(1).lower(), match.group(2)
        if name not in found or _version_key(floor) > _version_key(found[name]):
            found[name] = floor
    return found


if __name__ == "__main__":
    for name, floor in sorted(floors(sys.argv[1].split(",") if len(sys.argv) > 1 else []).items()):
        print(f"{name}=={floor}")
