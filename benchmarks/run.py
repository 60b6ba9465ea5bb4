"""``make bench``: what safe_zero costs against stock DeepSpeed, measured in the same run.

Writes ``benchmarks/RESULTS.md`` (a Markdown table) and ``benchmarks/results.json``. Targets:
step-time ratio safe/stock <= 1.01 (median over rounds in which a stock, a second stock and a safe_zero engine
in the same 2 CPU ranks each take a step, in every order in turn, over many short runs, each engine built first in
as many; the second stock against the first in the same rounds gives the noise floor, with a 95 % interval of ratio -
floor over runs, and cProfile the share of the step in safe_zero's code); all-gathers
per step with K all-zero-sized submodules equal to K = 0; alignment
padding <= 15 bytes per parameter; ``import safe_zero`` after ``import deepspeed`` <= 50 ms.

Scaled models (issue 26): ``moe`` (an experts ``nn.ModuleList`` per layer, also rank-dependent) and ``transformer``
at about 1,000 and 20,000 trainable tensors (``CI=true``: about 200), ZeRO-2 and ZeRO-3: step ratio and its
stock/stock floor, the ratio of one safe_zero engine's steps over its own with safe_zero switched off and its off/off
floor (``bodies.switched_seconds``: one engine a run, so it also times models three engines of which do not fit in
memory), safe_zero's calls per tensor by function, collectives, first-step bytes and the state safe_zero keeps.
``--only scaled --sizes 1000`` re-measures part of it, ``--timing`` picks the ratios and safe_zero's share of the step
sampled by py-spy (``bodies.sampled_share``: no per-call profiler cost), ``--record LABEL`` keeps a
run's scaled rows in RESULTS.md, ``--render`` rewrites RESULTS.md from results.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

from benchmarks import bodies  # noqa: E402
from tests.rig import DistPool  # noqa: E402

#: The control model: rounds per run and runs per engine.
ROUNDS = 12
BUILDS = 4

#: Under CI=true the scaled models shrink to about 200 trainable tensors, to keep the run short.
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The scaled models (``bodies.MODELS``): measured in full. ``moe_rank_dependent`` (each rank runs other experts)
#: gets its step ratio, noise floor and calls per tensor, at 1,000 tensors and less.
SCALED_MODELS = ("moe", "transformer", "moe_rank_dependent")
SCALED_SIZES = (200,) if CI else (1000, 20000)
#: Rounds per run, runs per engine (each engine built first in as many: ``builds`` x 3 runs, x 4 with a fourth
#: engine), and steps under cProfile, by size: a 20,000-tensor ZeRO-3 step takes many seconds on 2 CPU cores, and
#: where the engines' buffers land moves a run's medians by several percent, so many short runs beat a few long ones.
SCALED_ROUNDS = {200: 6, 1000: 12, 20000: 2}
SCALED_BUILDS = {200: 1, 1000: 3, 20000: 1}
SCALED_WARMUP = {200: 2, 1000: 2, 20000: 1}
PROFILE_STEPS = {200: 5, 1000: 5, 20000: 2}
#: The same-engine timing (``bodies.switched_seconds``): rounds per run and runs, by size. One engine per run, and its
#: off and on steps share its buffers, so fewer runs do.
SWITCHED_ROUNDS = {200: 6, 1000: 24, 20000: 3}
SWITCHED_BUILDS = {200: 1, 1000: 4, 20000: 2}
#: Steps sampled by py-spy (``bodies.sampled_share``), by size, after 2 not sampled: the agreeing step and the first
#: walk, which builds the walk's steps once per agreed order.
SAMPLED_STEPS = {200: 40, 1000: 200, 20000: 6}
SAMPLED_WARMUP = 2
SCALED_TIMEOUT = 3 * 3600.0
RESULTS_JSON = os.path.join(ROOT, "benchmarks", "results.json")


#: safe_zero with the rank agreement off: every rank promises to use every parameter (DDP's default contract).
NO_AGREEMENT = {"find_unused_parameters": False}


def _stepped(pool: DistPool, stage: int, engines: tuple[Any, ...], rounds: int, builds: int,
             **model: Any) -> list[list[float]]:
    """Per engine, its step seconds in every round of ``builds`` runs of ``bodies.stepped_seconds`` per engine, each
    built first in as many, run after run; a step is as slow as its slowest rank."""
    return _collected(pool, bodies.stepped_seconds, len(engines), list(range(len(engines))) * builds, stage=stage,
                      rounds=rounds, engines=engines, **model)


def _collected(pool: DistPool, body: Any, width: int, runs: list[int], rounds: int, **kwargs: Any) -> list[list[float]]:
    """Per column of ``body``'s rounds (``width`` of them), its seconds in every round of one run of ``body`` per
    ``built_first`` in ``runs``, run after run; a step is as slow as its slowest rank."""
    columns: list[list[float]] = [[] for _ in range(width)]
    for built_first in runs:
        per_rank = pool.run(body, rounds=rounds, built_first=built_first, timeout=SCALED_TIMEOUT, **kwargs)
        for i in range(rounds):
            for which, seconds in enumerate(columns):
                seconds.append(max(rank[i][which] for rank in per_rank))
    return columns


def switched_ratio(pool: DistPool, stage: int, rounds: int, builds: int, **model: Any) -> dict:
    """safe_zero's step over the same engine's with safe_zero switched off, and the off/off noise floor, from the
    same rounds of ``builds`` runs of ``bodies.switched_seconds`` (:func:`_summary`: ``stock`` there is off)."""
    load = os.getloadavg()[0]
    off, off_again, on = _collected(pool, bodies.switched_seconds, 3, list(range(builds)), rounds, stage=stage,
                                    **model)
    return {"load": load, **_summary(off, on, off, off_again, builds)}


def _summary(against: list[float], seconds: list[float], stock: list[float], stock_again: list[float],
             runs: int) -> dict:
    """``seconds`` against ``against``, round by round over ``runs`` runs of as many rounds: the median ratio, the
    noise floor (``stock_again`` against ``stock``, the same rounds), the 95 % interval of their difference, and
    every round's milliseconds."""
    ratios, floors = _ratios(against, seconds), _ratios(stock, stock_again)
    return {"median_ratio": statistics.median(ratios), "stock_vs_stock_ratio": statistics.median(floors),
            "gap_ci95": _gap_interval(ratios, floors, runs), "rounds": len(seconds), "runs": runs,
            "stock_ms": 1e3 * statistics.median(against), "safe_ms": 1e3 * statistics.median(seconds),
            "round_ms": {name: [round(1e3 * t, 3) for t in series] for name, series in
                         (("against", against), ("seconds", seconds), ("stock", stock), ("stock_again", stock_again))}}


