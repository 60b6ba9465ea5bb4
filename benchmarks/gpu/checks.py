"""The GPU-only claims, each with the legs that test it and the judge that reads their records.

Every check asserts both halves of its claim: that stock DeepSpeed still shows the defect (otherwise the
check fails with "stock no longer shows ...: update the claim") and that safe_zero trains (finite losses
that fall over 3 steps on one fixed batch, real shapes kept), or, for the DDP check, that it equals
single-process training. A leg's record comes from :mod:`benchmarks.gpu.bodies` (one per rank); the
judges here are plain functions of those records, so the unit tests can hand them made-up records and
see each one fail where it should. Nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

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

Record = Optional[dict]  # one rank's record of one leg; None: the rank left none (killed, hung, never ran)
Legs = dict  # leg name -> [record per rank]


@dataclass(frozen=True)
class Leg:
    """One engine (or kernel probe) run on every rank of the check's launch: ``bodies.<body>(**kwargs)``."""

    name: str
    body: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class Verdict:
    status: str  # "pass", "fail", "skip" or "error"
    stock_expected: str = ""
    stock_observed: str = ""
    stock_as_expected: Optional[bool] = None
    safe_zero: str = ""
    safe_zero_ok: Optional[bool] = None
    reasons: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(status=self.status, stock_expected=self.stock_expected, stock_observed=self.stock_observed,
                    stock_as_expected=self.stock_as_expected, safe_zero=self.safe_zero,
                    safe_zero_ok=self.safe_zero_ok, reasons=list(self.reasons), notes=list(self.notes))


@dataclass(frozen=True)
class Check:
    name: str
    world_size: int
    proves: str
    fails_how: str
    legs: tuple
    judge: Callable[[Legs, dict], Verdict]
    needs: tuple = ()  # DeepSpeed JIT ops the legs load ("fused_adam", "quantizer")
    timeout_s: int = 150


# ------------------------------------------------------------------------------------------- helpers


def _records(legs: Legs, name: str) -> list:
    return list(legs.get(name) or [])


def _missing(legs: Legs, names: list, world_size: int) -> list:
    """``"leg (ranks ...)"`` for every leg some rank left no record of."""
    out = []
    for name in names:
        records = _records(legs, name)
        ranks = [r for r in range(world_size) if r >= len(records) or records[r] is None]
        if ranks:
            out.append(f"{name} (rank {', '.join(map(str, ranks))})")
    return out


def _errors(records: list) -> list:
    return [r["error"] for r in records if r and r.get("error")]


def trains(record: Record, steps: int = STEPS) -> tuple:
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


def _reached(record: Record, wrapper: str) -> bool:
    return bool(record) and wrapper in (record.get("wrapper_mro") or [])


def _short(text: Optional[str], n: int = 160) -> str:
    text = (text or "").strip().splitlines()[0] if text else ""
    return text if len(text) <= n else text[:n] + "..."


def _sides(verdict: Verdict, expected: list[str], stock_lines: list[str], shown: bool, safe_lines: list[str],
           ok: bool) -> Verdict:
    """Both halves of a check with several legs, each leg's line joined."""
    verdict.stock_expected = "; ".join(expected)
    verdict.stock_observed = " | ".join(stock_lines)
    verdict.stock_as_expected = shown
    verdict.safe_zero = " | ".join(safe_lines)
    verdict.safe_zero_ok = ok
    return verdict


def _finish(verdict: Verdict) -> Verdict:
    if verdict.status not in ("skip", "error"):
        verdict.status = "fail" if verdict.reasons else "pass"
    return verdict


def _stock_miss(defect: str, observed: str) -> str:
    return f"stock no longer shows {defect}: update the claim (stock: {observed})"


# ------------------------------------------------------------------------------------------- grouped_mm


