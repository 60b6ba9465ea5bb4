"""Checkpoints of grouped_mm models move between stock DeepSpeed and safe_zero (issue 16).

safe_zero keeps stock's layout wherever stock already aligns the grouped_mm weights (ZeRO-3 at >= 2 ranks, tested
with the world-size sweep); elsewhere it pads (ZeRO-1/2: DeepSpeed's ``parameter_alignment``) or reorders
(BF16_Optimizer, ZeRO-3 at one rank). Each direction is checked exactly: the resumed run's next two losses (the
second one reads the restored optimizer state) and its parameters equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS
from tests.support.grouped_mm import (BF16_OPTIMIZER_REACHABLE, ZERO12, build_engine, gathered_values, route_config,
                                      train_recording, zero12_config)
from tests.support.models import skip_without_grouped_mm, skip_without_grouped_mm_transformers

ROUTES = ["stage1", "stage2", "bf16_optimizer"]


def _universal(ckpt: str, tag: str) -> str:
    """``ds_to_universal`` on rank 0 (the documented conversion); every rank waits for it."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        f"{ckpt}/{tag}", "--output_folder", f"{ckpt}/{tag}_universal", "--inject_missing_state"],
                       check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    dist.barrier()
    return f"{tag}_universal"


def _move_body(layout: str, route: str, ckpt: str) -> dict:
    config = route_config(route)
    out: dict = {}
    # Uninterrupted runs: stock, and safe_zero.
    stock = build_engine(layout, config, safe=False)
    train_recording(stock, 2, [])
    stock.save_checkpoint(ckpt, tag="stock")
    out["stock_next"] = train_recording(stock, 2, [])
    out["stock_values"] = gathered_values(stock)
    del stock
    safe = build_engine(layout, config, safe=True)
    train_recording(safe, 2, [])
    safe.save_checkpoint(ckpt, tag="safe")
    out["safe_next"] = train_recording(safe, 2, [])
    out["safe_values"] = gathered_values(safe)
    del safe

    # stock -> safe_zero.
    resumed = build_engine(layout, config, safe=True)
    resumed.load_checkpoint(ckpt, tag="stock")
    out["resumed_seen"] = []
    out["resumed_next"] = train_recording(resumed, 2, out["resumed_seen"])
    out["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(gathered_values(resumed), out["stock_values"]))
    del resumed

    # safe_zero -> stock: plain DeepSpeed first as the user would run it, then as its error says (ZeRO-1/2: the
    # padded layout needs parameter_alignment), or through a universal checkpoint (a reordered layout).
    back = build_engine(layout, config, safe=False)
    try:
        back.load_checkpoint(ckpt, tag="safe")
        out["back_plain_next"] = train_recording(back, 2, [])
        out["back_plain_equal"] = all(torch.equal(a, b) for a, b in zip(gathered_values(back), out["safe_values"]))
    except RuntimeError as error:
        out["back_plain_error"] = str(error)
    del back
    if "back_plain_error" in out:
        config = route_config(route)
        config["zero_optimization"]["parameter_alignment"] = True
        back = build_engine(layout, config, safe=False)
        back.load_checkpoint(ckpt, tag="safe")
    else:
        config = route_config(route)
        config["checkpoint"] = {"load_universal": True}
        back = build_engine(layout, config, safe=False)
        back.load_checkpoint(ckpt, tag=_universal(ckpt, "safe"))
    out["back_next"] = train_recording(back, 2, [])
    out["back_equal"] = all(torch.equal(a, b) for a, b in zip(gathered_values(back), out["safe_values"]))
    for key in ("stock_values", "safe_values"):
        del out[key]
    return out


# GPT-OSS at 2 ranks on the flat-buffer routes; ZeRO-3 reorders only where a rank holds whole parameters (1 rank)
# and only where stock's order misaligns, which the hand-made layout does (the sweep covers the others at 1-4 ranks).
MOVES = [("gpt_oss", route, 2) for route in ROUTES] + [("odd", "stage3", 1)]
REORDERED = {("gpt_oss", "bf16_optimizer"), ("odd", "stage3")}


@pytest.mark.parametrize("layout, route, world_size", MOVES)
def test_grouped_mm_checkpoints_move_between_stock_and_safe_zero(ranks, tmp_path, layout, route, world_size):
    if layout != "odd":
        skip_without_grouped_mm_transformers()
    else:
        skip_without_grouped_mm()
    if route == "bf16_optimizer":
        if not BF16_OPTIMIZER_REACHABLE:
            pytest.skip("this DeepSpeed has no BF16_Optimizer route")
    results = ranks.run(world_size, _move_body, layout=layout, route=route, ckpt=str(tmp_path), timeout=900)
    for r in results:
        # stock -> safe_zero, exact (issue 16: refused before), and aligned after the load.
        assert r["resumed_next"] == r["stock_next"] and r["resumed_equal"]
        assert r["resumed_seen"] and set(r["resumed_seen"]) == {0}, r["resumed_seen"]
        # safe_zero -> stock, exact, with the setting DeepSpeed's error names or through ds_to_universal.
        if route in ("stage1", "stage2") and DEEPSPEED_PADS_PARAMETERS:
            assert "parameter_alignment" in r["back_plain_error"]  # DeepSpeed's own refusal, asserted
        if (layout, route) in REORDERED:  # plain DeepSpeed loads a reordered layout silently onto the wrong parameters
            assert not r["back_plain_equal"]
        assert r["back_next"] == r["safe_next"] and r["back_equal"]


# --- universal checkpoints of safe_zero runs, at another world size -----------------------------------------------

# GPT-OSS (alignment padding on ZeRO-1/2, a reordered BF16_Optimizer group) and the zero-element and gradient-less
# models safe_zero fixes.
UNIVERSAL = [("gpt_oss", route) for route in ("stage1", "stage2", "stage3", "bf16_optimizer")] + \
    [("zero_sized", "stage2"), ("zero_sized", "stage3"), ("gradless", "stage2")]


def _universal_save_body(layout: str, route: str, ckpt: str) -> dict:
    safe = build_engine(layout, route_config(route), safe=True)
    train_recording(safe, 2, [])
    safe.save_checkpoint(ckpt, tag="t")
    tag = _universal(ckpt, "t")
    return {"tag": tag, "values": gathered_values(safe), "next": train_recording(safe, 1, [])}


def _universal_load_body(layout: str, route: str, ckpt: str, tag: str) -> dict:
    config = route_config(route)
    config["checkpoint"] = {"load_universal": True}
    safe = build_engine(layout, config, safe=True)
    safe.load_checkpoint(ckpt, tag=tag)
    seen: list[int] = []
    out = {"values": gathered_values(safe), "next": train_recording(safe, 2, seen)}
    out["seen"] = seen
    return out


@pytest.mark.parametrize("layout, route", UNIVERSAL)
def test_a_universal_checkpoint_of_safe_zero_resumes_at_other_world_sizes(ranks, tmp_path, layout, route):
    if layout == "gpt_oss":
        skip_without_grouped_mm_transformers()
    if route == "bf16_optimizer":
        if not BF16_OPTIMIZER_REACHABLE:
            pytest.skip("this DeepSpeed has no BF16_Optimizer route")
    saved = ranks.run(2, _universal_save_body, layout=layout, route=route, ckpt=str(tmp_path), timeout=900)[0]
    for world_size in (1, 3):
        for r in ranks.run(world_size, _universal_load_body, layout=layout, route=route, ckpt=str(tmp_path),
                           tag=saved["tag"], timeout=900):
            assert all(torch.equal(a, b) for a, b in zip(r["values"], saved["values"])), (world_size, route)
            # Every rank trains on the same batch, so the mean gradient does not depend on the world size.
            assert r["next"][0] == saved["next"][0], (world_size, r["next"], saved["next"])
            assert r["next"][1] < r["next"][0] and set(r["seen"]) == ({0} if layout == "gpt_oss" else set()), r["seen"]


# --- ZeRO-1/2 moves of a hand-made misaligned layout, without Transformers (both CI legs) --------------------------
# DeepSpeed >= 0.19.7: safe_zero pads (parameter_alignment) and the moves are direct, as for GPT-OSS above. Before
# 0.19.7 safe_zero reorders the ZeRO-1/2 flat groups, and lays a checkpoint of another order out again on load, by
# parameter name (issue 16: refused before, naming the universal conversion); the universal checkpoint moves either
# way exactly too.

def _same(engine, values) -> bool:
    return all(torch.equal(a, b) for a, b in zip(gathered_values(engine), values))


def _zero12_move_body(case: str, ckpt: str) -> dict:
    from safe_zero.errors import AlignmentError

    def engine(safe: bool, load_universal: bool = False):
        return build_engine("odd", zero12_config(case, load_universal=load_universal), safe=safe)

    out: dict = {"stock_seen": [], "direct_seen": [], "universal_seen": []}
    stock = engine(safe=False)
    train_recording(stock, 2, out["stock_seen"])
    stock.save_checkpoint(ckpt, tag="stock")
    out["stock_next"] = train_recording(stock, 2, [])
    stock_values = gathered_values(stock)
    del stock
    safe = engine(safe=True)
    out["safe_optimizer"] = type(safe.optimizer).__name__
    out["reordered"] = bool(safe.optimizer._flat_order())
    train_recording(safe, 2, [])
    safe.save_checkpoint(ckpt, tag="safe")
    out["safe_next"] = train_recording(safe, 2, [])
    safe_values = gathered_values(safe)
    del safe

    # stock -> safe_zero as is, and through a universal checkpoint.
    direct = engine(safe=True)
    try:
        direct.load_checkpoint(ckpt, tag="stock")
        out["direct_next"] = train_recording(direct, 2, out["direct_seen"])
        out["direct_equal"] = _same(direct, stock_values)
    except AlignmentError as error:
        out["direct_error"] = str(error)
    del direct
    resumed = engine(safe=True, load_universal=True)
    resumed.load_checkpoint(ckpt, tag=_universal(ckpt, "stock"))
    out["universal_next"] = train_recording(resumed, 2, out["universal_seen"])
    out["universal_equal"] = _same(resumed, stock_values)
    del resumed

    # safe_zero -> stock as is (what a user would try first), and through a universal checkpoint.
    back = engine(safe=False)
    try:
        back.load_checkpoint(ckpt, tag="safe")
        out["back_plain_equal"] = _same(back, safe_values)
        out["back_plain_next"] = train_recording(back, 2, [])
    except RuntimeError as error:
        out["back_plain_error"] = str(error)
    del back
    back = engine(safe=False, load_universal=True)
    back.load_checkpoint(ckpt, tag=_universal(ckpt, "safe"))
    out["back_universal_next"] = train_recording(back, 2, [])
    out["back_universal_equal"] = _same(back, safe_values)
    return out


@pytest.mark.parametrize("case", list(ZERO12))
def test_zero12_checkpoints_of_a_misaligned_layout_move_or_are_refused_with_the_universal_command(
        ranks, tmp_path, case):
    skip_without_grouped_mm()
    # One rank: stock ZeRO-1/2 does not train at two CPU ranks on DeepSpeed 0.18.7-0.18.x (flat_buffer_autograd).
    (r,) = ranks.run(1, _zero12_move_body, case=case, ckpt=str(tmp_path), timeout=600)
    assert set(r["stock_seen"]) - {0}, r["stock_seen"]  # red on stock: the expert weight is off the grid
    assert r["safe_optimizer"] == "SafeDeepSpeedZeroOptimizer"
    assert r["safe_next"] == r["stock_next"]  # the same training, in safe_zero's layout
    # stock -> safe_zero directly, exact: padded by DeepSpeed >= 0.19.7 (LoadsUnpaddedCheckpoints), laid out again
    # in safe_zero's order before 0.19.7 (refused before); the resumed run's expert weight is on the grid.
    assert "direct_error" not in r, r["direct_error"]
    assert r["direct_next"] == r["stock_next"] and r["direct_equal"], r
    assert r["direct_seen"] and set(r["direct_seen"]) == {0}, r["direct_seen"]
    if DEEPSPEED_PADS_PARAMETERS:
        assert not r["reordered"]
        assert "parameter_alignment" in r["back_plain_error"]  # back needs the setting DeepSpeed's error names
    else:
        # Reordered: plain DeepSpeed cannot tell and loads safe_zero's checkpoint onto the wrong parameters.
        assert r["reordered"]
        assert "back_plain_error" not in r and not r["back_plain_equal"]
    # The universal checkpoint moves either way, exactly, and safe_zero's resumed run is aligned.
    assert r["universal_next"] == r["stock_next"] and r["universal_equal"], r
    assert r["universal_seen"] and set(r["universal_seen"]) == {0}, r["universal_seen"]
    assert r["back_universal_next"] == r["safe_next"] and r["back_universal_equal"], r


# --- safe_zero -> safe_zero at 2 ranks, between two flat orders (DeepSpeed < 0.19.7) -------------------------------
# "alignment": false keeps stock's order (no flat order recorded), the default reorders: each checkpoint resumes in
# the other layout exactly, the partitions cut anew (a parameter moves between ranks).


def _zero12_orders_body(case: str, ckpt: str) -> dict:
    out: dict = {}
    for alignment in (False, True):
        engine = build_engine("odd", zero12_config(case, alignment=alignment), safe=True)
        out[f"reordered_{alignment}"] = bool(engine.optimizer._flat_order())
        train_recording(engine, 2, [])
        engine.save_checkpoint(ckpt, tag=f"aligned_{alignment}")
        out[f"next_{alignment}"] = train_recording(engine, 2, [])
        values = gathered_values(engine)
        del engine
        resumed = build_engine("odd", zero12_config(case, alignment=not alignment), safe=True)
        resumed.load_checkpoint(ckpt, tag=f"aligned_{alignment}")
        out[f"seen_{not alignment}"] = []
        out[f"resumed_next_{not alignment}"] = train_recording(resumed, 2, out[f"seen_{not alignment}"])
        out[f"resumed_equal_{not alignment}"] = _same(resumed, values)
        del resumed
        if not alignment:
            # Without the names record the checkpoint is what stock writes in this order: mapped from DeepSpeed's
            # slice mappings (fragments on both ranks; stock's round-robin reshuffle recomputed).
            _strip_flat_names(ckpt, "aligned_False")
            resumed = build_engine("odd", zero12_config(case), safe=True)
            resumed.load_checkpoint(ckpt, tag="aligned_False")
            out["stripped_next"] = train_recording(resumed, 2, [])
            out["stripped_equal"] = _same(resumed, values)
            del resumed
    return out


def _strip_flat_names(ckpt: str, tag: str) -> None:
    import glob

    import torch.distributed as dist

    from safe_zero.checkpoint_layout import FLAT_NAMES_KEY

    if dist.get_rank() == 0:
        for path in glob.glob(f"{ckpt}/{tag}/*optim_states.pt"):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            del saved["optimizer_state_dict"][FLAT_NAMES_KEY]
            torch.save(saved, path)
    dist.barrier()


@pytest.mark.parametrize("case", list(ZERO12))
def test_zero12_safe_zero_checkpoints_resume_in_another_flat_order_at_two_ranks(ranks, tmp_path, case):
    if DEEPSPEED_PADS_PARAMETERS:
        pytest.skip("DeepSpeed >= 0.19.7 pads instead (parameter_alignment); safe_zero does not reorder ZeRO-1/2")
    skip_without_grouped_mm()
    for r in ranks.run(2, _zero12_orders_body, case=case, ckpt=str(tmp_path), timeout=600):
        assert r["reordered_True"] and not r["reordered_False"], r
        for alignment in (False, True):  # resumed in this layout from the other one
            assert r[f"resumed_next_{alignment}"] == r[f"next_{not alignment}"], (alignment, r)
            assert r[f"resumed_equal_{alignment}"], (alignment, r)
        assert r["seen_True"] and set(r["seen_True"]) == {0}, r["seen_True"]
        assert r["stripped_next"] == r["next_False"] and r["stripped_equal"], r
