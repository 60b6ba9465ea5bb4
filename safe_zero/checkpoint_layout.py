"""Checkpoints of flat buffers laid out in another parameter order: one layout record, one relayout.

``safe_zero.fixes.grouped_mm_alignment`` reorders some flat groups (parameters whose size is a whole number of
16-byte units first). The buffers keep their size, so DeepSpeed would copy a checkpoint written in another order
(stock's, or safe_zero's under stock) into them without complaint, onto the wrong parameters. A checkpoint
therefore records the flat order (``ORDER_KEY``: per group, the positions of the parameter group in flat order;
ZeRO-1/2 also ``FLAT_NAMES_KEY``: the names), and a load in another order lays the checkpoint out again, exactly:

* ``RecordsFlatOrder`` (BF16_Optimizer, fused stage 0, ZeRO-3 at one rank), in ``load_state_dict``: the layouts
  differ by a permutation of whole parameters, so the flat fp32 master copy and every optimizer state of its shape
  are permuted (BF16_Optimizer's partitions are gathered first and cut again after);
* ``RelaysByName`` (ZeRO-1/2), in ``_load_legacy_checkpoint``, which sees every saved rank's state: the parameters
  are found by name in each rank's ``param_slice_mappings`` (or ``FLAT_NAMES_KEY``), the whole flat group is rebuilt
  from the saved partitions, and this run's partitions are cut anew.

Both describe a flat group by one record, :class:`FlatLayout`, and move the data with :meth:`FlatLayout.relaid`.
What cannot be mapped (another world size, other parameter groups, a parameter missing by name or size, padding
between parameters, an order that was not recorded) is refused with the universal-checkpoint command.
``LoadsUnpaddedCheckpoints`` lets DeepSpeed's own unpadded-to-padded conversion read a stock ZeRO-1/2 checkpoint
where safe_zero turned ``parameter_alignment`` on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Sequence, TypeVar

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint import constants
from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS, PARAM_SLICE_MAPPINGS,
                                            SINGLE_PARTITION_OF_FP32_GROUPS)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS
from safe_zero.alignment import round_up
from safe_zero.errors import AlignmentError
from safe_zero.patching import overrides
from safe_zero.session import state_of

if TYPE_CHECKING:
    # mypy reads each mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix"). RecordsFlatOrder is put before every flattening
    # wrapper and ZeRO-3's optimizer: their common base.
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer as _Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as _ZeroOptimizer
else:
    _Optimizer = _ZeroOptimizer = object

ORDER_KEY = "safe_zero_flat_order"
# ZeRO-1/2: per group, the parameter names in flat-buffer order.
FLAT_NAMES_KEY = "safe_zero_flat_names"
#: Where DeepSpeed >= 0.19.7 records its padding between parameters (``parameter_alignment``); older ones never do.
PARAM_ALIGNMENT_PADDINGS = (constants.PARAM_ALIGNMENT_PADDINGS if DEEPSPEED_PADS_PARAMETERS
                            else "param_alignment_paddings")

# Where each wrapper keeps its flat fp32 master copy and its optimizer state in a checkpoint. BF16_Optimizer saves
# each rank's partition of the flat group; ZeRO-3 (reordered at one rank only) and the fused FP16_Optimizer the whole.
_FLAT_STATE_KEYS = (("single_partition_of_fp32_groups", "base_optimizer_state"),
                    ("fp32_flat_groups", "optimizer_state_dict"),
                    ("fp32_groups_flat", "optimizer_state_dict"))


#: How a layout names its parameters: positions in the parameter group, or names.
_Key = TypeVar("_Key", int, str)


@dataclass(frozen=True)
class FlatLayout(Generic[_Key]):
    """One flat group's layout: its parameters back to back in ``order`` (positions in the parameter group, or
    names), each ``numel[key]`` elements long."""

    order: Sequence[_Key]
    numel: Mapping[_Key, int]

    @property
    def total(self) -> int:
        return sum(self.numel[key] for key in self.order)

    def relaid(self, flat: torch.Tensor, to: FlatLayout[_Key]) -> torch.Tensor:
        """``flat`` (laid out as this layout, anything after it kept after it, such as padding) laid out as ``to``."""
        starts, at = {}, 0
        for key in self.order:
            starts[key] = at
            at += self.numel[key]
        return torch.cat([flat.narrow(0, starts[key], self.numel[key]) for key in to.order] + [flat[at:]])


def _orders_by_group(recorded: Any, groups: int) -> list[list[int] | None] | None:
    """A checkpoint's recorded flat orders, one entry per group (``None``: stock order); ``None`` if unreadable."""
    if recorded is None:
        return [None] * groups
    if isinstance(recorded, dict):
        return [recorded.get(i, recorded.get(str(i))) for i in range(groups)]
    return None  # safe_zero <= 0.1 listed only the reordered groups: which ones is not recorded