ROUTE_WRAPPERS = {"zero2": "DeepSpeedZeroOptimizer", "bf16_optimizer": "BF16_Optimizer", "fused_stage0": "FP16_Optimizer",
                  "zero3": "DeepSpeedZeroOptimizer_Stage3", "zero3_all_reduce": "DeepSpeedZeroOptimizer_Stage3"}


def _offsets(record: Record) -> list:
    if not record:
        return []
    seen = [record.get("init_offset")] + list(record.get("step_offsets") or []) + list(record.get("calls") or [])
    return [o for o in seen if o is not None]


def _kernel_error(record: Record) -> Optional[str]:
    for text in (record or {}).get("error"), (record or {}).get("standalone_error"):
        if text and ALIGN_ERROR in text:
            return text
    return None


def judge_kernel(probe: Record) -> tuple:
    """``(checks_alignment, reasons, notes)`` from the grouped_mm kernel probe: the premise of every grouped_mm leg."""
    if probe is None:
        return False, ["the grouped_mm kernel probe left no record"], []
    if probe.get("error"):
        return False, [f"grouped_mm kernel probe failed: {probe['error']}"], []
    if probe.get("aligned_error"):
        return False, [f"{probe.get('function')} fails on an aligned bf16 weight on this device: "
                       f"{_short(probe['aligned_error'])} (the legs' shapes no longer suit it)"], []
    if probe.get("checks_alignment"):
        return True, [], []
    return False, [], [f"{probe.get('function')} on {probe.get('device')} (capability {probe.get('capability')}) took a "
                       "weight 6 bytes off the 16-byte grid: this GPU has no bf16 fast path (sm90/sm100), so only the "
                       "misalignment itself is the stock defect here, not the kernel's refusal"]


def judge_grouped_mm_route(route: str, stock: list, safe: list, checks_alignment: bool, facts: dict,
                           stock_aligned: bool = False) -> tuple:
    """``(stock line, stock shown, safe line, safe ok, reasons, notes)`` for one route (records of every rank).

    ``stock_aligned``: the claim is that stock already keeps the weight aligned on this route (ZeRO-3's
    all-gather at >= 2 ranks), so safe_zero may keep stock's layout: stock must train aligned.
    """
    reasons: list = []
    notes: list = []
    wrapper = ROUTE_WRAPPERS[route]
    stock_offsets = sorted({o for r in stock for o in _offsets(r)})
    stock_errors = _errors(stock)
    stock_kernel = next((e for e in (_kernel_error(r) for r in stock) if e), None)
    stock_line = (f"{route}: data_ptr % 16 of the expert weight {stock_offsets or 'never seen'}; "
                  f"{_short(stock_errors[0]) if stock_errors else 'trained without an error'}")
    misaligned = any(stock_offsets)
    if stock_aligned:
        shown = not misaligned and not stock_errors
        if misaligned or stock_errors:
            reasons.append(f"stock {route} was expected to keep grouped_mm weights aligned (safe_zero keeps its layout "
                           f"there) but did not: {stock_line}")
    else:
        if stock and not any(_reached(r, wrapper) for r in stock) and not stock_errors:
            reasons.append(f"stock {route} built {stock[0].get('wrapper_mro', ['?'])[0] if stock[0] else '?'}, not "
                           f"{wrapper}: the leg does not test the route it names")
        shown = misaligned and (stock_kernel is not None or not checks_alignment)
        if not shown:
            defect = (f"a misaligned grouped_mm weight on {route}" + (" refused by CUDA grouped_mm ('expected data_ptr "
                      "to be aligned to 16 bytes')" if checks_alignment else ""))
            reasons.append(_stock_miss(defect, stock_line))
        elif not checks_alignment:
            notes.append(f"{route}: stock misaligned, and this device's grouped_mm does not check it")

    refused = route == "zero3_all_reduce" and facts.get("all_reduce_fetch_refused")
    safe_ok = True
    why = []
    for rank, record in enumerate(safe):
        if refused:  # DeepSpeed < 0.19.8: safe_zero refuses this route for grouped_mm weights, as documented
            if not (record and "stage3_use_all_reduce_for_fetch_params" in (record.get("error") or "")):
                safe_ok = False
                why.append(f"rank {rank}: expected safe_zero's documented refusal on DeepSpeed "
                           f"{facts.get('deepspeed')}, got {_short((record or {}).get('error')) or 'a run'}")
            continue
        ok, line = trains(record)
        if not ok:
            safe_ok = False
            why.append(f"rank {rank}: did not train: {line}")
            continue
        if not _reached(record, wrapper):
            safe_ok = False
            why.append(f"rank {rank}: built {record.get('wrapper_mro', ['?'])[0]}, not {wrapper}")
        off = [o for o in _offsets(record) if o]
        if off or not record.get("calls"):
            safe_ok = False
            why.append(f"rank {rank}: grouped_mm operands off the grid {sorted(set(off))} (calls {record.get('calls')})")
        if record.get("standalone_error"):
            safe_ok = False
            why.append(f"rank {rank}: grouped_mm on the engine's weight: {_short(record['standalone_error'])}")
        if record.get("shape") != EXPERT_SHAPE:
            safe_ok = False
            why.append(f"rank {rank}: expert weight shape {record.get('shape')}, expected {EXPERT_SHAPE}")
    if refused:
        safe_line = f"{route}: refused at initialize on DeepSpeed {facts.get('deepspeed')} (documented)"
    elif safe_ok and safe:
        safe_line = f"{route}: every operand aligned, {trains(safe[0])[1]}"
    else:
        safe_line = f"{route}: " + "; ".join(why or ["no record"])
    if not safe_ok or not safe:
        reasons.append(f"safe_zero on {route}: " + "; ".join(why or ["no record"]))
    return stock_line, shown, safe_line, safe_ok and bool(safe), reasons, notes