def _ratios(against: list[float], seconds: list[float]) -> list[float]:
    """Round by round, ``seconds`` over ``against``."""
    return [b / a for a, b in zip(against, seconds)]


def _gap_interval(ratios: list[float], floors: list[float], runs: int, resamples: int = 2000) -> list[float]:
    """95 % bootstrap interval of median(ratios) - median(floors) over ``runs`` runs of as many rounds, resampling
    whole runs: where each engine's buffers land moves a run's medians by several percent (per-run floors from 0.95 to
    1.03 at 1,000 tensors), more than the rounds within a run do, so the run is the unit that varies."""
    draw, n = random.Random(0), len(ratios)
    per_run = n // runs
    gaps = []
    for _ in range(resamples):
        picked = [i for run in draw.choices(range(runs), k=runs) for i in range(run * per_run, (run + 1) * per_run)]
        gaps.append(statistics.median(ratios[i] for i in picked) - statistics.median(floors[i] for i in picked))
    gaps.sort()
    return [gaps[int(0.025 * resamples)], gaps[int(0.975 * resamples) - 1]]


def _timed_ratio(pool: DistPool, stage: int, rounds: int = ROUNDS, builds: int = BUILDS, also: tuple[Any, ...] = (),
                 **model: Any) -> tuple[dict, list[list[float]]]:
    """The step ratio safe_zero/stock and its stock/stock noise floor (:func:`_summary`), from the same rounds of a
    stock, a second stock and a safe_zero engine; then every engine's seconds: those three and each of ``also``
    (``bodies.stepped_seconds`` engine kinds, stepped in the same rounds)."""
    engines = (False, False, True, *also)
    series = _stepped(pool, stage, engines, rounds, builds, **model)
    stock, stock_again, safe = series[:3]
    return _summary(stock, safe, stock, stock_again, builds * len(engines)), series


def step_time_ratio(pool: DistPool, stage: int) -> dict:
    timed, (stock, _, _, no_agreement) = _timed_ratio(pool, stage, also=(NO_AGREEMENT,))
    share = max(pool.run(bodies.safe_zero_share, stage=stage), key=lambda r: r["share"])
    return {**timed, "no_agreement_ratio": statistics.median(_ratios(stock, no_agreement)),
            "safe_zero_profiled_share": share["share"], "safe_zero_calls_per_step": share["calls_per_step"]}