def _ranks(partition_count: int | list[int]) -> int:
    return partition_count[0] if isinstance(partition_count, list) else partition_count  # BF16_Optimizer: per group


def _unmappable(recorded: Any, mine: Any, why: str) -> AlignmentError:
    return AlignmentError(
        "this checkpoint's flat buffers were written in another parameter order than this run's "
        f"({'safe_zero' if recorded else 'stock'} order, this run: {'safe_zero' if mine else 'stock'} order) and "
        f"safe_zero cannot map them here ({why}); its fp32 master weights and optimizer state would land on the "
        "wrong parameters. Convert it to a universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
        "--input_folder CKPT/TAG --output_folder CKPT/TAG_universal --inject_missing_state) and load that with "
        '"checkpoint": {"load_universal": true}, which maps every parameter by name.')


class FlatOrder:
    """:class:`RecordsFlatOrder`'s part of an optimizer's :class:`~safe_zero.session.State`
    (``optimizer._safe_zero.flat_order``), read and written through that class's methods."""

    __slots__ = ("orders", "groups")

    def __init__(self) -> None:
        #: Per flat group, the positions of its parameter group in flat order, where that is not the stock order.
        self.orders: dict[int, list[int]] = {}
        #: The parameter groups DeepSpeed handed over one by one before flattening them (:meth:`_next_flat_group`;
        #: ``None`` where nothing counts them).
        self.groups: int | None = None