def _judge_grouped_mm(routes: list, stock_aligned_routes: tuple = ()) -> Callable[[Legs, dict], Verdict]:
    def judge(legs: Legs, facts: dict) -> Verdict:
        verdict = Verdict(status="pass")
        probe = (_records(legs, "kernel") or [None])[0]
        checks_alignment, reasons, notes = judge_kernel(probe)
        verdict.reasons += reasons
        verdict.notes += notes
        expected, stock_lines, safe_lines, shown_all, safe_all = [], [], [], True, True
        for route in routes:
            if route == "bf16_optimizer" and not facts.get("bf16_optimizer_reachable", True):
                verdict.notes.append("bf16_optimizer: this DeepSpeed never builds BF16_Optimizer (BFLOAT16 == "
                                     "DDP_BFLOAT16): route not checked")
                continue
            aligned = route in stock_aligned_routes
            expected.append(f"{route}: " + ("aligned (stock keeps its layout)" if aligned else
                                            "misaligned expert weight" + (", CUDA grouped_mm refuses it"
                                                                          if checks_alignment else "")))
            s_line, shown, z_line, ok, reasons, notes = judge_grouped_mm_route(
                route, _records(legs, f"stock_{route}"), _records(legs, f"safe_{route}"), checks_alignment, facts,
                stock_aligned=aligned)
            stock_lines.append(s_line)
            safe_lines.append(z_line)
            shown_all &= shown
            safe_all &= ok
            verdict.reasons += reasons
            verdict.notes += notes
        return _finish(_sides(verdict, expected, stock_lines, shown_all, safe_lines, safe_all))

    return judge


def _grouped_mm_legs(routes: list) -> tuple:
    legs = [Leg("kernel", "grouped_mm_kernel_probe")]
    for route in routes:
        legs += [Leg(f"stock_{route}", "grouped_mm_leg", {"route": route, "safe": False}),
                 Leg(f"safe_{route}", "grouped_mm_leg", {"route": route, "safe": True})]
    return tuple(legs)


# ------------------------------------------------------------------------------------------- fp16 stage 0


