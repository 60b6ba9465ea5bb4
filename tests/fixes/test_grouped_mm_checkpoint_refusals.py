"""A checkpoint safe_zero cannot lay out again in this run's flat order is refused, never loaded by position.

The README ("Checkpoints") lists what cannot be mapped: another world size on a reordered layout (which DeepSpeed's
``load_checkpoint`` refuses before safe_zero sees it); on ZeRO-1/2 a
parameter missing by name or with another size, other or expert-parallel parameter groups, padding between
parameters, or an earlier safe_zero checkpoint written under ``round_robin_gradients`` in another order, whose flat
order it did not record by name. Each case here builds that checkpoint (a real one, edited where only an earlier
release or another model would write it) and asserts the refusal: an ``AlignmentError`` naming why and the
universal-checkpoint command. Loaded by position instead, the master weights and optimizer state would land on the
wrong parameters with no error, so these tests go red if a refusal is skipped.
"""

from __future__ import annotations

import glob
import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS
from tests.support.grouped_mm import (BF16_OPTIMIZER_REACHABLE, LAYOUTS, build_engine, route_config, train_recording,
                                      zero12_config)
from tests.support.models import HAS_GROUPED_MM, NO_GROUPED_MM, OddExperts, build

# Every test trains OddExperts to write the checkpoint it refuses.
pytestmark = pytest.mark.skipif(not HAS_GROUPED_MM, reason=NO_GROUPED_MM)

UNIVERSAL = "python -m deepspeed.checkpoint.ds_to_universal"


def _refusal(engine: Any, ckpt: str, tag: str, **kwargs: Any) -> str:
    """``load_checkpoint``'s ``AlignmentError`` as ``"AlignmentError: message"``, or ``"loaded"``."""
    from safe_zero.errors import AlignmentError

    try:
        engine.load_checkpoint(ckpt, tag=tag, **kwargs)
    except AlignmentError as error:
        return f"{type(error).__name__}: {error}"
    return "loaded"