class RecordsFlatOrder(_Optimizer):
    """Checkpoints carry the flat order; one written in another order (stock's, say) is laid out again on load.

    The layouts differ by a permutation of whole parameters, so the flat master copy and every optimizer state of
    the flat group's shape are permuted back, exactly; what cannot be mapped that way is refused.
    """

    #: Whether ``load_state_dict`` lays a checkpoint out again (ZeRO-1/2 does it in ``_load_legacy_checkpoint``).
    _SAFE_ZERO_RELAYOUT = True

    def _layout(self) -> FlatOrder:
        state = state_of(self)
        if state.flat_order is None:
            state.flat_order = FlatOrder()
        return state.flat_order

    def _next_flat_group(self) -> int:
        """The index of the parameter group DeepSpeed is about to flatten, for a mixin of a method DeepSpeed calls
        once per group, in order (ZeRO-1/2's round robin, ZeRO-3's sub-groups). Counted: a load checks that ZeRO-3
        cut each group into one sub-group."""
        layout = self._layout()
        index = layout.groups or 0
        layout.groups = index + 1
        return index

    def _record_flat_order(self, group: int, order: list[int]) -> None:
        """Parameter group ``group`` is flattened in ``order`` (positions in the group), not in its own order."""
        self._layout().orders[group] = list(order)

    def _flat_order(self) -> dict[int, list[int]] | None:
        """Per reordered group its flat order (what a checkpoint records); ``None`` where every group is in order."""
        flat_order = state_of(self).flat_order
        return (flat_order.orders or None) if flat_order is not None else None

    @overrides
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        state = super().state_dict(*args, **kwargs)
        if isinstance(state, dict):
            state.update(self._layout_records())
        return state

    def _layout_records(self) -> dict[str, Any]:
        """What a checkpoint records of this run's flat layout, beside DeepSpeed's own state."""
        return {ORDER_KEY: self._flat_order()}

    def _flat_params(self) -> list[list[torch.Tensor]]:
        for attr in ("bf16_groups", "fp16_groups"):
            if hasattr(self, attr):
                return getattr(self, attr)
        return []

    @overrides
    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        name = "state_dict_list" if "state_dict_list" in kwargs else "state_dict" if "state_dict" in kwargs else None
        given: Any = kwargs[name] if name else args[0] if args else None  # a state dict, or one per saved rank
        listed = isinstance(given, (list, tuple))
        states = list(given) if listed else [given]
        # DeepSpeed reads each rank's own file in full and leaves the other ranks' entries empty.
        at = next((k for k, state in enumerate(states) if isinstance(state, dict)
                   and any(keys[0] in state for keys in _FLAT_STATE_KEYS)), None)
        if at is not None and self._SAFE_ZERO_RELAYOUT and not self._same_order(states[at].get(ORDER_KEY)):
            states[at] = self._laid_out_again(states[at], len(states))
            converted = states if listed else states[0]
            if name:
                kwargs[name] = converted
            else:
                args = (converted, *args[1:])
        return super().load_state_dict(*args, **kwargs)

    def _same_order(self, recorded: Any) -> bool:
        mine = self._flat_order()
        # Earlier safe_zero checkpoints listed the reordered groups' orders without their group numbers.
        return recorded == mine or (isinstance(recorded, list) and mine is not None and recorded == list(mine.values()))

    def _laid_out_again(self, state: dict, saving_ranks: int) -> dict:
        """This rank's ``state`` with its flat groups permuted from the checkpoint's order to this run's.

        A permutation of whole parameters crosses partition boundaries, so where the flat group is partitioned
        (BF16_Optimizer) the ranks gather it, permute it and each keeps its own partition again.
        """
        groups = self._flat_params()
        keys = next(k for k in _FLAT_STATE_KEYS if k[0] in state)
        theirs = _orders_by_group(state.get(ORDER_KEY), len(groups))
        ours = _orders_by_group(self._flat_order(), len(groups))
        assert ours is not None  # this run's own record is a dict or None, both readable
        partitioned = keys[0] == "single_partition_of_fp32_groups"
        ranks = _ranks(getattr(self, "partition_count", 1)) if partitioned else 1
        counted = self._layout().groups
        one_sub_group_each = counted is None or counted == len(groups)  # ZeRO-3
        if theirs is None or not one_sub_group_each or saving_ranks != ranks or len(state[keys[0]]) != len(groups):
            raise _unmappable(state.get(ORDER_KEY), self._flat_order(),
                              "another world size, or a layout it does not know")
        flat_key, optim_key = keys
        state = dict(state)
        for i, params in enumerate(groups):
            identity = list(range(len(params)))
            src, dst = theirs[i] or identity, ours[i] or identity
            if src == dst:
                continue
            # params is in this run's flat order: params[k] is the group's parameter dst[k].
            numel = {dst[k]: getattr(getattr(p, "ds_tensor", None), "ds_numel", None) or p.numel()
                     for k, p in enumerate(params)}
            saved_layout, layout = FlatLayout(src, numel), FlatLayout(dst, numel)
            saved = state[flat_key][i]

            def permute(part: torch.Tensor) -> torch.Tensor:
                if not partitioned or ranks == 1:
                    return saved_layout.relaid(part.reshape(-1), layout).view_as(part)
                group = self.real_dp_process_group[i]
                parts = [torch.empty_like(part) for _ in range(ranks)]
                dist.all_gather(parts, part.contiguous(), group=group)
                whole = saved_layout.relaid(torch.cat(parts), layout)
                return whole.narrow(0, dist.get_rank(group=group) * part.numel(), part.numel()).clone()

            state[flat_key] = [*state[flat_key][:i], permute(saved), *state[flat_key][i + 1:]]
            optim = state[optim_key]
            for key, value in list(optim["state"].get(i, {}).items()) if isinstance(optim, dict) else []:
                if torch.is_tensor(value) and value.shape == saved.shape:
                    optim["state"][i][key] = permute(value)
        state[ORDER_KEY] = self._flat_order()
        return state