def scaled_row(pool: DistPool, model: str, tensors: int, stage: int, rounds: int | None = None,
               builds: int | None = None, costs: bool = True, engines: bool = True, switched: bool = True,
               sampled: bool = True) -> dict:
    """One scaled model at one stage: collectives (first and later steps, stock and safe_zero), the memory safe_zero's
    code holds, safe_zero's calls per tensor under cProfile (``costs``), the step ratio against separately built
    stock engines and its stock/stock noise floor (``engines``), the ratio against the same engine switched off
    and its off/off floor (``switched``: where stock trains the model right, so a switched-off step is a stock one),
    and safe_zero's share of the step sampled by py-spy (``sampled``). ``rounds`` and ``builds`` replace both
    timings' defaults."""
    row: dict[str, Any] = {"model": model, "size": tensors, "stage": stage, **bodies.describe(model, tensors),
                           "load": os.getloadavg()[0]}
    started = time.time()
    if costs and model != "moe_rank_dependent":
        safe = pool.run(bodies.scaled_costs, stage=stage, model=model, tensors=tensors, safe=True,
                        profile_steps=PROFILE_STEPS[tensors], timeout=SCALED_TIMEOUT)
        stock = pool.run(bodies.scaled_costs, stage=stage, model=model, tensors=tensors, safe=False,
                         timeout=SCALED_TIMEOUT)
        row["collectives"] = {"stock": stock[0]["collectives"], "safe_zero": safe[0]["collectives"]}
        row["collectives_agree_across_ranks"] = all(r["collectives"] == safe[0]["collectives"] for r in safe)
        row["memory"] = max((r["memory"] for r in safe), key=lambda m: m["peak_bytes"])
        row["profile"] = max((r["profile"] for r in safe), key=lambda p: p["share"])
    elif costs:
        row["profile"] = max(pool.run(bodies.safe_zero_share, stage=stage, model=model, tensors=tensors,
                                      steps=PROFILE_STEPS[tensors], warmup=SCALED_WARMUP[tensors],
                                      timeout=SCALED_TIMEOUT), key=lambda p: p["share"])
    warmup = SCALED_WARMUP[tensors]
    engine_rounds, engine_builds = (SCALED_ROUNDS[tensors] if rounds is None else rounds,
                                    SCALED_BUILDS[tensors] if builds is None else builds)
    switched_rounds, switched_builds = (SWITCHED_ROUNDS[tensors] if rounds is None else rounds,
                                        SWITCHED_BUILDS[tensors] if builds is None else builds)
    if engines and engine_rounds:
        # Stock ZeRO-1/2 untouched skips the reductions DDP's answer needs where ranks run other experts (it trains
        # wrong); touched, it does them too: both are timed against safe_zero, in the same rounds. Stock ZeRO-3's
        # leaf-module hook already does them.
        touched = (bodies.TOUCHED,) if model == "moe_rank_dependent" and stage < 3 else ()
        timed, series = _timed_ratio(pool, stage, engine_rounds, engine_builds, also=touched, model=model,
                                     tensors=tensors, warmup=warmup)
        row.update(timed)
        if touched:
            stock, stock_again, safe, stock_touching = series
            row["touched"] = _summary(stock_touching, safe, stock, stock_again, timed["runs"])
    # A switched-off step is a stock one only where stock trains right: not ZeRO-1/2 on rank-dependent experts.
    if switched and switched_rounds and (model != "moe_rank_dependent" or stage == 3):
        row["switched"] = switched_ratio(pool, stage, switched_rounds, switched_builds, model=model, tensors=tensors,
                                         warmup=warmup)
    if sampled:
        row["sampled"] = pooled_samples(pool.run(bodies.sampled_share, stage=stage, model=model, tensors=tensors,
                                                 steps=SAMPLED_STEPS[tensors], warmup=SAMPLED_WARMUP,
                                                 timeout=SCALED_TIMEOUT))
    row["seconds"] = round(time.time() - started, 1)
    return row