def _edited(ckpt: str, tag: str, new_tag: str, change: Callable[[dict], None]) -> str:
    """A copy of checkpoint ``tag`` as ``new_tag`` with ``change`` applied to every rank's optimizer state (rank 0
    writes it, every rank waits)."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(f"{ckpt}/{tag}", f"{ckpt}/{new_tag}")
        for path in glob.glob(f"{ckpt}/{new_tag}/*optim_states.pt"):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            change(saved["optimizer_state_dict"])
            torch.save(saved, path)
    dist.barrier()
    return new_tag


def _with_groups(layout: str, config: dict, groups: Callable[[nn.Module], list[dict]]):
    """A safe_zero engine whose client optimizer has the parameter groups ``groups(model)``."""
    import copy

    import safe_zero

    model = build(LAYOUTS[layout])
    config = copy.deepcopy(config)
    del config["optimizer"]
    optimizer = torch.optim.Adam(groups(model), lr=1e-2)
    engine, *_ = safe_zero.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _two_groups(model: nn.Module) -> list[dict]:
    # Each group starts its own flat buffer on the grid: nothing to reorder in this layout.
    return [{"params": [model.odd]}, {"params": [p for n, p in model.named_parameters() if n != "odd"]}]


def _expert_parallel_group(model: nn.Module) -> list[dict]:
    return [{"params": list(model.parameters()), "moe": True, "name": "experts"}]


class RenamedOddExperts(OddExperts):
    """``OddExperts`` with its odd-sized parameter under another name (a checkpoint of the other model misses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sink = self.odd
        del self.odd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.__dict__["odd"] = self.sink  # OddExperts.forward reads self.odd
        try:
            return super().forward(x)
        finally:
            del self.__dict__["odd"]


# --- ZeRO-1/2, laid out again by name (DeepSpeed < 0.19.7, where safe_zero reorders instead of padding) -------------

def _zero12_save(case: str, ckpt: str, alignment: bool) -> None:
    engine = build_engine("odd", zero12_config(case, alignment=alignment), safe=True)
    train_recording(engine, 1, [])
    engine.save_checkpoint(ckpt, tag=f"aligned_{alignment}")


def _resize(state: dict, name: str, more: int) -> None:
    """The checkpoint's record of parameter ``name`` (its fragment in a rank's partition) ``more`` elements longer."""
    from deepspeed.checkpoint.constants import PARAM_SLICE_MAPPINGS

    for mappings in state[PARAM_SLICE_MAPPINGS]:
        if name in mappings:
            mappings[name] = type(mappings[name])(numel=mappings[name].numel + more, start=mappings[name].start)


def _zero12_refusals_body(case: str, ckpt: str) -> dict[str, str]:
    """One rank: each unmappable checkpoint loaded into a fresh safe_zero engine; what each load did."""
    from deepspeed.checkpoint.constants import PARAM_SLICE_MAPPINGS

    from safe_zero.checkpoint_layout import FLAT_NAMES_KEY, PARAM_ALIGNMENT_PADDINGS

    out: dict[str, str] = {}
    _zero12_save(case, ckpt, alignment=True)  # safe_zero's order, recorded by name
    _zero12_save(case, ckpt, alignment=False)  # stock's order (what stock DeepSpeed writes, plus safe_zero's records)
    config = zero12_config(case)

    # Parameter groups: the optimizer's groups changed since the checkpoint; a group marked expert-parallel.
    out["groups"] = _refusal(_with_groups("odd", config, _two_groups), ckpt, "aligned_True")
    out["expert_parallel"] = _refusal(_with_groups("odd", config, _expert_parallel_group), ckpt, "aligned_False")

    # A parameter missing by name (another model; its module weights load non-strict), or with another size.
    out["renamed"] = _refusal(build_engine(RenamedOddExperts, config, safe=True), ckpt, "aligned_False",
                              load_module_strict=False)
    resized = _edited(ckpt, "aligned_True", "resized", lambda state: _resize(state, "odd", 2))
    out["resized"] = _refusal(build_engine("odd", zero12_config(case, alignment=False), safe=True), ckpt, resized)

    # Padding between parameters (what DeepSpeed >= 0.19.7 writes with parameter_alignment): not a permutation.
    def padded(state: dict) -> None:
        state[PARAM_ALIGNMENT_PADDINGS] = [[0, 5] + [0] * (len(state[PARAM_SLICE_MAPPINGS][0]) - 2)]

    out["padded"] = _refusal(build_engine("odd", config, safe=True), ckpt,
                             _edited(ckpt, "aligned_False", "padded", padded))

    # An earlier safe_zero: the flat order recorded by position only; under round_robin_gradients DeepSpeed's slice
    # mappings then follow the group order, not the flat buffer's, so no name is known to be where.
    earlier = _edited(ckpt, "aligned_True", "earlier", lambda state: state.pop(FLAT_NAMES_KEY))
    out["earlier"] = _refusal(build_engine("odd", zero12_config(case, alignment=False), safe=True), ckpt, earlier)
    return out


def _zero12_skip() -> None:
    if DEEPSPEED_PADS_PARAMETERS:
        pytest.skip("DeepSpeed >= 0.19.7 pads ZeRO-1/2 (parameter_alignment): safe_zero keeps stock's order there")


def _cannot_map(why: str) -> str:
    return rf"AlignmentError: .*written in another parameter order.*cannot map them here \({why}\).*{UNIVERSAL}"


@pytest.mark.parametrize("case", ["stage2", "stage2_round_robin"])
def test_zero12_checkpoints_that_cannot_be_mapped_by_name_are_refused(ranks, tmp_path, case):
    _zero12_skip()
    (r,) = ranks.run(1, _zero12_refusals_body, case=case, ckpt=str(tmp_path), timeout=600)
    groups = r"other parameter groups, or expert-parallel groups"
    by_name = r"parameter group 0 does not hold the same parameters by name and size"
    expected = {"groups": groups, "expert_parallel": groups, "renamed": by_name, "resized": by_name,
                "padded": r"it pads between parameters \(parameter_alignment\)"}
    if case == "stage2_round_robin":  # an earlier safe_zero's round-robin order, recorded by position only
        expected["earlier"] = by_name
    for key, why in expected.items():
        assert re.search(_cannot_map(why), r[key], re.S), (key, r[key])
    if case == "stage2":  # without round_robin_gradients the slice mappings are in flat order: mapped by name
        assert r["earlier"] == "loaded"


# --- another world size on a reordered layout ------------------------------------------------------------------------
# DeepSpeed refuses a ZeRO checkpoint of another data-parallel world size in load_checkpoint itself (it then loads no
# optimizer file at all unless asked to), so safe_zero's own refusal guards a caller that hands the optimizer every
# saved rank's state directly.

def _world_size_routes() -> list[str]:
    routes = ["bf16_optimizer"] if BF16_OPTIMIZER_REACHABLE else []
    return routes + ([] if DEEPSPEED_PADS_PARAMETERS else ["stage2"])


def _world_size_save_body(ckpt: str, routes: list[str]) -> None:
    for route in routes:
        engine = build_engine("odd", route_config(route), safe=True)  # reordered
        train_recording(engine, 1, [])
        engine.save_checkpoint(ckpt, tag=route)


def _world_size_load_body(ckpt: str, routes: list[str]) -> dict[str, dict[str, str]]:
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    from safe_zero.errors import AlignmentError

    out: dict[str, dict[str, str]] = {}
    for route in routes:
        config = route_config(route)
        config["safe_zero"] = {"alignment": False}  # stock's order
        engine = build_engine("odd", config, safe=True)
        got = out[route] = {}
        try:
            engine.load_checkpoint(ckpt, tag=route)
            got["load_checkpoint"] = "loaded"
        except ZeRORuntimeException as error:
            got["load_checkpoint"] = f"{type(error).__name__}: {error}"
        states = [torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                  for path in sorted(glob.glob(f"{ckpt}/{route}/*optim_states.pt"))]
        try:
            engine.optimizer.load_state_dict(state_dict_list=states, checkpoint_folder=None,
                                             load_optimizer_states=True, load_from_fp32_weights=True)
            got["load_state_dict"] = "loaded"
        except AlignmentError as error:
            got["load_state_dict"] = f"{type(error).__name__}: {error}"
    return out


def test_a_reordered_checkpoint_at_another_world_size_is_refused(ranks, tmp_path):
    routes = _world_size_routes()
    if not routes:
        pytest.skip("no reordered flat-buffer route with ZeRO checkpoint files on this DeepSpeed")
    ranks.run(2, _world_size_save_body, ckpt=str(tmp_path), routes=routes, timeout=600)
    (r,) = ranks.run(1, _world_size_load_body, ckpt=str(tmp_path), routes=routes, timeout=600)
    why = {"bf16_optimizer": r"another world size, or a layout it does not know",
           "stage2": r"saved at 2 ranks, loaded at 1"}
    for route in routes:
        assert re.search(r"ZeRORuntimeException: .*DP world size of 2 .*current world size is 1",
                         r[route]["load_checkpoint"]), (route, r[route])
        assert re.search(_cannot_map(why[route]), r[route]["load_state_dict"], re.S), (route, r[route])


# --- BF16_Optimizer and ZeRO-3 at one rank: permuted on load, or refused (every release) -----------------------------

def _order_as_list(reorder: Callable[[list[int]], list[int]]) -> Callable[[dict], None]:
    """An earlier safe_zero's record: the reordered groups' orders as a list, without group numbers."""
    from safe_zero.checkpoint_layout import ORDER_KEY

    def change(state: dict) -> None:
        state[ORDER_KEY] = [reorder(order) for order in state[ORDER_KEY].values()]

    return change


def _permuted_refusals_body(ckpt: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if BF16_OPTIMIZER_REACHABLE:
        config = route_config("bf16_optimizer")
        engine = build_engine("odd", config, safe=True)
        train_recording(engine, 1, [])
        engine.save_checkpoint(ckpt, tag="bf16")
        out["groups"] = _refusal(_with_groups("odd", config, _two_groups), ckpt, "bf16")
        same = _edited(ckpt, "bf16", "earlier_same", _order_as_list(list))
        out["earlier_same"] = _refusal(build_engine("odd", config, safe=True), ckpt, same)
        other = _edited(ckpt, "bf16", "earlier_other", _order_as_list(lambda order: order[::-1]))
        out["earlier_other"] = _refusal(build_engine("odd", config, safe=True), ckpt, other)

    # ZeRO-3 at one rank with sub_group_size cutting a parameter group into several flat sub-groups: a permutation
    # of the group's parameters crosses the sub-groups, which DeepSpeed saves and loads one by one.
    config = route_config("stage3")
    config["zero_optimization"]["sub_group_size"] = 100
    stock = build_engine("odd", config, safe=False)
    train_recording(stock, 1, [])
    stock.save_checkpoint(ckpt, tag="stage3_stock")
    out["sub_groups"] = _refusal(build_engine("odd", config, safe=True), ckpt, "stage3_stock")
    return out


def test_permuted_layouts_refuse_what_is_not_one_permutation_of_their_groups(ranks, tmp_path):
    (r,) = ranks.run(1, _permuted_refusals_body, ckpt=str(tmp_path), timeout=600)
    unknown = _cannot_map(r"another world size, or a layout it does not know")
    assert re.search(unknown, r["sub_groups"], re.S), r["sub_groups"]
    if BF16_OPTIMIZER_REACHABLE:
        assert re.search(unknown, r["groups"], re.S), r["groups"]
        assert re.search(unknown, r["earlier_other"], re.S), r["earlier_other"]
        assert r["earlier_same"] == "loaded"  # an earlier record of this very order still loads
