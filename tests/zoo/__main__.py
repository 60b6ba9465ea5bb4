"""``make zoo``: every architecture the installed transformers ships that ``discover()`` finds, built tiny and trained
on rank-dependent batches with stock DeepSpeed and with safe_zero, ZeRO-2 and ZeRO-3, each row against single-process
training on the global batch; writes ``docs/zoo.md``.

Vision-language and audio LMs run at 2 and 3 ranks, with each data pattern of ``rows.PATTERNS`` (which ranks carry an
image or an audio clip in which step: "fixed", "late", "rotating", and "image+video" where the family takes videos),
MoE causal LMs (transformers' own, and the remote-code ones of ``tests/zoo/remote``) at 2. Rows already measured on
the same versions are kept in ``.zoo/rows.jsonl`` and skipped on a rerun, so an interrupted run goes on where it
stopped (``--fresh`` measures the selected rows again).

    python -m tests.zoo [--only MODEL_TYPE ...] [--kinds vlm moe_vlm alm moe_lm remote_moe_lm] [--stages 2 3]
                        [--ranks 2 3] [--patterns fixed late rotating image+video] [--engines stock safe_zero]
                        [--render] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

from tests.zoo.architectures import MULTIMODAL, SAMPLES_IN_TRAINING, Architecture, Unbuildable, batch, discover
from tests.zoo.rows import PATTERNS, REMOTE, Outcome, build_model, patterns, reference, remote_architectures, run_row

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = ROOT / ".zoo" / "rows.jsonl"
TABLE = ROOT / "docs" / "zoo.md"
STAGES = (2, 3)


def world_sizes(arch: Architecture) -> tuple[int, ...]:
    return (2, 3) if arch.kind in MULTIMODAL else (2,)


#: Every kind of architecture the zoo runs.
KINDS = ["vlm", "moe_vlm", "alm", "moe_lm", REMOTE]


def architectures(kinds: list[str]) -> list[Architecture]:
    """What the installed transformers ships, and the remote-code MoE models of ``tests/zoo/remote``."""
    return [a for a in discover() + remote_architectures() if a.kind in kinds]


def versions() -> dict[str, str]:
    """What a row ran on: the releases a cached row must match to be kept, and the commit, in the cache only."""
    import deepspeed
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "safe_zero": commit.strip()}


def _load(current: dict[str, str]) -> dict[tuple, dict]:
    """The rows measured before with the same torch, DeepSpeed and transformers."""
    rows: dict[tuple, dict] = {}
    if CACHE.exists():
        for line in CACHE.read_text().splitlines():
            row = json.loads(line)
            if all(row["versions"][k] == current[k] for k in ("torch", "deepspeed", "transformers")):
                pattern = row.get("pattern", "fixed") if row.get("stage") is not None else None
                rows[row["model_type"], row.get("stage"), row.get("world_size"), row.get("safe"), pattern] = row
    return rows


def _save(row: dict) -> None:
    CACHE.parent.mkdir(exist_ok=True)
    with CACHE.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _forget(rows: dict[tuple, dict], only: list[str] | None, stages: list[int], ranks: list[int],
            data: list[str]) -> None:
    """Drops the measured rows ``--only``/``--stages``/``--ranks``/``--patterns`` select and rewrites the cache
    without them."""
    for key in [k for k in rows if k[1] is not None and (not only or k[0] in only) and k[1] in stages
                and k[2] in ranks and k[4] in data]:
        del rows[key]
    CACHE.parent.mkdir(exist_ok=True)
    CACHE.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))


def census(archs: list[Architecture], rows: dict[tuple, dict], current: dict[str, str]) -> None:
    """Whether each architecture builds tiny (one process, no DeepSpeed), kept as a row of its own."""
    for arch in archs:
        if (arch.model_type, None, None, None, None) not in rows:
            row = {"model_type": arch.model_type, "kind": arch.kind, "versions": current}
            try:
                model = build_model(arch)
                if arch.kind == "alm":  # the audio layout is found from the model: one batch says whether it is
                    batch(arch, model, 0, 0, True)
            except Unbuildable as why:
                row["unbuildable"] = str(why)
            rows[arch.model_type, None, None, None, None] = row
            _save(row)


def _unbuildable(rows: dict[tuple, dict], arch: Architecture) -> str | None:
    return rows[arch.model_type, None, None, None, None].get("unbuildable")


def measure(archs: list[Architecture], rows: dict[tuple, dict], current: dict[str, str],
            stages: tuple[int, ...] = STAGES, ranks: tuple[int, ...] = (2, 3),
            data: tuple[str, ...] = PATTERNS, engines: tuple[bool, ...] = (False, True)) -> None:
    from rig import Pools

    pools = Pools()
    try:
        for arch in archs:
            if _unbuildable(rows, arch):
                continue
            base = {"model_type": arch.model_type, "kind": arch.kind, "versions": current}
            for world_size, pattern in ((w, p) for w in world_sizes(arch) if w in ranks
                                        for p in patterns(arch) if p in data):
                expected = None
                for stage in stages:
                    for safe in engines:
                        key = (arch.model_type, stage, world_size, safe, pattern)
                        if key in rows:
                            continue
                        expected = expected or reference(arch, world_size, pattern)
                        started = time.monotonic()
                        # A pattern that changes across steps partitions every parameter, as at real sizes: under
                        # DeepSpeed's default threshold a tiny model is all persistent and nothing would be skipped.
                        outcome = run_row(pools, arch, stage, safe, world_size, expected,
                                          timeout=240 if safe else 90, pattern=pattern,
                                          persistence=0 if pattern != "fixed" and stage == 3 else None)
                        rows[key] = row = {**base, "stage": stage, "world_size": world_size, "safe": safe,
                                           "pattern": pattern, **vars(outcome),
                                           "seconds": round(time.monotonic() - started, 1)}
                        _save(row)
                        print(f"{arch.model_type} {pattern} ZeRO-{stage} {world_size} ranks "
                              f"{'safe_zero' if safe else 'stock'}: {outcome.cell()}", flush=True)
    finally:
        pools.close()


def render(archs: list[Architecture], rows: dict[tuple, dict], current: dict[str, str]) -> str:
    def cell(model_type: str, stage: int, world_size: int, safe: bool, pattern: str) -> str:
        row = rows.get((model_type, stage, world_size, safe, pattern))
        if row is None:
            return "not run"
        return Outcome(row["verdict"], row["difference"], row["detail"]).cell()

    lines = [
        "# The transformers zoo",
        "",
        f"Written by `make zoo` on torch {current['torch']}, DeepSpeed {current['deepspeed']}, transformers "
        f"{current['transformers']}; CPU/gloo, fp32, AdamW, clipping 1.0, 3 steps.",
        "Each rank trains on its own token ids; for vision-language models (audio LMs: an audio clip) the data pattern "
        "says which ranks carry an image in which step (`tests/zoo/rows.py` `PATTERNS`): \"fixed\", the even ranks "
        "in every step and the odd ranks text only; \"late\", every rank in step 1, then rank 1 text only; "
        "\"rotating\" (4 steps), every rank, rank 0 only, no rank, the last rank only; \"image+video\", an image "
        "on every rank and a video too on the even ones. A row is compared with single-process AdamW on the global "
        "batch: DDP-exact means every parameter and every rank's loss within 1e-4 (the largest difference in "
        "brackets). `safe_zero` runs without any `safe_zero` configuration. \"aborts\": a rank died on gloo's "
        "collective-size check (`Received data size doesn't match expected size`), where NCCL would hang or compute "
        "wrong. Architectures come from the installed transformers' auto mappings "
        "(`tests/zoo/architectures.py`), not from a list; `remote_*` are the remote-code "
        "MoE models of `tests/zoo/remote` (experts as an `nn.ModuleList`).",
        "",
        "| architecture | kind | ranks | data | ZeRO-2 stock | ZeRO-2 safe_zero | ZeRO-3 stock | ZeRO-3 safe_zero | "
        "kept gathered (ZeRO-3) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    unbuildable, not_run = [], []
    for arch in archs:
        if _unbuildable(rows, arch):
            unbuildable.append((arch, _unbuildable(rows, arch)))
            continue
        measured = [(w, p) for w in world_sizes(arch) for p in PATTERNS
                    if any((arch.model_type, s, w, safe, p) in rows for s in STAGES for safe in (False, True))]
        if not measured:
            not_run.append(arch.model_type)
            continue
        for world_size, pattern in measured:
            kept = rows.get((arch.model_type, 3, world_size, True, pattern), {}).get("kept", "")
            kept = kept.split(" kept gathered")[0].removeprefix("optional module(s) ") if kept else ""
            cells = [cell(arch.model_type, s, world_size, safe, pattern) for s in STAGES for safe in (False, True)]
            lines.append(f"| {arch.model_type} | {arch.kind} | {world_size} | {pattern} | {' | '.join(cells)} "
                         f"| {kept} |")
    return "\n".join(lines + _appendix(rows, not_run, unbuildable)) + "\n"


def _appendix(rows: dict[tuple, dict], not_run: list[str], unbuildable: list[tuple[Architecture, str]]) -> list[str]:
    """The table's notes, and the architectures it has no rows for."""
    lines = []
    sampled = [f"- {name}: {why}." for name, why in SAMPLES_IN_TRAINING.items()
               if any((name, s, 2, True, "fixed") in rows for s in STAGES)]
    if sampled:
        lines += ["", "## Notes", "", *sampled]
    if not_run:
        lines += ["", f"## Built tiny, not run in this table yet ({len(not_run)})", "",
                  "`make zoo` runs them (rows already measured are kept); " + ", ".join(not_run) + "."]
    if unbuildable:
        lines += ["", f"## Not built tiny here ({len(unbuildable)})", "", "| architecture | kind | why |",
                  "|---|---|---|"]
        lines += [f"| {arch.model_type} | {arch.kind} | {why} |" for arch, why in unbuildable]
    return lines


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these model types only")
    parser.add_argument("--kinds", nargs="*", default=KINDS, help="measure these kinds only (the table lists all)")
    parser.add_argument("--fresh", action="store_true", help="measure the selected rows again")
    parser.add_argument("--render", action="store_true", help="write the table from the rows measured so far")
    parser.add_argument("--stages", nargs="*", type=int, default=list(STAGES), help="these ZeRO stages only")
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 3], help="these world sizes only")
    parser.add_argument("--patterns", nargs="*", default=list(PATTERNS), choices=PATTERNS,
                        help="these data patterns only")
    parser.add_argument("--engines", nargs="*", default=["stock", "safe_zero"], choices=["stock", "safe_zero"],
                        help="these engines only")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    current = versions()
    everything = architectures(KINDS)
    rows = _load(current)
    if args.fresh:
        _forget(rows, args.only, args.stages, args.ranks, args.patterns)
    census(everything, rows, current)
    if not args.render:
        measure([a for a in everything if a.kind in args.kinds and (not args.only or a.model_type in args.only)],
                rows, current, tuple(args.stages), tuple(args.ranks), tuple(args.patterns),
                tuple(engine == "safe_zero" for engine in args.engines))
    TABLE.write_text(render(everything, rows, current))
    print(f"wrote {TABLE.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