class RelaysByName(RecordsFlatOrder):
    """Mixin for ``DeepSpeedZeroOptimizer``: a checkpoint in another flat layout (stock's order, or another safe_zero
    order) is laid out again by name in ``_load_legacy_checkpoint``.

    Each rank saved its partition without the tail padding plus where each parameter's fragment sits in it
    (``param_slice_mappings``), so the ranks rebuild each group's whole flat fp32 copy and optimizer state, move
    every parameter to where this run's flat buffer holds it, and cut this run's partitions.
    """

    _SAFE_ZERO_RELAYOUT = False  # _load_legacy_checkpoint sees every saved rank's state; done there

    def _layout_records(self) -> dict[str, Any]:
        # Under round_robin_gradients DeepSpeed's slice mappings follow the group order, not the flat buffer's.
        return {**super()._layout_records(), FLAT_NAMES_KEY: self._flat_names()}

    def _flat_names(self) -> list[list[str]]:
        return [[self.param_names[p] for p in group] for group in self.round_robin_bit16_groups]

    @overrides
    def _load_legacy_checkpoint(self, state_dict_list: list[dict], *args: Any, **kwargs: Any) -> Any:
        own = state_dict_list[dist.get_rank(group=self.dp_process_group)]
        names = own.get(FLAT_NAMES_KEY)
        if not (names == self._flat_names() if names is not None else self._same_order(own.get(ORDER_KEY))):
            state_dict_list = self._zero12_laid_out_again(list(state_dict_list))
        return super()._load_legacy_checkpoint(state_dict_list, *args, **kwargs)

    # Over the complexity limit on purpose: the refusals, the gather and the per-group moves share one sequence that
    # every rank must run alike (a refusal after the first collective would leave the other ranks waiting in it).
    def _zero12_laid_out_again(self, states: list[Any]) -> list[Any]:  # noqa: C901
        """``states`` (one per saved rank; rigid checkpoints: only this rank's loaded) in this run's flat layout."""
        group = self.dp_process_group
        me, ranks = dist.get_rank(group=group), dist.get_world_size(group=group)
        own = states[me]
        recorded = own.get(ORDER_KEY)
        everyone = all(isinstance(s, dict) and SINGLE_PARTITION_OF_FP32_GROUPS in s for s in states)
        groups = len(self.round_robin_bit16_groups)
        # Decided alike on every rank (nothing rank-specific yet), so the ranks refuse or gather together.
        if len(states) != ranks:
            raise _unmappable(recorded, self._flat_order(), f"saved at {len(states)} ranks, loaded at {ranks}")
        if len(own[SINGLE_PARTITION_OF_FP32_GROUPS]) != groups or any(map(self.is_moe_group,
                                                                          self.optimizer.param_groups)):
            raise _unmappable(recorded, self._flat_order(), "other parameter groups, or expert-parallel groups")
        if any(any(paddings) for paddings in own.get(PARAM_ALIGNMENT_PADDINGS) or []):
            # Padding between parameters (DeepSpeed >= 0.19.7 parameter_alignment): not a permutation of them.
            raise _unmappable(recorded, self._flat_order(), "it pads between parameters (parameter_alignment)")

        def lean(state: dict) -> dict:  # what this layout needs of a rank's state, small enough to gather
            return {"maps": [[(n, a.start, a.numel) for n, a in m.items()] for m in state[PARAM_SLICE_MAPPINGS]],
                    "lean": [t.numel() for t in state[SINGLE_PARTITION_OF_FP32_GROUPS]],
                    "pad": list(state[GROUP_PADDINGS])}

        if everyone:
            saved: list[Any] = [lean(s) for s in states]
        else:
            saved = [None] * ranks  # all_gather_object fills in each rank's
            dist.all_gather_object(saved, lean(own), group=group)
        numel = {self.param_names[p]: p.numel() for params in self.round_robin_bit16_groups for p in params}
        mine = self._flat_names()
        rigid = isinstance(own[BASE_OPTIMIZER_STATE], dict)
        out = [dict(s) if isinstance(s, dict) else s for s in states]
        for r, s in enumerate(out):
            if isinstance(s, dict):
                s[SINGLE_PARTITION_OF_FP32_GROUPS] = list(s[SINGLE_PARTITION_OF_FP32_GROUPS])
                s[GROUP_PADDINGS] = list(s[GROUP_PADDINGS])
                base = s[BASE_OPTIMIZER_STATE]
                s[BASE_OPTIMIZER_STATE] = ({**base, "state": {k: dict(v) for k, v in base["state"].items()}}
                                           if rigid else [dict(g) for g in base])
        for i in range(groups):
            width = saved[0]["lean"][i] + saved[0]["pad"][i]  # a saved partition, padding included
            saved_layout = self._saved_layout(i, saved, width, own.get(FLAT_NAMES_KEY), recorded, numel)
            layout = FlatLayout([n for n in mine[i] if numel[n]], numel)  # zero-element parameters carry no data
            if saved_layout is None or sorted(n for n in saved_layout.order if numel[n]) != sorted(layout.order):
                raise _unmappable(recorded, self._flat_order(),
                                  f"parameter group {i} does not hold the same parameters by name and size")
            total = layout.total
            alignment = self.nccl_start_alignment_factor * ranks
            part = round_up(total, alignment) // ranks
            if not getattr(self, "parameter_alignment", False) and part != self.partition_size[i]:
                raise _unmappable(recorded, self._flat_order(), f"parameter group {i} is partitioned otherwise")
            tail = part * ranks - total  # DeepSpeed pads the last rank's partition only

            def moved(rank_lean: Callable[[dict, int], torch.Tensor]) -> list[torch.Tensor]:
                """Every rank's partition in this run's layout (padded) from each saved rank's lean partition."""
                if everyone:
                    full = torch.cat([rank_lean(s, r) for r, s in enumerate(states)])
                else:
                    mine_lean = rank_lean(own, me)
                    padded = torch.zeros(width, dtype=mine_lean.dtype, device=get_accelerator().current_device_name())
                    padded[:mine_lean.numel()] = mine_lean
                    parts = [torch.empty_like(padded) for _ in range(ranks)]
                    dist.all_gather(parts, padded, group=group)
                    full = torch.cat(parts).to(mine_lean.device)
                flat = torch.cat([saved_layout.relaid(full[:saved_layout.total], layout), full.new_zeros(tail)])
                return list(flat.split(part))

            def pad_of(r: int) -> int:
                return tail if r == ranks - 1 else 0

            fp32 = moved(lambda s, r: s[SINGLE_PARTITION_OF_FP32_GROUPS][i].reshape(-1)[:saved[r]["lean"][i]])
            for r, s in enumerate(out):
                if isinstance(s, dict):
                    s[SINGLE_PARTITION_OF_FP32_GROUPS][i] = fp32[r][:part - pad_of(r)].clone()
                    s[GROUP_PADDINGS][i] = pad_of(r)
            # Rigid: the torch optimizer's state_dict of the padded partitions; elastic: per group, lean states.
            optim = own[BASE_OPTIMIZER_STATE]["state"].get(i, {}) if rigid else own[BASE_OPTIMIZER_STATE][i]
            for key, value in sorted(optim.items()):
                if not (torch.is_tensor(value) and value.dim() > 0
                        and value.numel() == (width if rigid else saved[me]["lean"][i])):
                    continue  # not per element (Adam's step): the same in any layout

                def state_of(s: dict, r: int, key: str = key) -> torch.Tensor:
                    value = s[BASE_OPTIMIZER_STATE]["state"][i][key] if rigid else s[BASE_OPTIMIZER_STATE][i][key]
                    return value.reshape(-1)[:saved[r]["lean"][i]]

                laid = moved(state_of)
                for r, s in enumerate(out):
                    if isinstance(s, dict):
                        target = s[BASE_OPTIMIZER_STATE]["state"][i] if rigid else s[BASE_OPTIMIZER_STATE][i]
                        target[key] = (laid[r] if rigid else laid[r][:part - pad_of(r)]).clone()
        for s in out:
            if isinstance(s, dict):
                s[ORDER_KEY], s[FLAT_NAMES_KEY] = self._flat_order(), mine
        out[me][PARAM_SLICE_MAPPINGS] = self._param_slice_mappings
        return out

    def _saved_layout(self, i: int, saved: list[dict], width: int, names: list[list[str]] | None,
                      recorded: Any, numel: dict[str, int]) -> FlatLayout | None:
        """Group ``i``'s layout in the checkpoint's whole flat group (``None``: not known)."""
        fragments: dict[str, list[tuple[int, int]]] = {}
        for r, rank in enumerate(saved):  # a parameter spanning partitions has a fragment in each
            for name, start, size in rank["maps"][i]:
                fragments.setdefault(name, []).append((r * width + start, size))
        sizes = {n: sum(size for _, size in f) for n, f in fragments.items()}
        if any(numel.get(n) != size for n, size in sizes.items() if size):
            return None
        if names is not None:
            order = list(names[i])
        else:
            # DeepSpeed maps the slices in the group's order, which is the flat order unless round_robin_gradients
            # reshuffled it: stock's reshuffle is recomputed; an older safe_zero one was not recorded by name.
            order = [n for n in sorted(fragments, key=lambda n: min(o for o, _ in fragments[n])) if sizes[n]]
            if self.round_robin_gradients and recorded is not None:
                return None
            if self.round_robin_gradients and len(saved) > 1:  # one rank: stock's reshuffle keeps the order
                order = DeepSpeedZeroOptimizer._round_robin_reorder(self, order, len(saved))[0]
        if any(name not in numel for name in order):
            return None
        return FlatLayout(order, numel)