def judge_fp16_stage0(legs: Legs, facts: dict) -> Verdict:
    """Stock: a defect exactly where the fix table says (``zero_element_groups``: DeepSpeed < 0.19.8) on the fused
    ``FP16_Optimizer``; on 0.19.8 both wrappers train. safe_zero: both train with the shape ``(0, 8)`` kept."""
    verdict = Verdict(status="pass")
    needed = bool(facts.get("zero_element_groups_needed"))
    version = facts.get("deepspeed", "?")
    verdict.stock_expected = (f"DeepSpeed {version}: " + ("the fused FP16_Optimizer takes the zero-element parameter "
                              "into its flat group (shape lost or a crash where torch drops it)" if needed else
                              "trains (0.19.8 leaves zero-element parameters out of every optimizer group)"))
    stock_lines, safe_lines, as_expected, safe_all = [], [], True, True
    for kind, wrapper in (("fused", "FP16_Optimizer"), ("unfused", "FP16_UnfusedOptimizer")):
        stock = (_records(legs, f"stock_{kind}") or [None])[0]
        safe = (_records(legs, f"safe_{kind}") or [None])[0]
        if stock is None:
            verdict.reasons.append(f"stock {kind}: no record")
            as_expected = False
        else:
            defect = []
            if stock.get("error"):
                defect.append(f"{_short(stock['error'])} (at {stock.get('where')})")
            if any(s != EMPTY_SHAPE for s in stock.get("shapes") or []):
                defect.append(f"shape {stock.get('shapes')}")
            if stock.get("empty_in_groups"):
                defect.append("the zero-element parameter is in the flat group")
            line = f"{kind}: " + ("; ".join(defect) if defect else f"trains, shape kept, {trains(stock)[1]}")
            stock_lines.append(line)
            if not stock.get("error") and not _reached(stock, wrapper):
                verdict.reasons.append(f"stock {kind} built {stock.get('wrapper_mro', ['?'])[0]}, not {wrapper}")
            if not needed and (defect or not trains(stock)[0]):
                as_expected = False
                verdict.reasons.append(f"stock DeepSpeed {version} fails fp16 stage 0 ({kind}) with a zero-sized "
                                       f"parameter, where the fix table says 0.19.8 fixed it: update the claim "
                                       f"(zero_element_groups) ({line})")
            elif needed and kind == "fused" and not defect:
                as_expected = False
                verdict.reasons.append(_stock_miss("the zero-element parameter inside the fused FP16_Optimizer's flat "
                                                   "group", line))
        ok, why = trains(safe)
        if not ok and safe and safe.get("skipped_steps"):
            why += f" ({safe['skipped_steps']} step(s) skipped by the fp16 loss scaler, scale {safe.get('loss_scale')})"
        if ok and not _reached(safe, wrapper):
            ok, why = False, f"built {safe.get('wrapper_mro', ['?'])[0]}, not {wrapper}"
        if ok and any(s != EMPTY_SHAPE for s in safe.get("shapes") or [None]):
            ok, why = False, f"shape {safe.get('shapes')}, expected {EMPTY_SHAPE} throughout"
        safe_lines.append(f"{kind}: " + (f"trains, shape (0, 8) kept, {why}" if ok else why))
        if not ok:
            safe_all = False
            verdict.reasons.append(f"safe_zero fp16 stage 0 ({kind}) did not train: {why}")
    verdict.stock_observed = " | ".join(stock_lines)
    verdict.stock_as_expected = as_expected
    verdict.safe_zero = " | ".join(safe_lines)
    verdict.safe_zero_ok = safe_all
    return _finish(verdict)


# ------------------------------------------------------------------------------------------- quantizer


def _quantized(records: list) -> int:
    return min((r.get("quantize_calls") or {}).get("sized", 0) for r in records if r) if any(records) else 0