def pooled_samples(per_rank: list[dict]) -> dict:
    """Every rank's ``bodies.sampled_share``, summed: safe_zero's share of the samples, with its 95 % interval
    (Wilson's, the samples taken as independent draws), and its functions' samples; or the first rank's error."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {"error": errors[0]}
    samples, ours = sum(r["samples"] for r in per_rank), sum(r["ours"] for r in per_rank)
    functions = sum((collections.Counter(r["functions"]) for r in per_rank), collections.Counter())
    return {"samples": samples, "ours": ours, "share": ours / samples if samples else 0.0,
            "ci95": wilson(ours, samples), "steps": per_rank[0]["steps"], "rate": per_rank[0]["rate"],
            "functions": dict(sorted(functions.items(), key=lambda item: (-item[1], item[0])))}


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """The 95 % (``z``) Wilson score interval of a proportion ``k`` of ``n``."""
    if not n:
        return [0.0, 1.0]
    p = k / n
    centre, half = p + z * z / (2 * n), z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return [(centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)]


def import_ms(repeats: int = 5) -> float:
    code = ("import time, deepspeed; t = time.perf_counter(); import safe_zero; "
            "print(time.perf_counter() - t)")
    samples = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=ROOT).stdout.strip().splitlines()[-1]) for _ in range(repeats)]
    return 1e3 * statistics.median(samples)


def alignment_overhead() -> list[dict] | None:
    """Padding DeepSpeed's parameter_alignment adds (safe_zero's reordered routes add none), per layout."""
    try:
        from benchmarks.alignment_overhead import gpt_oss, overhead, zero3_overhead
    except ImportError:
        return None
    layouts = {
        "tiny GPT-OSS (hidden 64, 4 experts)": lambda: gpt_oss(64, 32, 4, layers=1, vocab=128, heads=2, kv_heads=1,
                                                               head_dim=32),
        "GPT-OSS-sized (64 experts x 2048 x 768, 24 layers)": lambda: gpt_oss(2048, 768, 64, layers=24, vocab=201088,
                                                                             heads=32, kv_heads=4, head_dim=64),
        "GPT-OSS-sized with 20 heads (40-byte attention sinks)": lambda: gpt_oss(
            2048, 768, 64, layers=24, vocab=201088, heads=20, kv_heads=4, head_dim=64),
    }
    rows = []
    for name, build in layouts.items():
        model = build()
        r = overhead(model)
        per_param = max(((-p.numel()) % 8) * 2 for p in model.parameters())  # bf16: 8 elements per 16 bytes
        rows.append({"layout": name, "bytes": r["parameter_alignment pad"], "percent": r["parameter_alignment %"],
                     "max_per_param": per_param, "grouped_mm_weights": r["grouped_mm weights"],
                     "misaligned_stock": r["misaligned in stock layout"],
                     "misaligned_safe_zero_order": r["misaligned in safe_zero order"],
                     "zero3_ws3": zero3_overhead(model, world_size=3)})
    return rows


def _load() -> dict:
    try:
        with open(RESULTS_JSON) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save(results: dict) -> None:
    with open(RESULTS_JSON, "w") as f:
        json.dump(results, f, indent=2)


def measure_control(pool: DistPool) -> dict:
    return {
        "step_time": {f"zero{stage}": step_time_ratio(pool, stage) for stage in (2, 3)},
        "all_gathers_per_step": {f"k{k}": max(max(r) for r in [pool.run(bodies.all_gathers_per_step, k=k)])
                                 for k in (0, 4)},
        # Per step, steps 1-3: the first ZeRO-3 step is the one DeepSpeed records its trace in.
        "collectives_per_step": {f"zero{stage}": {which: pool.run(bodies.collectives_per_step, stage=stage,
                                                                  safe=which == "safe_zero")[0]
                                                  for which in ("stock", "safe_zero")}
                                 for stage in (2, 3)},
    }


def _printable(row: dict) -> dict:
    """A row without its bulk (collectives per step, every round's milliseconds), for the log."""
    return {k: _printable(v) if isinstance(v, dict) else v for k, v in row.items()
            if k not in ("collectives", "round_ms")}


def measure_scaled(pool: DistPool, results: dict, args: argparse.Namespace) -> None:
    scaled = results.setdefault("scaled", {})
    for tensors in map(int, args.sizes.split(",")):
        for model in args.models.split(","):
            if model == "moe_rank_dependent" and tensors > 1000:
                continue  # its ratio is checked at the smaller sizes: 20,000 tensors cost minutes per step
            for stage in map(int, args.stages.split(",")):
                engines, switched = args.timing in ("all", "engines"), args.timing in ("all", "switched")
                row = scaled_row(pool, model, tensors, stage, args.rounds, args.builds, costs=not args.ratio_only,
                                 engines=engines, switched=switched, sampled=args.timing in ("all", "sampled"))
                row["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                key = f"{model}/{tensors}/zero{stage}"
                if args.ratio_only and key in scaled:  # keep the row's costs and the timings not taken now
                    kept = {k: v for k, v in scaled[key].items() if not (engines and k in ("pairs", "touched"))}
                    row = {**kept, **row, **({} if engines else {"load": kept.get("load", row["load"])})}
                scaled[key] = row
                print(json.dumps(_printable(row))[:2000], flush=True)
                _save(results)  # a long run keeps what it measured so far


def main(argv: list[str] | None = None) -> int:
    global RESULTS_JSON
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("control", "scaled"), help="measure only these rows; the others are "
                        "kept from benchmarks/results.json")
    parser.add_argument("--sizes", default=",".join(map(str, SCALED_SIZES)), help="scaled models' tensor counts")
    parser.add_argument("--models", default=",".join(SCALED_MODELS))
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--record", metavar="LABEL", help="also keep this run's scaled rows in RESULTS.md under "
                        "'LABEL, <date>' (later runs keep it)")
    parser.add_argument("--rounds", type=int, help="scaled models: rounds per run (default by size; 0: no ratio)")
    parser.add_argument("--builds", type=int, help="scaled models: runs per engine, each built first in as many "
                                                   "(default by size)")
    parser.add_argument("--ratio-only", action="store_true", help="scaled models: only what --timing picks (no "
                        "collectives, memory or cProfile: a row measured before keeps those and its other timings)")
    parser.add_argument("--timing", choices=("all", "engines", "switched", "sampled"), default="all",
                        help="scaled models: which of safe_zero's time to measure: the step ratio against separately "
                        "built stock engines, against the same engine with safe_zero switched off, safe_zero's share "
                        "of the step sampled by py-spy, or all three")
    parser.add_argument("--render", action="store_true", help="only write RESULTS.md from results.json (with "
                        "--record: keep the scaled rows there under the label)")
    parser.add_argument("--results", default=RESULTS_JSON, help="the JSON file to read and write")
    args = parser.parse_args(argv)
    RESULTS_JSON = args.results
    started = time.time()
    results = _load()
    if not args.render:
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU/gloo, 2 ranks, "
                   f"load average {os.getloadavg()[0]:.1f} at start")
        pool = DistPool(2)
        try:
            if args.only != "scaled":
                results.update(machine=machine, **measure_control(pool))
                _save(results)
            if args.only != "control":
                if args.only is None:
                    results.pop("scaled", None)
                results["scaled_machine"] = machine
                measure_scaled(pool, results, args)
        finally:
            pool.close()
        if args.only != "scaled":
            results["import_safe_zero_ms"] = import_ms()
            results["alignment_padding"] = alignment_overhead()
            results["seconds"] = round(time.time() - started, 1)
    if args.record:
        day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        results.setdefault("scaled_history", []).append(
            {"label": f"{args.record}, {day}", "machine": results.get("scaled_machine"),
             "rows": dict(results.get("scaled", {}))})
    _save(results)
    render(results)
    return 0


