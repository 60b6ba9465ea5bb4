"""What safe_zero costs that does not depend on the machine, asserted: collectives, bytes, calls, state, padding.

The README's cost summary and docs/cost.md quote these; ``make bench`` times only what takes a clock. Engines and
models are the bench's (``benchmarks/bodies.py``): the control model (4 x Linear(256, 256)) and the scaled models at
the ``CI=true`` size (about 200 tensors of hidden 16), on 2 CPU/gloo ranks.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from benchmarks import bodies
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd, zero_element_groups
from tests.support.models import skip_without_grouped_mm_transformers

# Counted on the main leg's DeepSpeed (another release makes other collectives and calls).
pytestmark = pytest.mark.main_leg_only
WORLD = 2
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")


def _skip_stock_zero2(stage: int) -> None:
    if stage < 3 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")


def _kinds(counts: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if not name.endswith("_bytes")}


def _added(stock: dict[str, int], safe: dict[str, int]) -> dict[str, int]:
    """What safe_zero's step issues beyond stock's, by collective and by ``<collective>_bytes``."""
    return {name: safe.get(name, 0) - stock.get(name, 0) for name in set(stock) | set(safe)
            if safe.get(name, 0) != stock.get(name, 0)}


# ------------------------------------------------------------------------------------------ the control model


@pytest.mark.parametrize("stage", [2, 3])
def test_the_first_step_adds_the_agreement_and_later_steps_nothing(ranks, stage):
    """gradless_params, on a model every rank uses whole (8 trainable tensors): in the first step one all-reduce of
    one byte per tensor and one all-gather of every rank's hook order (4 B per tensor per rank; ZeRO-3: 8 B, with
    each hook's module clock), ZeRO-3 also one all-gather of 8 B per rank per module with parameters (the ranks agree
    on the module order while DeepSpeed records its trace); after it stock's collectives, bytes included. Every step
    posts its micro-step to the store once (``rank_progress``: a ``set`` the store does not answer)."""
    _skip_stock_zero2(stage)
    stock = ranks.run(WORLD, bodies.collectives_per_step, stage=stage, safe=False)[0]
    safe = ranks.run(WORLD, bodies.collectives_per_step, stage=stage, safe=True)[0]
    assert len(stock) == len(safe) == 3
    tensors, modules = 8, 4
    order = tensors * (4 if stage < 3 else 8) * WORLD
    expected = {"all_reduce": 1, "all_reduce_bytes": tensors, "all_gather": 1, "all_gather_bytes": order,
                "store_set": 1}
    if stage == 3:
        expected["all_gather"] += modules
        expected["all_gather_bytes"] += modules * 8 * WORLD
    assert _added(stock[0], safe[0]) == expected, (stock[0], safe[0])
    assert [_added(a, b) for a, b in zip(stock[1:], safe[1:])] == [{"store_set": 1}] * 2


def test_a_rank_that_skips_the_tower_after_the_recorded_step_makes_the_others_collectives_and_nothing_more(ranks):
    """ZeRO-3, rank 1 skips the tower in steps 2 and 4 (``bodies.TOWER_STEPS``): it runs no forward of it, every rank
    makes in such a step exactly the collectives (bytes included) of a step where both run it -- the tower's gathers,
    forward and backward, and its gradients' share of the reduce-scatter -- and no other message; nothing is kept
    gathered (no memory). A step where both run it costs what stock's does, plus the one store ``set``."""
    stock = ranks.run(WORLD, bodies.skipping_tower_collectives, safe=False, steps=({0, 1},) * 4)
    safe = ranks.run(WORLD, bodies.skipping_tower_collectives, safe=True)
    assert safe[0]["tower_forwards"] == [1, 1, 1, 1] and safe[1]["tower_forwards"] == [1, 0, 1, 0]
    for rank in range(WORLD):
        steps = safe[rank]["collectives"]
        assert steps[3] == steps[2], steps  # rank 1 skipping (4) or not (3): the same collectives
        for step in (1, 2, 3):  # step 2 also checks the recorded trace across ranks (stock's broadcasts)
            assert _added(stock[rank]["collectives"][step], steps[step]) == {"store_set": 1}, step
        assert safe[rank]["kept"] == []
    assert safe[0]["collectives"][1:] == safe[1]["collectives"][1:]