def _judge_quant_leg(model: str, stock: list, safe: list, facts: dict, expected_errors: tuple) -> tuple:
    """``(stock line, shown, safe line, ok, reasons, notes)`` for one quantizer model, records of every rank."""
    reasons, notes = [], []
    errors = _errors(stock)
    stock_line = f"{model}: " + (_short(errors[0]) if errors else "trained without an error")
    hit = [e for e in errors if any(x in e for x in expected_errors)]
    shown = bool(hit) and len(errors) == len([r for r in stock if r])
    if shown and "ZeroDivisionError" in hit[0]:  # from DeepSpeed's quantizer itself, on the empty partition
        shown = all((r.get("quantize_calls") or {}).get("empty", 0) > 0 for r in stock if r)
    if not shown:
        reasons.append(_stock_miss(f"{' / '.join(expected_errors)} on {model} on every rank", stock_line))
    keeps_dtype = facts.get("quantized_gather_keeps_dtype", True)
    world_size = max((r.get("world_size", 1) for r in safe if r), default=1)
    if model == "weights" and world_size > 1 and not keeps_dtype:
        ok = all(r and HALF_WEIGHTS in (r.get("error") or "") for r in safe)
        notes.append(f"DeepSpeed {facts.get('deepspeed')} hands bf16 models fp16 weights from a quantized gather at "
                     ">= 2 ranks (any model): safe_zero gets past the zero-element parameter and stops there too")
        safe_line = f"{model}: " + ("stops at DeepSpeed's own fp16 gather, as expected" if ok else "unexpected outcome")
        if not ok:
            reasons.append(f"safe_zero {model}: expected '{HALF_WEIGHTS}' on this DeepSpeed, got "
                           f"{[_short((r or {}).get('error')) for r in safe]}")
        return stock_line, shown, safe_line, ok, reasons, notes
    ok, why = True, []
    for rank, record in enumerate(safe):
        trained, line = trains(record)
        if not trained:
            ok = False
            why.append(f"rank {rank}: {line}")
            continue
        empties = {n: s for n, s in (record.get("shapes") or {}).items() if s and s[0] == 0}
        if not empties or any(s != [0, 8] and s != [0, 16] for s in empties.values()):
            ok = False
            why.append(f"rank {rank}: zero-element shapes {empties}")
    if model == "weights" and safe and ok and _quantized(safe) == 0:
        ok = False
        why.append("DeepSpeed's quantizer never ran on a sized partition: no gather was quantized, the leg did not "
                   "test the quantizer")
    if len({tuple(r.get("losses") or []) for r in safe if r}) > 1:
        ok = False
        why.append(f"ranks disagree on the losses {[r.get('losses') for r in safe if r]}")
    quantized = f", {_quantized(safe)} quantize calls on sized partitions per rank" if model == "weights" else ""
    safe_line = f"{model}: " + (f"trains, {trains(safe[0])[1]}{quantized}" if ok and safe else
                                "; ".join(why or ["no record"]))
    if not ok or not safe:
        reasons.append(f"safe_zero {model}: " + "; ".join(why or ["no record"]))
    return stock_line, shown, safe_line, ok and bool(safe), reasons, notes