def render(results: dict, path: str = os.path.join(ROOT, "benchmarks", "RESULTS.md")) -> None:
    lines = ["# safe_zero benchmark results", ""]
    if "step_time" in results:  # a results file that only ever had --only scaled runs has no control rows
        lines += _control_lines(results)
    lines += scaled_lines(results)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _control_lines(results: dict) -> list[str]:
    lines = [f"Machine: {results['machine']}. Written by `make bench`.", "",
             "| measure | stock | safe_zero | ratio / value | target |", "|---|---|---|---|---|"]
    for stage, r in results["step_time"].items():
        lines.append(f"| step time, {stage}, control model | {r['stock_ms']:.2f} ms | {r['safe_ms']:.2f} ms | "
                     f"{r['median_ratio']:.3f} (median of {_sample(r)}; stock vs stock in the same "
                     f"{'rounds' if 'rounds' in r else 'harness'}: {r['stock_vs_stock_ratio']:.3f}"
                     f"{f'; ratio - floor {_gap(r)}' if 'gap_ci95' in r else ''}) "
                     "| <= 1.01 |")
        lines.append(f"| step time, {stage}, control model, `\"find_unused_parameters\": false` (no rank agreement) "
                     "| | "
                     f"| {r['no_agreement_ratio']:.3f} | <= 1.01 |")
        lines.append(f"| safe_zero's own functions in a {stage} step, under cProfile | | "
                     f"{r['safe_zero_calls_per_step']:.0f} calls | {100 * r['safe_zero_profiled_share']:.2f} % of the "
                     f"profiled step (upper bound) | |")
    ag = results["all_gathers_per_step"]
    lines.append(f"| all-gathers per ZeRO-3 step (steps 1-3), K=4 all-zero-sized submodules vs K=0 | "
                 f"{ag['k0']} (K=0) | "
                 f"{ag['k4']} (K=4) | {'equal' if ag['k0'] == ag['k4'] else 'DIFFERENT'} | equal |")
    def listed(c: dict) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items()) if not k.endswith("_bytes"))

    why = {"zero2": "(first step only: gradless_params' agreement, 1 byte per trainable parameter, and the all_gather "
                    "of every rank's hook order, 4 B per trainable parameter per rank)",
           "zero3": "(first step only: gradless_params' agreement, 1 byte per trainable parameter, the all_gather of "
                    "every rank's hook order with each hook's module clock, 8 B per trainable parameter per rank, and "
                    "one all_gather of 8 B per rank per module with parameters, the ranks agreeing on the module order)"}
    for stage, per_step in results["collectives_per_step"].items():
        for label, step in (("first", 0), ("later", -1)):
            counts = {which: steps[step] for which, steps in per_step.items()}
            extra = counts["safe_zero"].get("all_reduce_bytes", 0) - counts["stock"].get("all_reduce_bytes", 0)
            lines.append(f"| collectives in the {label} {stage} step, control model (every rank uses every parameter) "
                         f"| {listed(counts['stock'])} | {listed(counts['safe_zero'])} | +{extra} B all-reduced "
                         f"{why[stage]} | {'none' if label == 'later' else 'one small all-reduce, one all-gather'} |")
    lines.append(f"| `import safe_zero` after `import deepspeed` | | | {results['import_safe_zero_ms']:.1f} ms "
                 "| <= 50 ms |")
    for row in results["alignment_padding"] or []:
        lines.append(f"| alignment padding, {row['layout']} | | | {row['bytes']} B "
                     f"({row['percent']:.4f} % of the flat buffer, max {row['max_per_param']} B per parameter) "
                     f"| <= 15 B per parameter |")
        lines.append(f"| grouped_mm weights off the 16-byte grid, {row['layout']} | "
                     f"{row['misaligned_stock']} of {row['grouped_mm_weights']} (unpadded flat order) | "
                     f"{row['misaligned_safe_zero_order']} of {row['grouped_mm_weights']} "
                     "(safe_zero order, 0 B padding) "
                     f"| | 0 |")
        z3 = row["zero3_ws3"]
        lines.append(f"| ZeRO-3 at 3 ranks, {row['layout']}: padding safe_zero adds | | "
                     f"{z3['partition pad']} B in partitions, {z3['all-reduce slot pad']} B in the all-reduce fetch "
                     f"buffer | max {z3['all-reduce slot pad max per param']} B per parameter "
                     f"({z3['grouped_mm partitions off whole 16-byte units']} grouped_mm partitions not whole 16-byte "
                     "units) | <= 15 B per parameter |")
    return lines


