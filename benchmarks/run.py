"""``make bench``: what safe_zero costs against stock DeepSpeed, measured in the same run.

Writes ``benchmarks/RESULTS.md`` (a Markdown table) and ``benchmarks/results.json``. Targets:
step-time ratio safe/stock <= 1.01 (median of per-step-pair ratios: a stock and a safe_zero engine
in the same 2 CPU ranks, stepping alternately, each built first in one of two runs; the same harness
with two stock engines gives the noise floor, and cProfile the share of the step in safe_zero's code); all-gathers per step with K all-zero-sized submodules equal to K = 0; alignment
padding <= 15 bytes per parameter; ``import safe_zero`` after ``import deepspeed`` <= 50 ms.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

from benchmarks import bodies  # noqa: E402
from safe_zero.ranks import DistPool  # noqa: E402

PAIRS = 100


#: safe_zero with the rank agreement off: every rank promises to use every parameter (DDP's default contract).
NO_AGREEMENT = {"find_unused_parameters": False}


def _median_ratio(pool: DistPool, stage: int, safe: tuple) -> tuple[float, list[float], list[float]]:
    """Median of b/a over per-step pairs, from two runs (a built first, b built first)."""
    ratios, a_s, b_s = [], [], []
    for b_built_first in (False, True):
        per_rank = pool.run(bodies.paired_step_seconds, stage=stage, pairs=PAIRS, safe=safe,
                            b_built_first=b_built_first)
        # A step is as slow as its slowest rank: combine the ranks per step, then compare within each pair.
        a = [max(rank[i][0] for rank in per_rank) for i in range(PAIRS)]
        b = [max(rank[i][1] for rank in per_rank) for i in range(PAIRS)]
        ratios += [y / x for x, y in zip(a, b)]
        a_s += a
        b_s += b
    return statistics.median(ratios), a_s, b_s


def step_time_ratio(pool: DistPool, stage: int) -> dict:
    ratio, stock_s, safe_s = _median_ratio(pool, stage, (False, True))
    noise, _, _ = _median_ratio(pool, stage, (False, False))
    no_agreement, _, _ = _median_ratio(pool, stage, (False, NO_AGREEMENT))
    share = max(pool.run(bodies.safe_zero_share, stage=stage), key=lambda r: r["share"])
    return {"median_ratio": ratio, "no_agreement_ratio": no_agreement, "stock_ms": 1e3 * statistics.median(stock_s),
            "safe_ms": 1e3 * statistics.median(safe_s), "pairs": 2 * PAIRS, "stock_vs_stock_ratio": noise,
            "safe_zero_profiled_share": share["share"], "safe_zero_calls_per_step": share["calls_per_step"]}


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


def main() -> int:
    started = time.time()
    pool = DistPool(2)
    try:
        results = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU/gloo, 2 ranks, "
                       f"load average {os.getloadavg()[0]:.1f} at start",
            "step_time": {f"zero{stage}": step_time_ratio(pool, stage) for stage in (2, 3)},
            "all_gathers_per_step": {f"k{k}": max(max(r) for r in [pool.run(bodies.all_gathers_per_step, k=k)])
                                     for k in (0, 4)},
            # Per step, steps 1-3: the first ZeRO-3 step is the one DeepSpeed records its trace in.
            "collectives_per_step": {f"zero{stage}": {which: pool.run(bodies.collectives_per_step, stage=stage,
                                                                      safe=which == "safe_zero")[0]
                                                      for which in ("stock", "safe_zero")}
                                     for stage in (2, 3)},
        }
    finally:
        pool.close()
    results["import_safe_zero_ms"] = import_ms()
    results["alignment_padding"] = alignment_overhead()
    results["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(ROOT, "benchmarks", "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = ["# safe_zero benchmark results", "", f"Machine: {results['machine']}. Written by `make bench`.", "",
             "| measure | stock | safe_zero | ratio / value | target |", "|---|---|---|---|---|"]
    for stage, r in results["step_time"].items():
        lines.append(f"| step time, {stage}, control model | {r['stock_ms']:.2f} ms | {r['safe_ms']:.2f} ms | "
                     f"{r['median_ratio']:.3f} (median of {r['pairs']} step pairs; stock vs stock in the same "
                     f"harness: {r['stock_vs_stock_ratio']:.3f}) | <= 1.01 |")
        lines.append(f"| step time, {stage}, control model, `\"find_unused_parameters\": false` (no rank agreement) | | "
                     f"| {r['no_agreement_ratio']:.3f} | <= 1.01 |")
        lines.append(f"| safe_zero's own functions in a {stage} step, under cProfile | | "
                     f"{r['safe_zero_calls_per_step']:.0f} calls | {100 * r['safe_zero_profiled_share']:.2f} % of the "
                     f"profiled step (upper bound) | |")
    ag = results["all_gathers_per_step"]
    lines.append(f"| all-gathers per ZeRO-3 step (steps 1-3), K=4 all-zero-sized submodules vs K=0 | {ag['k0']} (K=0) | "
                 f"{ag['k4']} (K=4) | {'equal' if ag['k0'] == ag['k4'] else 'DIFFERENT'} | equal |")
    def listed(c: dict) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items()) if k != "all_reduce_bytes")

    why = {"zero2": "(first step only: gradless_params' agreement, 1 byte per trainable parameter, and the broadcast "
                    "of rank 0's reduction order, 8 B per trainable parameter)",
           "zero3": "(first step only: gradless_params' agreement, 1 byte per trainable parameter, the broadcast of "
                    "rank 0's reduction order with each hook's module clock, 16 B per trainable parameter, and one "
                    "all_gather of 8 B per rank per module with parameters, the ranks agreeing on the module order)"}
    for stage, per_step in results["collectives_per_step"].items():
        for label, step in (("first", 0), ("later", -1)):
            counts = {which: steps[step] for which, steps in per_step.items()}
            extra = counts["safe_zero"].get("all_reduce_bytes", 0) - counts["stock"].get("all_reduce_bytes", 0)
            lines.append(f"| collectives in the {label} {stage} step, control model (every rank uses every parameter) "
                         f"| {listed(counts['stock'])} | {listed(counts['safe_zero'])} | +{extra} B all-reduced "
                         f"{why[stage]} | {'none' if label == 'later' else 'one small all-reduce, one broadcast'} |")
    lines.append(f"| `import safe_zero` after `import deepspeed` | | | {results['import_safe_zero_ms']:.1f} ms | <= 50 ms |")
    for row in results["alignment_padding"] or []:
        lines.append(f"| alignment padding, {row['layout']} | | | {row['bytes']} B "
                     f"({row['percent']:.4f} % of the flat buffer, max {row['max_per_param']} B per parameter) "
                     f"| <= 15 B per parameter |")
        lines.append(f"| grouped_mm weights off the 16-byte grid, {row['layout']} | "
                     f"{row['misaligned_stock']} of {row['grouped_mm_weights']} (unpadded flat order) | "
                     f"{row['misaligned_safe_zero_order']} of {row['grouped_mm_weights']} (safe_zero order, 0 B padding) "
                     f"| | 0 |")
        z3 = row["zero3_ws3"]
        lines.append(f"| ZeRO-3 at 3 ranks, {row['layout']}: padding safe_zero adds | | "
                     f"{z3['partition pad']} B in partitions, {z3['all-reduce slot pad']} B in the all-reduce fetch "
                     f"buffer | max {z3['all-reduce slot pad max per param']} B per parameter "
                     f"({z3['grouped_mm partitions off whole 16-byte units']} grouped_mm partitions not whole 16-byte "
                     "units) | <= 15 B per parameter |")
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