def _judge_quantizer(models: dict, kernel: bool) -> Callable[[Legs, dict], Verdict]:
    def judge(legs: Legs, facts: dict) -> Verdict:
        verdict = Verdict(status="pass")
        stock_lines, safe_lines, expected, shown_all, safe_all = [], [], [], True, True
        if kernel:
            k = (_records(legs, "kernel") or [None])[0] or {}
            expected.append("kernel: CUDAQuantizer.quantize(empty) raises ZeroDivisionError")
            stock_err = k.get("stock_empty_error") or ""
            stock_lines.append(f"kernel: {_short(stock_err) or 'quantize(empty) returned'}")
            if "ZeroDivisionError" not in stock_err:
                shown_all = False
                verdict.reasons.append(_stock_miss("ZeroDivisionError from CUDAQuantizer.quantize on an empty partition",
                                                   stock_lines[-1]))
            empty = k.get("safe_empty") or {}
            back = k.get("safe_empty_back") or {}
            k_ok = (k.get("error") is None and empty.get("dtype") == "torch.int8" and empty.get("numel") == 0
                    and empty.get("scales") == 0 and back.get("numel") == 0 and k.get("sized_equal") is True)
            safe_lines.append("kernel: " + ("empty in, empty int8 and no scales out; equal to stock on a sized tensor"
                                            if k_ok else f"unexpected {k}"))
            if not k_ok:
                safe_all = False
                verdict.reasons.append(f"safe_zero's quantizer guard: {k.get('error') or k}")
        for model, errors in models.items():
            expected.append(f"{model}: {' / '.join(errors)}")
            s_line, shown, z_line, ok, reasons, notes = _judge_quant_leg(
                model, _records(legs, f"stock_{model}"), _records(legs, f"safe_{model}"), facts, errors)
            stock_lines.append(s_line)
            safe_lines.append(z_line)
            shown_all &= shown
            safe_all &= ok
            verdict.reasons += reasons
            verdict.notes += notes
        return _finish(_sides(verdict, expected, stock_lines, shown_all, safe_lines, safe_all))

    return judge


# ------------------------------------------------------------------------------------------- DDP-exact


def judge_ddp_exact(legs: Legs, facts: dict) -> Verdict:
    """Stock: the zero-element defects in a mixed bucket (``torch.cat([])`` / ``NOT_AVAILABLE``), and rank-dependent
    experts stopping (``Detected a disagreement``, the other rank left in a collective) or training wrong.
    safe_zero: every rank's parameters within 1e-5 of single-process fp32 AdamW on the global batch."""
    verdict = Verdict(status="pass")
    verdict.stock_expected = ("mixed_moe: torch.cat([]) or NOT_AVAILABLE on every rank; moe: 'Detected a disagreement' "
                              "(a rank stops, the other waits in a collective) or parameters off the reference by > 1e-3")
    stock_lines, as_expected = [], True

    mixed = _records(legs, "stock_mixed_moe")
    errors = _errors(mixed)
    stock_lines.append("mixed_moe: " + (_short(errors[0]) if errors else "trained without an error"))
    if not (len(errors) == len([r for r in mixed if r]) and errors
            and all(EMPTY_CAT in e or NOT_AVAILABLE in e for e in errors)):
        as_expected = False
        verdict.reasons.append(_stock_miss("torch.cat([]) / NOT_AVAILABLE on a zero-element parameter in a mixed "
                                           "bucket on every rank", stock_lines[-1]))

    moe = _records(legs, "stock_moe")
    errors = _errors(moe)
    finished = [r for r in moe if r and not r.get("error")]
    if any(DISAGREEMENT in e for e in errors):
        left = sum(1 for r in moe if r is None) + max(0, facts.get("world_size", 2) - len(moe))
        stock_lines.append(f"moe: {_short(next(e for e in errors if DISAGREEMENT in e))}"
                           + (f" ({left} rank(s) left waiting in a collective)" if left else ""))
    elif finished and len(finished) == facts.get("world_size", 2):
        worst = max(r.get("max_error", 0.0) for r in finished)
        stock_lines.append(f"moe: trained, max |param - reference| = {worst:.3g}")
        if worst <= DDP_WRONG:
            as_expected = False
            verdict.reasons.append(_stock_miss("rank-dependent experts stopping or training wrong at ZeRO-3",
                                               stock_lines[-1]))
    else:
        stock_lines.append(f"moe: {_short(errors[0]) if errors else 'left no record'}")
        as_expected = False
        verdict.reasons.append(_stock_miss("'Detected a disagreement' on rank-dependent experts", stock_lines[-1]))

    safe = _records(legs, "safe_mixed_moe")
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
    worst = max((r.get("max_error", math.inf) for r in safe if r and not r.get("error")), default=math.inf)
    verdict.safe_zero = ("mixed_moe: DDP-exact, max |param - reference| = " f"{worst:.3g} < {DDP_TOLERANCE}"
                         if not why else "mixed_moe: " + "; ".join(why))
    verdict.safe_zero_ok = not why
    if why:
        verdict.reasons.append("safe_zero is not DDP-exact at 2 NCCL ranks: " + "; ".join(why))
    verdict.stock_observed = " | ".join(stock_lines)
    verdict.stock_as_expected = as_expected
    return _finish(verdict)