def _sample(r: dict) -> str:
    """What a timed row's median is taken over: rounds (in runs), or the step pairs of the older harness."""
    if "rounds" in r:
        return f"{r['rounds']} rounds in {r['runs']} runs" if "runs" in r else f"{r['rounds']} rounds"
    return f"{r['pairs']} step pairs"


def _kinds(counts: dict) -> dict[str, int]:
    return {k: n for k, n in counts.items() if not k.endswith("_bytes")}


def _listed(counts: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(_kinds(counts).items())) or "none"


def _added(stock: dict, safe: dict) -> tuple[str, int]:
    """What safe_zero's step adds to stock's: '+n kind (bytes B)' per kind, and the bytes in all."""
    parts, total = [], 0
    for kind in sorted(set(_kinds(stock)) | set(_kinds(safe))):
        calls = safe.get(kind, 0) - stock.get(kind, 0)
        extra = safe.get(f"{kind}_bytes", 0) - stock.get(f"{kind}_bytes", 0)
        if calls or extra:
            parts.append(f"{calls:+d} {kind} ({extra:+d} B)")
            total += extra
    return ", ".join(parts) or "nothing", total


def _later(stock: list[dict], safe: list[dict]) -> str:
    steps = f"steps 2-{len(stock)}" if len(stock) > 2 else "step 2"
    if all(_kinds(a) == _kinds(b) for a, b in zip(stock[1:], safe[1:])):
        return f"stock's in {steps} ({_listed(stock[-1])})"
    return "; ".join(f"step {i + 2}: stock {_listed(a)}, safe_zero {_listed(b)}"
                     for i, (a, b) in enumerate(zip(stock[1:], safe[1:])))


def _gap(r: dict) -> str:
    """For a row timed in rounds: ratio - floor, and how far from it the rounds' noise alone could put it."""
    low, high = r["gap_ci95"]
    return f"{r['median_ratio'] - r['stock_vs_stock_ratio']:+.3f}, 95 % interval {low:+.3f} to {high:+.3f}"


def _timed(r: dict, load: str) -> str:
    within = "within" if r["median_ratio"] - r["stock_vs_stock_ratio"] <= 0.01 else "OVER"
    if "gap_ci95" in r:
        within += f" ({_gap(r)})"
    return (f"{r['stock_ms']:.0f} ms | {r['safe_ms']:.0f} ms | {r['median_ratio']:.3f} (median of {_sample(r)}{load}) | "
            f"{r['stock_vs_stock_ratio']:.3f} | {within}")


