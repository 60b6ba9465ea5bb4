"""``make bench``: safe_zero's step time against stock DeepSpeed's, in the same rounds; a dated table in .bench/.

Per row (a model at a ZeRO stage), each of 2 CPU/gloo ranks builds a stock, a second stock and a safe_zero engine
(and any engine the row adds) and steps each once per round, in every order in turn (``bodies.stepped_seconds``), in
several runs, each engine built first in as many: where an engine's buffers land moves its steps by a few percent for
a whole run. A step takes as long as its slowest rank. Per row: median step times, the ratio safe/stock and the noise
floor second stock/stock over the same rounds, and a 95 % interval of ratio - floor (``scipy.stats.bootstrap``,
resampling whole runs). Rows: ``control`` (4 x Linear(256, 256): stock trains it and every rank uses all of it; also
timed with ``"find_unused_parameters": false``, no rank agreement), ``moe`` and ``transformer`` (hidden 16, about
1,000 trainable tensors, so per-tensor work dominates a step; ``CI=true``: about 200), ``moe_rank_dependent`` (each
rank runs other experts; at ZeRO-2 also against stock made right by hand). Deterministic costs (collectives,
first-step bytes, calls per tensor, state, alignment padding) are tests, in tests/benchmarks. The section goes on top
of .bench/RESULTS.md (the last ``KEEP`` kept), the raw rounds to .bench/results.json: reports of runs, not committed
(docs/cost.md states the targets and the last full timing).

    python benchmarks/run.py [--rows control,moe] [--sizes 1000,20000] [--stages 2,3] [--rounds N] [--builds N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import warnings
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

from benchmarks import bodies  # noqa: E402
from rig import DistPool  # noqa: E402

RESULTS_MD = os.path.join(ROOT, ".bench", "RESULTS.md")
RAW_JSON = os.path.join(ROOT, ".bench", "results.json")
#: Sections RESULTS.md keeps, newest first.
KEEP = 10
ROWS = ("control", "moe", "transformer", "moe_rank_dependent")
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SIZES = (200,) if CI else (1000,)
#: By size (0: the control model): rounds per run, runs per engine (each built first in as many), warm-up rounds. A
#: 20,000-tensor ZeRO-3 step takes seconds on 2 CPU cores, so few rounds there.
ROUNDS = {0: 12, 200: 6, 1000: 6, 20000: 2}
BUILDS = {0: 4, 200: 1, 1000: 3, 20000: 1}
WARMUP = {0: 3, 200: 2, 1000: 2, 20000: 1}
TIMEOUT_S = 3 * 3600.0
HEADER = """# safe_zero benchmark results

Written by `make bench` (`benchmarks/run.py`; how it times, and what each row is: its docstring and
[docs/cost.md](../docs/cost.md)), newest run first. Per row: the median step of a stock and a safe_zero engine over
rounds in which a stock, a second stock and a safe_zero engine each take a step in the same 2 CPU ranks; the ratio
safe/stock and the noise floor (second stock / stock) over the same rounds; ratio - floor with its 95 % interval,
resampling whole runs. A row in italics times another engine in the same rounds in safe_zero's place.
"""


def extra_engines(model: str, stage: int) -> dict[str, tuple[Any, bool]]:
    """Engines a row also steps in the same rounds, by the label of their line: the engine kind, and whether that line
    is safe_zero over it (else it over stock)."""
    if model == "wide":
        no_agreement = {"find_unused_parameters": False}
        return {'`"find_unused_parameters": false` (no rank agreement) against stock': (no_agreement, False)}
    if model == "moe_rank_dependent" and stage < 3:  # stock ZeRO-1/2 trains it wrong; touched, it trains right
        return {"safe_zero against stock touching the experts each rank skips": (bodies.TOUCHED, True)}
    return {}


def timed(pool: DistPool, model: str, tensors: int, stage: int, rounds: int, builds: int) -> dict[str, Any]:
    """One row: per run, per engine, each round's seconds (the slowest rank's), and what the row is."""
    engines = (False, False, True, *(kind for kind, _ in extra_engines(model, stage).values()))
    runs = []
    for built_first in list(range(len(engines))) * builds:
        per_rank = pool.run(bodies.stepped_seconds, stage=stage, rounds=rounds, warmup=WARMUP[tensors],
                            engines=engines, built_first=built_first, model=model, tensors=tensors, timeout=TIMEOUT_S)
        runs.append([[max(rank[i][e] for rank in per_rank) for i in range(rounds)] for e in range(len(engines))])
        print(f"  {model} {tensors} ZeRO-{stage}: run {len(runs)} of {len(engines) * builds}", flush=True)
    return {"model": model, "size": tensors, "tensors": bodies.describe(model, tensors)["tensors"], "stage": stage,
            "extras": [[label, over] for label, (_, over) in extra_engines(model, stage).items()], "runs": runs}


def gap(runs: list, engine: int, against: int) -> dict[str, Any]:
    """Engine ``engine`` over engine ``against``, round by round: the median ratio, the floor (engine 1 over engine
    0, the two stock engines), and a 95 % percentile-bootstrap interval of ratio - floor over whole runs."""
    seconds = np.asarray(runs)  # runs x engines x rounds
    ratios, floors = seconds[:, engine] / seconds[:, against], seconds[:, 1] / seconds[:, 0]
    row = {"ms": 1e3 * float(np.median(seconds[:, engine])), "against_ms": 1e3 * float(np.median(seconds[:, against])),
           "ratio": float(np.median(ratios)), "floor": float(np.median(floors)), "rounds": ratios.size,
           "runs": len(runs), "interval": None}
    if len(runs) >= 3:
        from scipy import stats  # the bench extra: the test legs without it skip what needs it

        def difference(picked: np.ndarray) -> float:
            return float(np.median(ratios[picked]) - np.median(floors[picked]))

        with warnings.catch_warnings():  # few runs: scipy warns that the resampled statistic takes few values
            warnings.simplefilter("ignore")
            found = stats.bootstrap((np.arange(len(runs)),), difference, vectorized=False, n_resamples=2000,
                                    method="percentile", rng=np.random.default_rng(0))
        row["interval"] = [float(found.confidence_interval.low), float(found.confidence_interval.high)]
    return row


def lines(row: dict[str, Any]) -> list[str]:
    """The row's table lines: safe_zero against stock, then each extra engine of the same rounds (engine 3 on)."""
    name = "control" if row["model"] == "wide" else row["model"]
    compared = [(f"`{name}` | {row['tensors']} | ZeRO-{row['stage']}", 2, 0)]
    compared += [(f"*{label}* | |", 2, 3 + i) if over else (f"*{label}* | |", 3 + i, 0)
                 for i, (label, over) in enumerate(row["extras"])]
    out = []
    for head, engine, against in compared:
        g = gap(row["runs"], engine, against)
        interval = "" if g["interval"] is None else f" ({g['interval'][0]:+.3f} to {g['interval'][1]:+.3f})"
        out.append(f"| {head} | {g['against_ms']:.1f} ms | {g['ms']:.1f} ms | {g['ratio']:.3f} | {g['floor']:.3f} | "
                   f"{g['ratio'] - g['floor']:+.3f}{interval} | {g['rounds']} ({g['runs']}) |")
    return out