# ------------------------------------------------------------------------------------------- the list

ONE_RANK_ROUTES = ["zero2", "bf16_optimizer", "zero3"]

CHECKS: tuple = (
    Check(
        name="grouped_mm_one_rank",
        world_size=1,
        proves="CUDA grouped_mm refuses a weight off the 16-byte grid, stock ZeRO-2, BF16_Optimizer (ZeRO-1 + bf16 + fp32 "
               "grad accumulation) and ZeRO-3 at one rank hand it one, and safe_zero's layouts (DeepSpeed's "
               "parameter_alignment on ZeRO-1/2, its own order elsewhere) give grouped_mm aligned weights that train "
               "forward and backward",
        fails_how="the kernel accepts a misaligned weight; stock is aligned or grouped_mm does not refuse it ('stock "
                  "no longer shows ...: update the claim'); safe_zero leaves an operand off the grid, crashes, or its "
                  "losses do not fall",
        legs=_grouped_mm_legs(ONE_RANK_ROUTES),
        judge=_judge_grouped_mm(ONE_RANK_ROUTES),
    ),
    Check(
        name="grouped_mm_two_ranks",
        world_size=2,
        proves="at 2 NCCL ranks, stock ZeRO-3's stage3_use_all_reduce_for_fetch_params hands grouped_mm a misaligned "
               "weight and safe_zero's rounded slots do not; the default all-gather is aligned in stock already "
               "(why safe_zero keeps stock's layout at >= 2 ranks)",
        fails_how="stock all-reduce fetch aligned ('update the claim'); stock all-gather misaligned; safe_zero "
                  "misaligned, crashing or not training (on DeepSpeed < 0.19.8: not refusing that route)",
        legs=_grouped_mm_legs(["zero3_all_reduce", "zero3"]),
        judge=_judge_grouped_mm(["zero3_all_reduce", "zero3"], stock_aligned_routes=("zero3",)),
    ),
    Check(
        name="ddp_exact_two_ranks",
        world_size=2,
        proves="on NCCL, ZeRO-3 with a zero-element parameter in a mixed gather bucket and experts each rank uses "
               "differently: stock stops (torch.cat([]); 'Detected a disagreement'), safe_zero equals single-process "
               "fp32 AdamW on the global batch within 1e-5 (DDP's answer)",
        fails_how="stock trains either model correctly ('update the claim'); safe_zero crashes or differs from the "
                  "reference by >= 1e-5",
        legs=(Leg("stock_mixed_moe", "ddp_leg", {"model": "mixed_moe", "safe": False}),
              Leg("safe_mixed_moe", "ddp_leg", {"model": "mixed_moe", "safe": True}),
              # Last: one rank raises and the other is left in a collective, which ends the launch.
              Leg("stock_moe", "ddp_leg", {"model": "moe", "safe": False})),
        judge=judge_ddp_exact,
    ),
    Check(
        name="fp16_stage0_zero_sized",
        world_size=1,
        proves="fp16 stage 0 (fused FP16_Optimizer with DeepSpeed's FusedAdam, and FP16_UnfusedOptimizer) with a "
               "zero-sized trainable parameter: stock fails exactly on the releases the fix table says "
               "(zero_element_groups, < 0.19.8) and safe_zero trains with the shape (0, 8) kept",
        fails_how="stock's outcome disagrees with the fix table for this release; safe_zero crashes, loses the "
                  "shape, or its losses do not fall",
        legs=(Leg("stock_fused", "fp16_stage0_leg", {"fused": True, "safe": False}),
              Leg("safe_fused", "fp16_stage0_leg", {"fused": True, "safe": True}),
              Leg("stock_unfused", "fp16_stage0_leg", {"fused": False, "safe": False}),
              Leg("safe_unfused", "fp16_stage0_leg", {"fused": False, "safe": True})),
        judge=judge_fp16_stage0,
        needs=("fused_adam",),
    ),
    Check(
        name="grouped_mm_fused_stage0",
        world_size=1,
        proves="bf16 stage 0 with DeepSpeed's FusedAdam (fused FP16_Optimizer, which DeepSpeed never pads): stock "
               "hands CUDA grouped_mm a misaligned weight, safe_zero's order trains aligned",
        fails_how="as grouped_mm_one_rank",
        legs=_grouped_mm_legs(["fused_stage0"]),
        judge=_judge_grouped_mm(["fused_stage0"]),
        needs=("fused_adam",),
    ),
    Check(
        name="quantizer_one_rank",
        world_size=1,
        proves="DeepSpeed's real CUDA quantizer kernel divides by zero on an empty partition and safe_zero's guard "
               "returns empty tensors (equal to stock on sized ones); zero_quantized_nontrainable_weights with a "
               "frozen zero-element layer: stock ZeroDivisionError, safe_zero trains",
        fails_how="stock quantizes an empty partition ('update the claim'); safe_zero crashes, loses the shape, or "
                  "the quantizer never ran",
        legs=(Leg("kernel", "quantizer_kernel_leg"),
              Leg("stock_nontrainable", "quantizer_leg", {"model": "nontrainable", "safe": False}),
              Leg("safe_nontrainable", "quantizer_leg", {"model": "nontrainable", "safe": True})),
        judge=_judge_quantizer({"nontrainable": ("ZeroDivisionError",)}, kernel=True),
        needs=("quantizer",),
    ),
    Check(
        name="quantizer_two_ranks",
        world_size=2,
        proves="at 2 NCCL ranks, where DeepSpeed quantizes gathers: zero_quantized_nontrainable_weights (stock "
               "ZeroDivisionError) and zero_quantized_weights with a zero-element parameter in a mixed bucket (stock "
               "torch.cat([]) after the real quantized all-gather); safe_zero trains both with quantized gathers",
        fails_how="stock trains ('update the claim'); safe_zero crashes, ranks disagree, or no sized partition was "
                  "quantized",
        legs=(Leg("stock_nontrainable", "quantizer_leg", {"model": "nontrainable", "safe": False}),
              Leg("safe_nontrainable", "quantizer_leg", {"model": "nontrainable", "safe": True}),
              Leg("stock_weights", "quantizer_leg", {"model": "weights", "safe": False}),
              Leg("safe_weights", "quantizer_leg", {"model": "weights", "safe": True})),
        judge=_judge_quantizer({"nontrainable": ("ZeroDivisionError",),
                                "weights": (EMPTY_CAT, NOT_AVAILABLE, "ZeroDivisionError")}, kernel=False),
        needs=("quantizer",),
    ),
)

BY_NAME = {check.name: check for check in CHECKS}


def judge(check: Check, legs: Legs, facts: dict) -> Verdict:
    """The check's verdict; a leg some rank left no record of makes it an ``error`` (the launch ended early)."""
    names = [leg.name for leg in check.legs]
    # The last leg of the DDP check ends the launch by design when stock stops on one rank only.
    optional = {"stock_moe"} if check.name == "ddp_exact_two_ranks" else set()
    missing = _missing(legs, [n for n in names if n not in optional], check.world_size)
    try:
        verdict = check.judge(legs, facts)
    except Exception as e:  # noqa: BLE001 - a judge tripping on a malformed record is a failed check, not a crash
        verdict = Verdict(status="error", reasons=[f"judging failed: {type(e).__name__}: {e}"])
    if missing:
        verdict.status = "error"
        verdict.reasons.insert(0, f"no record of leg(s) {', '.join(missing)}: the launch ended before them (see log)")
    return verdict