def _scaled_tables(rows: dict) -> list[str]:
    rows = sorted(rows.values(), key=lambda r: (r["size"], SCALED_MODELS.index(r["model"])
                                                 if r["model"] in SCALED_MODELS else 9, r["stage"]))
    models = {(r["model"], r["size"]): r for r in rows}
    lines = ["Models (`benchmarks/bodies.py`, trainable tensors):", ""]
    lines += [f"- `{model}` at {size}: {r['shape']}: {r['tensors']} tensors, {r['elements']:,} elements"
              for (model, size), r in models.items()]
    lines += ["", "| model | tensors | stage | stock | safe_zero | ratio safe/stock | noise floor stock/stock "
              "| ratio target (floor + 0.01; ratio - floor, its 95 % interval) | safe_zero calls per step "
              "| calls per tensor (target <= 3) "
              "| share under cProfile (an upper bound: it charges each call its cost) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        load = f", load {r['load']:.0f}" if "load" in r else ""
        timed = _timed(r, load) if "median_ratio" in r else f"not timed{load} | | | |"
        p = r.get("profile")
        profiled = (f"{p['calls_per_step']:.0f} | {p['calls_per_step'] / r['tensors']:.2f} | {100 * p['share']:.2f} % "
                    f"({p['steps']} steps)" if p else "not profiled | |")
        lines.append(f"| `{r['model']}` | {r['tensors']} | ZeRO-{r['stage']} | {timed} | {profiled} |")
        if "touched" in r:
            lines.append(f"| `{r['model']}`, stock touching the experts each rank skips (trains right) | "
                         f"{r['tensors']} | ZeRO-{r['stage']} | {_timed(r['touched'], load)} | | | |")
    lines += _switched_table([r for r in rows if "switched" in r])
    lines += _sampled_table([r for r in rows if "sampled" in r])
    lines += ["", "| model | tensors | stage | collectives, first step: stock | first step: safe_zero adds "
              "| first-step bytes safe_zero adds, per tensor | after the first step | state safe_zero keeps on the "
              "engine (peak) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "collectives" not in r:
            continue
        stock, safe = r["collectives"]["stock"], r["collectives"]["safe_zero"]
        added, total = _added(stock[0], safe[0])
        m = r["memory"]
        lines.append(f"| `{r['model']}` | {r['tensors']} | ZeRO-{r['stage']} | {_listed(stock[0])} | {added} | "
                     f"{total} B, {total / r['tensors']:.1f} B per tensor | {_later(stock, safe)} | "
                     f"{m['peak_bytes'] / 1024:.0f} KiB, {m['bytes_per_tensor']:.0f} B per tensor ({m['peak_at']}) |")
    # safe_zero's functions by calls per tensor per step, one column per model and stage.
    columns = [r for r in rows if "profile" in r]
    calls: dict[str, dict[int, tuple[float, float]]] = {}
    for i, r in enumerate(columns):
        for f in r["profile"]["functions"]:
            calls.setdefault(f["function"], {})[i] = (f["calls_per_step"] / r["tensors"], f["share"])
    # Functions called at least once per 100 tensors per step in some column; the rest are summed as "the others".
    order = sorted((name for name in calls if max(c for c, _ in calls[name].values()) >= 0.01),
                   key=lambda name: -max(c for c, _ in calls[name].values()))

    def others(i: int, r: dict) -> str:
        shown = [calls[name][i] for name in order if i in calls[name]]
        left = r["profile"]["calls_per_step"] / r["tensors"] - sum(c for c, _ in shown)
        share = r["profile"]["share"] - sum(sh for _, sh in shown)
        return f"{left:.2f} ({100 * share:.2f} %)" if left >= 0.005 else ""

    lines += ["", "safe_zero's functions by calls per trainable tensor per step (under cProfile; in brackets the "
              "function's own time as a share of the profiled step):", "",
              "| function | " + " | ".join(f"`{r['model']}` {r['tensors']} ZeRO-{r['stage']}" for r in columns) + " |",
              "|---|" + "---|" * len(columns)]
    for name in order:
        cells = [(f"{calls[name][i][0]:.2f} ({100 * calls[name][i][1]:.2f} %)" if i in calls[name] else "")
                 for i in range(len(columns))]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("| the others | " + " | ".join(others(i, r) for i, r in enumerate(columns)) + " |")
    lines.append("| all of safe_zero's functions | " + " | ".join(
        f"{r['profile']['calls_per_step'] / r['tensors']:.2f} ({100 * r['profile']['share']:.2f} %)" for r in columns)
        + " |")
    return lines


def _switched_table(rows: list[dict]) -> list[str]:
    """The rows' same-engine timing (``switched``), with the share of the step it puts on safe_zero."""
    if not rows:
        return []
    lines = ["", "The same engine with safe_zero switched off and on in turn (`bodies.switched_seconds`: off, its "
             "optimizer, parameter manager and coordinator run DeepSpeed's own methods on the same buffers, a stock "
             "step; rounds of off, off again and on in every order; the floor is off again over off):", "",
             "| model | tensors | stage | switched off | on | ratio on/off | noise floor off/off "
             "| ratio target (floor + 0.01; ratio - floor, its 95 % interval) | safe_zero's share of the step "
             "((ratio - floor) / ratio; target <= 1 %) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["switched"]
        load, ratio = f", load {s['load']:.0f}", s["median_ratio"]
        low, high = (100 * gap / ratio for gap in s["gap_ci95"])
        lines.append(f"| `{r['model']}` | {r['tensors']} | ZeRO-{r['stage']} | {_timed(s, load)} | "
                     f"{100 * (ratio - s['stock_vs_stock_ratio']) / ratio:.2f} % (95 % interval {low:.2f} to "
                     f"{high:.2f} %) |")
    return lines


def _sampled_table(rows: list[dict]) -> list[str]:
    """The rows' sampled share (``sampled``): safe_zero's samples over all, and the functions they fell in."""
    if not rows:
        return []
    lines = ["", "safe_zero's own time, sampled (`bodies.sampled_share`: py-spy reads each rank's Python stack from "
             "outside the process, so no function is charged a profiler's per-call cost; a sample is safe_zero's where "
             "its innermost Python frame is in a file under safe_zero/, its own lines and the C functions they call; "
             "a rank waiting in a collective is not sampled, so the share is of the time the ranks compute; interval: "
             "Wilson's, 95 %):", "",
             "| model | tensors | stage | steps sampled (per rank, samples a second) | samples (both ranks) | "
             "safe_zero's | safe_zero's share of the step (target <= 1 %; 95 % interval) | where (samples) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["sampled"]
        head = f"| `{r['model']}` | {r['tensors']} | ZeRO-{r['stage']} |"
        if "error" in s:
            lines.append(f"{head} not sampled: {s['error']} | | | | |")
            continue
        low, high = s["ci95"]
        where = ", ".join(f"`{name}` {n}" for name, n in list(s["functions"].items())[:4])
        lines.append(f"{head} {s['steps']} ({s['rate']}) | {s['samples']} | {s['ours']} | {100 * s['share']:.2f} % "
                     f"({100 * low:.2f} to {100 * high:.2f} %) | {where} |")
    return lines


#: How a table's step ratios were timed: rows with ``rounds`` by ``bodies.stepped_seconds``, older ones (``pairs``) by
#: two engines stepping alternately, the noise floor in runs of its own.
ROUNDS_NOTE = ("Each row: the step ratio is the median over rounds in which a stock, a second stock and a safe_zero "
               "engine each take one step in the same 2 ranks, in every order in turn (in several runs, each engine "
               "built first in as many), of safe_zero's step over stock's; the noise floor is the second stock's over "
               "stock's in the same rounds; the 95 % interval of ratio - floor resamples whole runs (where the buffers "
               "land moves a run's medians by several percent)")
PAIRS_NOTE = ("Each row: the step ratio is the median over per-step pairs of a stock and a safe_zero engine stepping "
              "alternately in the same 2 ranks (two runs, each engine built first in one), the noise floor the same "
              "harness with two stock engines, in runs of its own")
SCALED_NOTES = (
    "; calls and share come from cProfile on a safe_zero engine (functions whose file is under "
    "safe_zero/; the share is their own time over the profiled step's, an upper bound); collectives are counted at "
    "DeepSpeed's comm backend over 3 steps, bytes being each call's first tensor argument (an all_gather's output "
    "list); the state is the deep size (`sys.getsizeof` over containers, parameters counted as references) of "
    "every `_safe_zero_*` attribute of the engine, its optimizer and its ZeRO-3 parameter coordinator (the "
    "agreement and its flags, the reduction order with its module clocks, the walk, the module names), sampled "
    "after initialize and right before and after each of 3 steps' gradient epilogue; the gathered hook orders "
    "are transient, their bytes are in the collectives column. "
    "bf16, torch Adam, stage3_param_persistence_threshold 0 (every parameter gathered), 1 intra-op thread per rank. "
    "At ZeRO-3 the stock engine gets the MoE blocks as leaf modules (`set_z3_leaf_module`), as safe_zero sets them. "
    "`moe_rank_dependent`: rank r runs only the experts e with e % 2 == r; there stock ZeRO-2 reduces one rank's "
    "experts into the other's (it runs, trains wrong) and is only the timing baseline; its row \"stock touching the "
    "experts each rank skips\" times stock made right by hand instead (each rank adds 0 x the sum of each parameter "
    "of the experts it does not run, the usual workaround: stock then ends bit-identical to safe_zero, "
    "tests/benchmarks), which does the reductions DDP's answer needs, as safe_zero does. Stock ZeRO-3, with the "
    "blocks as leaf modules, is right as it is (its leaf-module hook reduces every expert, zero-filled where the rank "
    "did not run it: it ends bit-identical to safe_zero, tests/benchmarks), so that row's one ratio is against a "
    "right baseline.")


def _timing_note(rows: dict) -> str:
    timed = [r for r in rows.values() if "median_ratio" in r]
    if all("rounds" in r for r in timed):
        return ROUNDS_NOTE
    if not any("rounds" in r for r in timed):
        return PAIRS_NOTE
    return (f"{ROUNDS_NOTE} (rows timed so: their ratio says 'rounds'); the rows that say 'pairs' were timed before "
            f"that: {PAIRS_NOTE[len('Each row: '):]}")


def scaled_lines(results: dict) -> list[str]:
    lines: list[str] = []
    history = results.get("scaled_history", [])
    current = results.get("scaled") or {}
    if current and not (history and history[-1]["rows"] == current):
        lines += ["", "## Scaled models: safe_zero's cost per trainable tensor", "",
                  f"Machine: {results.get('scaled_machine')}. Written by `make bench`. {_timing_note(current)}"
                  f"{SCALED_NOTES}", ""]
        lines += _scaled_tables(current)
    for entry in reversed(history):
        lines += ["", f"## Scaled models, {entry['label']}", "",
                  f"Machine: {entry.get('machine')}. {_timing_note(entry['rows'])}{SCALED_NOTES}", ""]
        lines += _scaled_tables(entry["rows"])
    return lines


if __name__ == "__main__":
    sys.exit(main())
