"""What each GPU check asserts, as plain functions of the legs' records (``tests/gpu/legs.py``).

Each returns the problems it found, ``[]`` where the claim holds, and asserts both halves of it: stock DeepSpeed
still shows the defect (else "stock no longer shows ...: update the claim") and safe_zero trains (finite losses that
fall over 3 steps on one fixed batch, real shapes kept) or, for the DDP check, equals single-process training.
``records`` are per rank (``None``: the rank left none). Being functions of records, ``test_without_gpu.py`` hands
them made-up ones and sees each fail where it should. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any, Optional

STEPS = 3
#: fp32 ZeRO-3 at 2 ranks against single-process AdamW on the global batch (the CPU tests' bound).
DDP_TOLERANCE = 1e-5
#: Above this, stock ZeRO-3 trained the rank-dependent experts wrong (rather than with float noise).
DDP_WRONG = 1e-3
ALIGN_ERROR = "aligned to 16 bytes"
EMPTY_CAT = "torch.cat(): expected a non-empty list"
NOT_AVAILABLE = "'status': 'NOT_AVAILABLE'"
DISAGREEMENT = "Detected a disagreement"
HALF_WEIGHTS = "to have the same dtype"
EXPERT_SHAPE = [4, 16, 16]
EMPTY_SHAPE = [0, 8]

Record = Optional[dict]
#: The DeepSpeed optimizer wrapper each grouped_mm route must reach for its leg to test what it names.
ROUTE_WRAPPERS = {"zero2": "DeepSpeedZeroOptimizer", "bf16_optimizer": "BF16_Optimizer",
                  "fused_stage0": "FP16_Optimizer", "zero3": "DeepSpeedZeroOptimizer_Stage3",
                  "zero3_all_reduce": "DeepSpeedZeroOptimizer_Stage3"}


def trains(record: Record, steps: int = STEPS) -> tuple[bool, str]:
    """``(ok, why)``: no error, ``steps`` finite losses, the last below the first."""
    if record is None:
        return False, "no record"
    if record.get("error"):
        return False, f"{record['error']} (at {record.get('where', '?')})"
    losses = record.get("losses") or []
    if len(losses) != steps:
        return False, f"{len(losses)} of {steps} steps"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        return False, f"non-finite losses {losses}"
    if not losses[-1] < losses[0]:
        return False, f"losses did not fall: {losses}"
    return True, f"losses {[round(v, 5) for v in losses]}"


def _errors(records: list) -> list[str]:
    return [r["error"] for r in records if r and r.get("error")]


def _reached(record: Record, wrapper: str) -> bool:
    return bool(record) and wrapper in (record.get("wrapper_mro") or [])


def _short(text: Optional[str], n: int = 160) -> str:
    text = (text or "").strip().splitlines()[0] if text else ""
    return text if len(text) <= n else text[:n] + "..."


def _stock_miss(defect: str, observed: str) -> str:
    return f"stock no longer shows {defect}: update the claim (stock: {observed})"


# ------------------------------------------------------------------------------------------- grouped_mm


def _offsets(record: Record) -> list[int]:
    if not record:
        return []
    seen = [record.get("init_offset")] + list(record.get("step_offsets") or []) + list(record.get("calls") or [])
    return [o for o in seen if o is not None]


def kernel_checks_alignment(probe: Record) -> tuple[bool, list[str]]:
    """Whether this GPU's grouped_mm refuses a misaligned weight (the premise of every grouped_mm leg: only CUDA's
    bf16 fast path, sm90/sm100, checks it), and the problems with the probe. Where it does not check, only the
    misalignment itself is the stock defect."""
    if probe is None:
        return False, ["the grouped_mm kernel probe left no record"]
    if probe.get("error"):
        return False, [f"grouped_mm kernel probe failed: {probe['error']}"]
    if probe.get("aligned_error"):
        return False, [f"{probe.get('function')} fails on an aligned bf16 weight on this device: "
                       f"{_short(probe['aligned_error'])} (the legs' shapes no longer suit it)"]
    return bool(probe.get("checks_alignment")), []


def _stock_route(route: str, stock: list, checks_alignment: bool, stock_aligned: bool) -> list[str]:
    """Stock on ``route``: a misaligned expert weight that CUDA refuses, or (``stock_aligned``: ZeRO-3's all-gather at
    >= 2 ranks, where safe_zero keeps stock's layout) an aligned one that trains."""
    offsets = sorted({o for r in stock for o in _offsets(r)})
    errors = _errors(stock)
    seen = (f"{route}: data_ptr % 16 of the expert weight {offsets or 'never seen'}; "
            f"{_short(errors[0]) if errors else 'trained without an error'}")
    if stock_aligned:
        if any(offsets) or errors:
            return [f"stock {route} was expected to keep grouped_mm weights aligned (safe_zero keeps its layout there) "
                    f"but did not: {seen}"]
        return []
    problems = []
    wrapper = ROUTE_WRAPPERS[route]
    if stock and not any(_reached(r, wrapper) for r in stock) and not errors:
        problems.append(f"stock {route} built {(stock[0] or {}).get('wrapper_mro', ['?'])[0]}, not {wrapper}: the leg "
                        "does not test the route it names")
    refused = any(ALIGN_ERROR in (text or "") for r in stock for text in ((r or {}).get("error"),
                                                                         (r or {}).get("standalone_error")))
    if not (any(offsets) and (refused or not checks_alignment)):
        problems.append(_stock_miss(f"a misaligned grouped_mm weight on {route}" + (
            " refused by CUDA grouped_mm ('expected data_ptr to be aligned to 16 bytes')" if checks_alignment else ""),
            seen))
    return problems


def _safe_route(route: str, safe: list, facts: dict) -> list[str]:
    """safe_zero on ``route``: every grouped_mm operand aligned, the real shape kept, losses falling; on DeepSpeed
    < 0.19.8 the all-reduce fetch route refused, as documented."""
    why = []
    for rank, record in enumerate(safe):
        if route == "zero3_all_reduce" and facts.get("all_reduce_fetch_refused"):
            if "stage3_use_all_reduce_for_fetch_params" not in ((record or {}).get("error") or ""):
                why.append(f"rank {rank}: expected safe_zero's documented refusal on DeepSpeed "
                           f"{facts.get('deepspeed')}, got {_short((record or {}).get('error')) or 'a run'}")
            continue
        ok, line = trains(record)
        if not ok:
            why.append(f"rank {rank}: did not train: {line}")
            continue
        assert record is not None
        if not _reached(record, ROUTE_WRAPPERS[route]):
            why.append(f"rank {rank}: built {record.get('wrapper_mro', ['?'])[0]}, not {ROUTE_WRAPPERS[route]}")
        off = [o for o in _offsets(record) if o]
        if off or not record.get("calls"):
            why.append(f"rank {rank}: grouped_mm operands off the grid {sorted(set(off))} "
                       f"(calls {record.get('calls')})")
        if record.get("standalone_error"):
            why.append(f"rank {rank}: grouped_mm on the engine's weight: {_short(record['standalone_error'])}")
        if record.get("shape") != EXPERT_SHAPE:
            why.append(f"rank {rank}: expert weight shape {record.get('shape')}, expected {EXPERT_SHAPE}")
    if why or not safe:
        return [f"safe_zero on {route}: " + "; ".join(why or ["no record"])]
    return []


def grouped_mm(legs: dict[str, list], facts: dict, routes: list[str], stock_aligned: tuple = ()) -> list[str]:
    """Per route: stock hands grouped_mm a misaligned expert weight (refused where the kernel checks), or keeps it
    aligned on the ``stock_aligned`` routes; safe_zero's layout trains aligned."""
    checks_alignment, problems = kernel_checks_alignment((legs.get("kernel") or [None])[0])
    for route in routes:
        if route == "bf16_optimizer" and not facts.get("bf16_optimizer_reachable", True):
            continue  # early 0.18.x never builds BF16_Optimizer (BFLOAT16 == DDP_BFLOAT16)
        problems += _stock_route(route, legs.get(f"stock_{route}") or [], checks_alignment, route in stock_aligned)
        problems += _safe_route(route, legs.get(f"safe_{route}") or [], facts)
    return problems


# ------------------------------------------------------------------------------------------- fp16 stage 0


def _stock_fp16(kind: str, wrapper: str, stock: Record, facts: dict) -> list[str]:
    if stock is None:
        return [f"stock {kind}: no record"]
    defect = []
    if stock.get("error"):
        defect.append(f"{_short(stock['error'])} (at {stock.get('where')})")
    if any(s != EMPTY_SHAPE for s in stock.get("shapes") or []):
        defect.append(f"shape {stock.get('shapes')}")
    if stock.get("empty_in_groups"):
        defect.append("the zero-element parameter is in the flat group")
    seen = f"{kind}: " + ("; ".join(defect) if defect else f"trains, shape kept, {trains(stock)[1]}")
    problems = []
    if not stock.get("error") and not _reached(stock, wrapper):
        problems.append(f"stock {kind} built {stock.get('wrapper_mro', ['?'])[0]}, not {wrapper}")
    if not facts.get("zero_element_groups_needed") and (defect or not trains(stock)[0]):
        problems.append(f"stock DeepSpeed {facts.get('deepspeed', '?')} fails fp16 stage 0 ({kind}) with a "
                        f"zero-sized parameter, where the fix table says 0.19.8 fixed it: update the claim "
                        f"(zero_element_groups) ({seen})")
    elif facts.get("zero_element_groups_needed") and kind == "fused" and not defect:
        problems.append(_stock_miss("the zero-element parameter inside the fused FP16_Optimizer's flat group", seen))
    return problems


def fp16_stage0(legs: dict[str, list], facts: dict) -> list[str]:
    """Stock: a defect exactly where the fix table says (``zero_element_groups``: DeepSpeed < 0.19.8) on the fused
    ``FP16_Optimizer``; on 0.19.8 both wrappers train. safe_zero: both train with the shape ``(0, 8)`` kept."""
    problems = []
    for kind, wrapper in (("fused", "FP16_Optimizer"), ("unfused", "FP16_UnfusedOptimizer")):
        problems += _stock_fp16(kind, wrapper, (legs.get(f"stock_{kind}") or [None])[0], facts)
        safe = (legs.get(f"safe_{kind}") or [None])[0]
        ok, why = trains(safe)
        if not ok and safe and safe.get("skipped_steps"):
            why += f" ({safe['skipped_steps']} step(s) skipped by the fp16 loss scaler, scale {safe.get('loss_scale')})"
        if ok and not _reached(safe, wrapper):
            ok, why = False, f"built {(safe or {}).get('wrapper_mro', ['?'])[0]}, not {wrapper}"
        if ok and any(s != EMPTY_SHAPE for s in (safe or {}).get("shapes") or [None]):
            ok, why = False, f"shape {(safe or {}).get('shapes')}, expected {EMPTY_SHAPE} throughout"
        if not ok:
            problems.append(f"safe_zero fp16 stage 0 ({kind}) did not train: {why}")
    return problems


# ------------------------------------------------------------------------------------------- quantizer


def _quantized(records: list) -> int:
    return min((r.get("quantize_calls") or {}).get("sized", 0) for r in records if r) if any(records) else 0


def _stock_quant(model: str, stock: list, expected_errors: tuple) -> list[str]:
    """Stock stops on every rank with one of ``expected_errors`` (a ZeroDivisionError from the quantizer itself, on
    an empty partition)."""
    errors = _errors(stock)
    hit = [e for e in errors if any(x in e for x in expected_errors)]
    shown = bool(hit) and len(errors) == len([r for r in stock if r])
    if shown and "ZeroDivisionError" in hit[0]:
        shown = all((r.get("quantize_calls") or {}).get("empty", 0) > 0 for r in stock if r)
    if shown:
        return []
    seen = f"{model}: " + (_short(errors[0]) if errors else "trained without an error")
    return [_stock_miss(f"{' / '.join(expected_errors)} on {model} on every rank", seen)]


def _safe_quant(model: str, safe: list, facts: dict) -> list[str]:
    world_size = max((r.get("world_size", 1) for r in safe if r), default=1)
    if model == "weights" and world_size > 1 and not facts.get("quantized_gather_keeps_dtype", True):
        # DeepSpeed < 0.19.8 hands bf16 models fp16 weights from a quantized gather at >= 2 ranks (any model):
        # safe_zero gets past the zero-element parameter and stops there too.
        if all(r and HALF_WEIGHTS in (r.get("error") or "") for r in safe):
            return []
        return [f"safe_zero {model}: expected '{HALF_WEIGHTS}' on this DeepSpeed, got "
                f"{[_short((r or {}).get('error')) for r in safe]}"]
    why = []
    for rank, record in enumerate(safe):
        trained, line = trains(record)
        if not trained:
            why.append(f"rank {rank}: {line}")
            continue
        empties = {n: s for n, s in ((record or {}).get("shapes") or {}).items() if s and s[0] == 0}
        if not empties or any(s != [0, 8] and s != [0, 16] for s in empties.values()):
            why.append(f"rank {rank}: zero-element shapes {empties}")
    if model == "weights" and safe and not why and _quantized(safe) == 0:
        why.append("DeepSpeed's quantizer never ran on a sized partition: no gather was quantized, the leg did not "
                   "test the quantizer")
    if len({tuple(r.get("losses") or []) for r in safe if r}) > 1:
        why.append(f"ranks disagree on the losses {[r.get('losses') for r in safe if r]}")
    return [f"safe_zero {model}: " + "; ".join(why or ["no record"])] if why or not safe else []


def quantizer_kernel(kernel: Record) -> list[str]:
    """DeepSpeed's CUDA quantizer divides by zero on an empty partition; safe_zero's guard returns an empty int8
    tensor and no scales, and equals stock on a sized tensor."""
    k = kernel or {}
    problems = []
    stock_error = k.get("stock_empty_error") or ""
    if "ZeroDivisionError" not in stock_error:
        problems.append(_stock_miss("ZeroDivisionError from CUDAQuantizer.quantize on an empty partition",
                                    f"kernel: {_short(stock_error) or 'quantize(empty) returned'}"))
    empty, back = k.get("safe_empty") or {}, k.get("safe_empty_back") or {}
    if not (k.get("error") is None and empty.get("dtype") == "torch.int8" and empty.get("numel") == 0
            and empty.get("scales") == 0 and back.get("numel") == 0 and k.get("sized_equal") is True):
        problems.append(f"safe_zero's quantizer guard: {k.get('error') or k}")
    return problems


def quantizer(legs: dict[str, list], facts: dict, models: dict[str, tuple]) -> list[str]:
    """Per model (``nontrainable``: a frozen zero-element layer; ``weights``: quantized gathers with a zero-element
    parameter in a mixed bucket), stock stops with one of its expected errors and safe_zero trains."""
    problems = quantizer_kernel(legs["kernel"][0]) if "kernel" in legs else []
    for model, errors in models.items():
        problems += _stock_quant(model, legs.get(f"stock_{model}") or [], errors)
        problems += _safe_quant(model, legs.get(f"safe_{model}") or [], facts)
    return problems


# ------------------------------------------------------------------------------------------- DDP-exact


def _stock_ddp(mixed: list, moe: list, moe_error: str | None, facts: dict) -> list[str]:
    problems = []
    errors = _errors(mixed)
    if not (errors and len(errors) == len([r for r in mixed if r])
            and all(EMPTY_CAT in e or NOT_AVAILABLE in e for e in errors)):
        problems.append(_stock_miss("torch.cat([]) / NOT_AVAILABLE on a zero-element parameter in a mixed bucket on "
                                    "every rank", "mixed_moe: " + (_short(errors[0]) if errors else "trained")))
    errors = _errors(moe) + ([moe_error] if moe_error else [])
    finished = [r for r in moe if r and not r.get("error")]
    if any(DISAGREEMENT in e for e in errors):
        return problems  # a rank stopped, the other was left waiting in a collective
    if finished and len(finished) == facts.get("world_size", 2):
        worst = max(r.get("max_error", 0.0) for r in finished)
        if worst <= DDP_WRONG:
            problems.append(_stock_miss("rank-dependent experts stopping or training wrong at ZeRO-3",
                                        f"moe: trained, max |param - reference| = {worst:.3g}"))
        return problems
    problems.append(_stock_miss("'Detected a disagreement' on rank-dependent experts",
                                f"moe: {_short(errors[0]) if errors else 'left no record'}"))
    return problems


def ddp_exact(legs: dict[str, list], facts: dict, moe_error: str | None = None) -> list[str]:
    """Stock: the zero-element defects in a mixed bucket (``torch.cat([])`` / ``NOT_AVAILABLE``), and rank-dependent
    experts stopping (``Detected a disagreement``; ``moe_error``: the job's error where a rank was left in a
    collective) or training wrong. safe_zero: every rank within 1e-5 of single-process fp32 AdamW on the global
    batch, shapes kept, the global loss falling."""
    problems = _stock_ddp(legs.get("stock_mixed_moe") or [], legs.get("stock_moe") or [], moe_error, facts)
    safe = legs.get("safe_mixed_moe") or []
    why = []
    for rank, record in enumerate(safe):
        if record is None or record.get("error"):
            why.append(f"rank {rank}: {_short((record or {}).get('error')) or 'no record'}")
            continue
        losses = record.get("losses") or []
        if len(losses) != STEPS or not all(math.isfinite(v) for v in losses):
            why.append(f"rank {rank}: losses {losses}")
        if record.get("shapes") != record.get("expected_shapes"):
            why.append(f"rank {rank}: shapes {record.get('shapes')} != {record.get('expected_shapes')}")
        if not record.get("max_error", math.inf) < DDP_TOLERANCE:
            why.append(f"rank {rank}: max |param - reference| = {record.get('max_error')} (bound {DDP_TOLERANCE})")
    if len(safe) < facts.get("world_size", 2):
        why.append(f"records from {len(safe)} rank(s) only")
    if not why:  # the global loss (mean of the ranks' losses on their fixed batches) falls
        mean = [sum(r["losses"][i] for r in safe) / len(safe) for i in range(STEPS)]
        if not mean[-1] < mean[0]:
            why.append(f"global loss did not fall: {mean}")
    if why:
        problems.append("safe_zero is not DDP-exact at 2 NCCL ranks: " + "; ".join(why))
    return problems


def summary(records: list) -> list[Any]:
    """What the JSON report keeps of a leg's records: errors cut to their first line, no tracebacks."""
    keep = ("error", "where", "losses", "init_offset", "calls", "shape", "shapes", "max_error", "quantize_calls",
            "stock_empty_error", "sized_equal", "checks_alignment", "misaligned_error")
    return [None if r is None else {k: _short(v, 300) if isinstance(v, str) else v for k, v in r.items() if k in keep}
            for r in records]