def import_ms(repeats: int = 5) -> float:
    """``import safe_zero`` after ``import deepspeed``, in fresh interpreters: the median milliseconds."""
    code = "import time, deepspeed; t = time.perf_counter(); import safe_zero; print(time.perf_counter() - t)"
    return 1e3 * statistics.median(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                        check=True, cwd=ROOT).stdout.split()[-1])
                                   for _ in range(repeats))


def heading(load: float) -> str:
    import deepspeed
    import torch

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    if git("status", "--porcelain", "--", "safe_zero", "benchmarks"):
        commit += " with uncommitted changes"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"## {when}, at {commit}: torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, Python "
            f"{platform.python_version()}; {platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f} at start")


def write(section: list[str], path: str = RESULTS_MD) -> None:
    """``section`` on top of the sections ``path`` has (the last ``KEEP`` kept), under the header."""
    try:
        with open(path) as f:
            kept = f.read().split("\n## ")[1:]
    except OSError:
        kept = []
    sections = ["\n".join(section)] + ["## " + s.strip() for s in kept][:KEEP - 1]
    with open(path, "w") as f:
        f.write(HEADER + "\n" + "\n\n".join(sections) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="trainable tensors of the scaled models")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rounds", type=int, help="rounds per run (default by size)")
    parser.add_argument("--builds", type=int, help="runs per engine, each built first in as many (default by size)")
    parser.add_argument("--results", default=RESULTS_MD, help="the Markdown file the section goes into")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    wanted = [(("wide", 0) if name == "control" else (name, size)) for name in args.rows.split(",")
              for size in ([0] if name == "control" else map(int, args.sizes.split(",")))
              if name != "moe_rank_dependent" or size <= 1000]  # 20,000 tensors: minutes per step
    pool = DistPool(2)
    rows = []
    try:
        for model, size in wanted:
            for stage in map(int, args.stages.split(",")):
                rounds = args.rounds or ROUNDS[size]
                rows.append(timed(pool, model, size, stage, rounds, args.builds or BUILDS[size]))
    finally:
        pool.close()
    os.makedirs(os.path.dirname(RAW_JSON), exist_ok=True)
    with open(RAW_JSON, "w") as f:
        json.dump(rows, f)
    section = [heading(load), "", "| model | tensors | stage | stock | safe_zero | ratio | floor | ratio - floor (95 % "
               "interval) | rounds (runs) |", "|---|---|---|---|---|---|---|---|---|"]
    section += [line for row in rows for line in lines(row)]
    if "control" in args.rows.split(","):
        section += ["", f"`import safe_zero` after `import deepspeed`: {import_ms():.0f} ms (median of 5)."]
    write(section, args.results)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