class LoadsUnpaddedCheckpoints(_ZeroOptimizer):
    """Mixin for ``DeepSpeedZeroOptimizer`` with ``parameter_alignment`` (which safe_zero turns on for grouped_mm
    weights): resume a checkpoint written without it (stock's default), exactly.

    DeepSpeed 0.19.8 lays an unpadded checkpoint out again in the padded layout itself
    (``_expand_unpadded_flat_group``, ``_redistribute_unpadded_partition``) when the checkpoint records no
    alignment layout, but refuses one that records the all-zero layout stock writes ("The ZeRO checkpoint
    parameter-alignment layout does not match"). The layouts differ only by that padding, so the all-zero record
    is left out and DeepSpeed's own conversion runs.
    """

    @overrides
    def _load_legacy_checkpoint(self, state_dict_list: list[dict], *args: Any, **kwargs: Any) -> Any:
        if state_dict_list and getattr(self, "parameter_alignment", False) and \
                hasattr(self, "_expand_unpadded_flat_group"):
            state_dict_list = [_without_unpadded_record(state) for state in state_dict_list]
        return super()._load_legacy_checkpoint(state_dict_list, *args, **kwargs)


def _without_unpadded_record(state: dict) -> dict:
    paddings = state.get(PARAM_ALIGNMENT_PADDINGS) if isinstance(state, dict) else None  # None: not loaded here
    if paddings is not None and not any(any(group) for group in paddings):
        state = {key: value for key, value in state.items() if key != PARAM_ALIGNMENT_PADDINGS}
    return state


__all__ = ["FLAT_NAMES_KEY", "FlatLayout", "LoadsUnpaddedCheckpoints", "ORDER_KEY", "PARAM_ALIGNMENT_PADDINGS",
           "RecordsFlatOrder", "RelaysByName"]