def test_all_gathers_per_zero3_step_equal_with_and_without_empty_submodules(ranks):
    """K = 4 submodules whose only parameters are zero-sized, in the forward path, gather nothing more than K = 0."""
    def gathers(k: int) -> list[dict[str, int]]:
        steps = ranks.run(WORLD, bodies.collectives_per_step, stage=3, safe=True, model="with_empty", tensors=k)[0]
        return [{name: n for name, n in step.items() if name.startswith(ALL_GATHERS)} for step in steps]

    without, with_empty = gathers(0), gathers(4)
    assert all(step for step in without)
    if zero_element_groups.FIX.needed(DEEPSPEED_VERSION):
        # Before 0.19.8 (is_optimized_parameter) DeepSpeed's ZeRO-3 optimizer holds the K zero-element parameters, so
        # gradless_params' first-step order agreement carries each one's place and clock: 2 int32 from each rank.
        with_empty[0]["all_gather_bytes"] -= 4 * 2 * 4 * WORLD
    assert with_empty == without


# ------------------------------------------------------------------------------------------ the scaled models


def _deep_size(obj: Any, seen: set[int]) -> int:
    """Bytes of ``obj`` and what it holds: containers, ints, strings, safe_zero's own objects and the tensors they
    made; a parameter or module (DeepSpeed holds it anyway) counts only as the reference to it."""
    import torch
    from torch import nn

    if id(obj) in seen or isinstance(obj, (nn.Parameter, nn.Module, type)) or callable(obj):
        return 0
    if hasattr(obj, "__dict__") and not all(k is object or k.__module__.startswith("safe_zero")
                                            for k in type(obj).__mro__):
        return 0  # DeepSpeed's objects (the optimizer, the coordinator) and others: referenced, not held
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type == "cpu" else 0
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return size + sum(_deep_size(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return size + _deep_size(vars(obj), seen)
    if type(obj).__module__.startswith("safe_zero"):  # slotted, as session.State is
        slots = (name for klass in type(obj).__mro__ for name in vars(klass).get("__slots__", ()))
        return size + sum(_deep_size(getattr(obj, name, None), seen) for name in slots)
    return size


def _state_bytes(engine: Any) -> int:
    """Every ``_safe_zero*`` attribute of the engine, its optimizer and (ZeRO-3) its parameter coordinator, deep."""
    owners = [engine, engine.optimizer]
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is not None:
        owners.append(offload.get_param_coordinator())
    seen: set[int] = set()
    return sum(_deep_size(value, seen) for owner in owners for name, value in vars(owner).items()
               if name.startswith("_safe_zero"))


def scaled_costs(stage: int, model: str, safe: bool, tensors: int = 200, steps: int = 3) -> dict[str, Any]:
    """A rank body: ``steps`` steps of a bench model, counting collectives per step; for safe_zero also its calls per
    step after the first (cProfile: functions in files under safe_zero/) and the peak of its state, sampled after
    initialize and right before and after each step's gradient epilogue (before it the backward's agreement or walk
    is live, after it the agreed reduction order)."""
    import cProfile
    import os
    import pstats

    import safe_zero

    with bodies._threads_for(model):
        module = bodies.build(model, tensors)
        engine = bodies._engine(module, stage, safe)
        x = bodies.example_input(module)
        peak = [_state_bytes(engine) if safe else 0]
        epilogue = engine.optimizer.independent_gradient_partition_epilogue

        def sampled(*args: Any, **kwargs: Any) -> Any:
            peak.append(_state_bytes(engine))
            result = epilogue(*args, **kwargs)
            peak.append(_state_bytes(engine))
            return result

        if safe:
            engine.optimizer.independent_gradient_partition_epilogue = sampled
        profile = cProfile.Profile()
        collectives = []
        with bodies._counting_collectives() as counts:
            for step in range(steps):
                counts.clear()
                if step:
                    profile.enable()
                bodies._step(engine, x)
                profile.disable()
                collectives.append(dict(counts))
    ours = os.path.dirname(os.path.abspath(safe_zero.__file__)) + os.sep
    calls = sum(v[1] for k, v in pstats.Stats(profile).stats.items() if k[0].startswith(ours))  # type: ignore
    return {"tensors": bodies.trainable_tensors(module), "collectives": collectives, "state": max(peak),
            "calls_per_step": calls / (steps - 1)}


#: (model, stage) -> the first-step bytes safe_zero adds per trainable tensor (the README's 9-25 B), and the most
#: calls into safe_zero per tensor per step after the first: one per gradient hook (ZeRO-3: also one per module it
#: gathers, forward and backward) and a few dozen per step (at 1,000 tensors 1.03, 1.25 and 2.16). ZeRO-3's second step
#: also keeps the recorded step's events for the shadow (``gradless/shadow.py``): a handful of calls, once.
SCALED = {("moe", 2): (9.0, 1.2), ("moe", 3): (17.3, 1.47), ("transformer", 3): (25.0, 2.37)}


@pytest.mark.parametrize("model, stage", list(SCALED))
def test_scaled_models_cost_bytes_once_a_call_per_hook_and_some_state(ranks, model, stage):
    """On about 200 tiny tensors: the first step adds 9 B per tensor at ZeRO-2 and 17-25 B at ZeRO-3 (the agreement,
    each rank's hook order, 4 or 8 B per tensor per rank, and at ZeRO-3 8 B per rank per module); later steps are
    stock's, bytes included; safe_zero makes about one call per gradient hook (ZeRO-3: also per module gathered), and
    its state stays under 520 B per tensor."""
    _skip_stock_zero2(stage)
    stock = ranks.run(WORLD, scaled_costs, stage=stage, model=model, safe=False)[0]
    safe = ranks.run(WORLD, scaled_costs, stage=stage, model=model, safe=True)
    tensors = safe[0]["tensors"]
    first, calls = SCALED[model, stage]
    for rank in safe:
        added = _added(stock["collectives"][0], rank["collectives"][0])
        assert sum(n for name, n in added.items() if name.endswith("_bytes")) / tensors == pytest.approx(first, abs=0.1)
        assert [_added(a, b) for a, b in zip(stock["collectives"][1:], rank["collectives"][1:])] == [{}, {}]
        assert tensors < rank["calls_per_step"] <= calls * tensors, rank["calls_per_step"] / tensors
        # 489 B per tensor on the transformer before the shadow kept the recorded step's events (2 B each, 413 here)
        assert 0 < rank["state"] / tensors < 520


@pytest.mark.parametrize("model, tensors", [("moe", 189), ("moe_rank_dependent", 189), ("transformer", 194)])
def test_scaled_models_have_the_tensor_counts_the_tables_name(model, tensors):
    from safe_zero.leaf_modules import moe_blocks

    described = bodies.describe(model, 200)  # the CI=true size
    assert described["tensors"] == tensors
    module = bodies.build(model, 200)
    if model.startswith("moe"):
        # An experts nn.ModuleList per block: the pattern safe_zero gathers whole under ZeRO-3.
        assert len(moe_blocks(module)) == described["moe_blocks"] == 7
    else:
        assert not moe_blocks(module)
    assert bodies.example_input(module).dtype.is_floating_point


def test_rank_dependent_moe_runs_other_experts_on_each_rank(ranks):
    per_rank = ranks.run(2, bodies.describe, model="moe_rank_dependent", tensors=200)
    assert [r["experts_run"] for r in per_rank] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ranks.run(2, bodies.describe, model="moe", tensors=200)[0]["experts_run"] == list(range(8))


# ------------------------------------------------------------------------------------------ alignment padding


def _gpt_oss(hidden: int, expert_intermediate: int, experts: int, layers: int, vocab: int, heads: int,
             head_dim: int = 64) -> Any:
    """A GPT-OSS on the meta device (the real-sized layout allocates nothing), 4 key-value heads."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(hidden_size=hidden, intermediate_size=expert_intermediate, num_local_experts=experts,
                          num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                          num_key_value_heads=min(4, heads), head_dim=head_dim, max_position_embeddings=4096)
    with torch.device("meta"):
        return GptOssForCausalLM(config)


def _layout(model: Any) -> dict[str, int]:
    """One bf16 flat group of every trainable parameter: DeepSpeed's ``parameter_alignment`` padding (ZeRO-1/2, on
    from 0.19.7, which safe_zero turns on), its most per parameter, and the grouped_mm weights off the 16-byte grid in
    stock's unpadded order and in safe_zero's order (``fixes/grouped_mm_alignment``, no padding)."""
    from safe_zero.alignment import ALIGNMENT_BYTES, AlignmentPlan, grouped_mm_parameters, padding_bytes
    from safe_zero.fixes.grouped_mm_alignment import _aligned_order

    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [2 * p.numel() for p in params]
    detected = grouped_mm_parameters(model)
    wanted = {id(p) for p in detected.values()}

    def off_grid(order: list[int]) -> int:
        offset, off = 0, 0
        for i in order:
            off += id(params[i]) in wanted and offset % ALIGNMENT_BYTES != 0
            offset += sizes[i]
        return off

    order = _aligned_order(params, AlignmentPlan(params=detected, active=True), "bench", nbytes=lambda p: 2 * p.numel(),
                           keep_aligned=False)
    return {"weights": len(detected), "padding": padding_bytes([p.numel() for p in params], 2),
            "most_per_parameter": max(-size % ALIGNMENT_BYTES for size in sizes),
            "off_grid_stock": off_grid(list(range(len(params)))), "off_grid_safe_zero": off_grid(order)}


def test_aligning_grouped_mm_weights_costs_safe_zero_no_padding():
    """safe_zero's own order puts every grouped_mm weight on the grid with 0 bytes of padding, where stock's order
    leaves half of them off it (GPT-OSS-sized, 20 heads: 40-byte attention sinks); DeepSpeed's parameter_alignment,
    which safe_zero turns on for ZeRO-1/2, pads 20 B on a tiny GPT-OSS and 192 B on the GPT-OSS-sized layout, at most
    14 B per parameter."""
    skip_without_grouped_mm_transformers()
    tiny = _layout(_gpt_oss(64, 32, 4, layers=1, vocab=128, heads=2, head_dim=32))
    assert tiny["padding"] == 20 and tiny["off_grid_safe_zero"] == 0
    sized = _layout(_gpt_oss(2048, 768, 64, layers=24, vocab=201088, heads=20))
    assert sized["weights"] == 48 and sized["off_grid_stock"] == 24 and sized["off_grid_safe_zero"] == 0
    assert sized["padding"] == 192 and sized["most_per_parameter"] <= 14


def test_zero3_at_three_ranks_rounds_only_the_all_reduce_fetch_slots():
    """ZeRO-3 at 3 ranks: safe_zero keeps stock's partitions (every all-gather builds a fresh, aligned buffer) and
    rounds each parameter's all-reduce fetch slot (``ds_numel_aligned``, a multiple of the world size) up to whole
    16-byte units: at most 14 B per parameter, in the transient gather buffer only."""
    from safe_zero.alignment import ALIGNMENT_BYTES, round_up

    skip_without_grouped_mm_transformers()
    model = _gpt_oss(2048, 768, 64, layers=24, vocab=201088, heads=32)
    slots = [round_up(p.numel(), 3) for p in model.parameters() if p.requires_grad]  # stock's ds_numel_aligned
    extra = [2 * (round_up(slot, ALIGNMENT_BYTES // 2) - slot) for slot in slots]  # bf16, as AlignAllReduceFetch
    assert 0 < sum(extra) and max(extra) <= 14
