"""grouped_mm expert weights off the 16-byte grid in flat buffers DeepSpeed does not pad (every release).

``FP16_Optimizer`` (fused stage 0), ``BF16_Optimizer`` (ZeRO-1 + bf16 + fp32 gradient
accumulation) and, before 0.19.7, ``DeepSpeedZeroOptimizer`` (ZeRO-1/2) concatenate each
parameter group into one flat buffer and rebind every parameter to its slice. A parameter whose
byte size is not a multiple of 16 (GPT-OSS's 2-element attention sinks, a 4-element router
bias) pushes every later slice off the 16-byte grid, and CUDA grouped_mm then refuses the expert
weights ("expected data_ptr to be aligned to 16 bytes").

Where the stock order leaves a grouped_mm weight off the grid (and only there: elsewhere the layout
and the checkpoints stay stock's), the fix orders its group before DeepSpeed flattens it: every
parameter whose size is a whole number of 16-byte units first (in their original order), then
the rest. The buffer starts on the grid, so each weight of that prefix does too, with no padding
at all: the buffers keep their size, the views stay zero-copy, and nothing in DeepSpeed's offset
arithmetic changes. Adam and SGD act element-wise, so the losses are bit-identical to the stock
order. DeepSpeed records the flattened order itself (``bf16_groups``, ``round_robin_bit16_groups``,
``fp16_groups``): checkpoints and ``zero_to_fp32`` follow it, and the order is a pure function of the
model, so a resumed run loads its own checkpoint. A checkpoint written in the other order (stock's,
or safe_zero's under stock) is laid out again on load, exactly: by ``RecordsFlatOrder`` (BF16_Optimizer,
fused stage 0, ZeRO-3 at one rank), and on ZeRO-1/2 by ``AlignRoundRobinGroups``, which moves every
parameter by name (each rank's ``param_slice_mappings``, or the names safe_zero records in flat order)
at the same world size; what cannot be mapped so is refused with the universal-checkpoint command. Stock
DeepSpeed knows nothing of the order, so a reordered safe_zero checkpoint moves to stock through a
universal checkpoint (``ds_to_universal``, which maps every parameter by name). On ZeRO-1/2 with
``parameter_alignment`` (which safe_zero turns on) ``LoadsUnpaddedCheckpoints`` lets DeepSpeed's own
unpadded-to-padded conversion read a stock checkpoint.

CUDA grouped_mm also needs 16-byte row strides, so its weights are whole 16-byte units in
practice; one that is not is placed first after the prefix (still aligned), and a group with two
such weights cannot be laid out without padding: that is refused at initialize with the
configurations that work.

The guard mixin (``"alignment_guard"``, on by default) checks the detected weights after
initialize and after every optimizer step on every flattening wrapper, including the ZeRO-1/2
route that DeepSpeed >= 0.19.7 pads itself, and on ZeRO-3 after every gather.

ZeRO-3, measured on CPU (bf16, a 3-element parameter ahead of the expert weight, forward and
backward alike): at world size 1 every gather path (persistent, coalesced, single, all-reduce,
offload_param) hands grouped_mm the rank's own partition, a view into the optimizer's flat buffer,
14 bytes off the grid; at world size >= 2 the all-gather paths (persistent, coalesced, single,
offload_param, ``GatheredParameters``) build fresh buffers and are aligned whatever the partition
sizes (measured at 2, 3 and 4 ranks for DeepSeek-V3, GPT-OSS, Qwen3-MoE and OLMoE, where a
partition is rarely a whole number of 16-byte units), while ``stage3_use_all_reduce_for_fetch_params``
is 8 bytes off (0.19.8) or 6 (0.18.9). ``AlignStage3SubGroups`` therefore reorders only where a rank
holds whole parameters (a partition group of one), so at world size >= 2 the layout, and the
checkpoint, is stock's; ``AlignAllReduceFetch`` pads the all-reduce buffer; the all-reduce fetch of
DeepSpeed < 0.19.8 packs parameters without any slack and is refused at initialize instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.alignment import ALIGNMENT_BYTES, AlignmentPlan, plan_for
from safe_zero.errors import AlignmentError
from safe_zero.fix import Fix
from safe_zero.patching import overrides
from safe_zero.session import session_for

FIX = Fix(
    name="grouped_mm_alignment",
    summary="keep grouped_mm expert weights 16-byte aligned in the flat buffers DeepSpeed does not pad",
    needed_on=SpecifierSet(">=0.18.0"),
    probe="safe_zero.probes:probe_grouped_mm_alignment",
)


def _nbytes(param: torch.Tensor) -> int:
    # ZeRO-1/2 flattening on CPU parks the data in cpu_data and leaves a 1-element placeholder.
    data = getattr(param, "cpu_data", param)
    return data.numel() * data.element_size()


def _partition_nbytes(param: torch.Tensor) -> int:
    return param.partition_numel() * param.element_size()  # ZeRO-3: what the optimizer's flat buffer holds


def _aligned_order(params: list[torch.Tensor], plan: AlignmentPlan, route: str,
                   nbytes: Callable[[torch.Tensor], int] = _nbytes, keep_aligned: bool = True) -> list[int]:
    """Positions of ``params`` in an order that puts every detected weight on the grid (raises if impossible);
    with ``keep_aligned``, the given order wherever it already does."""
    size = [nbytes(p) for p in params]
    if keep_aligned and _stock_order_aligned(params, size, plan):
        return list(range(len(params)))  # stock's layout already serves grouped_mm: keep it (and its checkpoints)
    whole = [i for i, s in enumerate(size) if s % ALIGNMENT_BYTES == 0]
    rest = [i for i, s in enumerate(size) if s % ALIGNMENT_BYTES != 0]
    partial = [i for i in rest if plan.needs(params[i])]
    if len(partial) > 1:
        listed = ", ".join(f"{plan.name(params[i])} ({size[i]} bytes)" for i in partial)
        raise AlignmentError(
            f"safe_zero cannot keep these grouped_mm weights 16-byte aligned on the {route} route: {listed}. "
            "Their sizes are not multiples of 16 bytes and this route has no padding between parameters. "
            "ZeRO-1/2 with bf16/fp16 and no fp32 gradient accumulation on DeepSpeed >= 0.19.7 pads any size "
            "(zero_optimization.parameter_alignment, which safe_zero turns on).")
    return whole + partial + [i for i in rest if i not in partial]


def _stock_order_aligned(params: list[torch.Tensor], size: list[int], plan: AlignmentPlan) -> bool:
    """Whether the stock order already starts every weight that needs the grid on it (with ``everything``: every
    parameter whose size is a whole number of 16-byte units)."""
    offset = 0
    for param, nbytes in zip(params, size):
        wanted = plan.needs(param) or (plan.everything and nbytes % ALIGNMENT_BYTES == 0)
        if wanted and offset % ALIGNMENT_BYTES:
            return False
        offset += nbytes
    return True


def _reorder(group: list[Any], order: list[int]) -> list[Any]:
    return [group[i] for i in order]


def _wants(plan: AlignmentPlan, session: Any, params: list[torch.Tensor]) -> bool:
    return plan.active and session.uses(FIX) and (plan.everything or any(plan.needs(p) for p in params))


ORDER_KEY = "safe_zero_flat_order"
# ZeRO-1/2: per group, the parameter names in flat-buffer order.
FLAT_NAMES_KEY = "safe_zero_flat_names"

# Where each wrapper keeps its flat fp32 master copy and its optimizer state in a checkpoint. BF16_Optimizer saves
# each rank's partition of the flat group; ZeRO-3 (reordered at one rank only) and the fused FP16_Optimizer the whole.
_FLAT_STATE_KEYS = (("single_partition_of_fp32_groups", "base_optimizer_state"),
                    ("fp32_flat_groups", "optimizer_state_dict"),
                    ("fp32_groups_flat", "optimizer_state_dict"))


def _orders_by_group(recorded: Any, groups: int) -> list[list[int] | None] | None:
    """A checkpoint's recorded flat orders, one entry per group (``None``: stock order); ``None`` if unreadable."""
    if recorded is None:
        return [None] * groups
    if isinstance(recorded, dict):
        return [recorded.get(i, recorded.get(str(i))) for i in range(groups)]
    return None  # safe_zero <= 0.1 listed only the reordered groups: which ones is not recorded


def _ranks(partition_count: int | list[int]) -> int:
    return partition_count[0] if isinstance(partition_count, list) else partition_count  # BF16_Optimizer: per group


def _relayout(full: torch.Tensor, numels: dict[int, int], src: list[int], dst: list[int]) -> torch.Tensor:
    """``full`` (a flat group laid out in ``src`` order, any tail padding after it) laid out in ``dst`` order."""
    pieces, offset = {}, 0
    for original in src:
        pieces[original] = full.narrow(0, offset, numels[original])
        offset += numels[original]
    return torch.cat([pieces[original] for original in dst] + [full[offset:]])


def _unmappable(recorded: Any, mine: Any, why: str) -> AlignmentError:
    return AlignmentError(
        "this checkpoint's flat buffers were written in another parameter order than this run's "
        f"({'safe_zero' if recorded else 'stock'} order, this run: {'safe_zero' if mine else 'stock'} order) and "
        f"safe_zero cannot map them here ({why}); its fp32 master weights and optimizer state would land on the "
        "wrong parameters. Convert it to a universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
        "--input_folder CKPT/TAG --output_folder CKPT/TAG_universal --inject_missing_state) and load that with "
        '"checkpoint": {"load_universal": true}, which maps every parameter by name.')


class RecordsFlatOrder:
    """Checkpoints carry the flat order; one written in another order (stock's, say) is laid out again on load.

    The buffers keep their size when reordered, so DeepSpeed would copy a stock checkpoint's fp32 master
    weights and optimizer state into the reordered buffers without complaint, onto the wrong parameters. The
    layouts differ by a permutation of whole parameters, so the flat master copy and every optimizer state of
    the flat group's shape are permuted back, exactly; what cannot be mapped that way is refused.
    """

    #: Whether ``load_state_dict`` lays a checkpoint out again (ZeRO-1/2 does it in ``_load_legacy_checkpoint``).
    _SAFE_ZERO_RELAYOUT = True

    def _record_flat_order(self, group: int, order: list[int]) -> None:
        self.__dict__.setdefault("_safe_zero_flat_order", {})[group] = list(order)

    def _flat_order(self) -> dict[int, list[int]] | None:
        return self.__dict__.get("_safe_zero_flat_order") or None

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
        given = kwargs[name] if name else args[0] if args else None
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
        partitioned = keys[0] == "single_partition_of_fp32_groups"
        ranks = _ranks(getattr(self, "partition_count", 1)) if partitioned else 1
        one_sub_group_each = getattr(self, "_safe_zero_param_groups_seen", len(groups)) == len(groups)  # ZeRO-3
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
            numels = {dst[k]: getattr(getattr(p, "ds_tensor", None), "ds_numel", None) or p.numel()
                      for k, p in enumerate(params)}
            saved = state[flat_key][i]

            def permute(part: torch.Tensor) -> torch.Tensor:
                if not partitioned or ranks == 1:
                    return _relayout(part.reshape(-1), numels, src, dst).view_as(part)
                from deepspeed import comm as dist

                group = self.real_dp_process_group[i]
                parts = [torch.empty_like(part) for _ in range(ranks)]
                dist.all_gather(parts, part.contiguous(), group=group)
                whole = _relayout(torch.cat(parts), numels, src, dst)
                return whole.narrow(0, dist.get_rank(group=group) * part.numel(), part.numel()).clone()

            state[flat_key] = [*state[flat_key][:i], permute(saved), *state[flat_key][i + 1:]]
            optim = state[optim_key]
            for key, value in list(optim["state"].get(i, {}).items()) if isinstance(optim, dict) else []:
                if torch.is_tensor(value) and value.shape == saved.shape:
                    optim["state"][i][key] = permute(value)
        state[ORDER_KEY] = self._flat_order()
        return state


class AlignFlatGroups(RecordsFlatOrder):
    """Mixin for the flattening wrappers: orders the groups before DeepSpeed flattens them, then checks.

    ``parameter_alignment=True`` (ZeRO-1/2 on DeepSpeed >= 0.19.7) means DeepSpeed pads itself;
    the mixin then only guards.
    """

    @overrides
    def __init__(self, init_optimizer: Any, *args: Any, **kwargs: Any) -> None:
        session = session_for(self)
        plan = plan_for(session)
        route = type(self).__bases__[-1].__name__
        if plan.active and kwargs.get("parameter_alignment", False):
            session.engaged(FIX, f"{route}: DeepSpeed pads parameter boundaries (zero_optimization.parameter_alignment) "
                                 f"for {len(plan.params)} grouped_mm weight(s)")
        elif plan.active and init_optimizer is not None:
            moved = 0
            for index, group in enumerate(init_optimizer.param_groups):
                params = list(group["params"])
                if not _wants(plan, session, params):
                    continue
                order = _aligned_order(params, plan, route)
                if order != sorted(order):
                    group["params"] = _reorder(params, order)
                    self._record_flat_order(index, order)
                    moved += sum(1 for new, old in enumerate(order) if new != old)
            if moved:
                session.engaged(FIX, f"{route}: flattened whole-16-byte parameters first ({moved} moved) "
                                     f"so {len(plan.params)} grouped_mm weight(s) sit on the 16-byte grid")
        super().__init__(init_optimizer, *args, **kwargs)
        plan.check("after initialize", route)

    @overrides
    def step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().step(*args, **kwargs)
        plan_for(session_for(self)).check("after an optimizer step", type(self).__bases__[-1].__name__)
        return result


class AlignRoundRobinGroups(AlignFlatGroups):
    """Mixin for ``DeepSpeedZeroOptimizer``: ``round_robin_gradients`` reshuffles after the group order; re-apply it.

    A checkpoint in another flat layout (stock's order, or another safe_zero order) is laid out again by name in
    ``_load_legacy_checkpoint``: each rank saved its partition without the tail padding plus where each parameter's
    fragment sits in it (``param_slice_mappings``), so the ranks rebuild each group's whole flat fp32 copy and
    optimizer state, move every parameter to where this run's flat buffer holds it, and cut this run's partitions.
    """

    _SAFE_ZERO_RELAYOUT = False  # _load_legacy_checkpoint sees every saved rank's state; done there

    def _layout_records(self) -> dict[str, Any]:
        # Under round_robin_gradients DeepSpeed's slice mappings follow the group order, not the flat buffer's.
        return {**super()._layout_records(), FLAT_NAMES_KEY: self._flat_names()}

    def _flat_names(self) -> list[list[str]]:
        return [[self.param_names[p] for p in group] for group in self.round_robin_bit16_groups]

    @overrides
    def _load_legacy_checkpoint(self, state_dict_list: list[dict], *args: Any, **kwargs: Any) -> Any:
        from deepspeed import comm as dist

        own = state_dict_list[dist.get_rank(group=self.dp_process_group)]
        names = own.get(FLAT_NAMES_KEY)
        if not (names == self._flat_names() if names is not None else self._same_order(own.get(ORDER_KEY))):
            state_dict_list = self._zero12_laid_out_again(list(state_dict_list))
        return super()._load_legacy_checkpoint(state_dict_list, *args, **kwargs)

    def _zero12_laid_out_again(self, states: list[Any]) -> list[Any]:
        """``states`` (one per saved rank; rigid checkpoints: only this rank's loaded) in this run's flat layout."""
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS, PARAM_SLICE_MAPPINGS,
                                                    SINGLE_PARTITION_OF_FP32_GROUPS)

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
        if any(any(paddings) for paddings in own.get("param_alignment_paddings") or []):  # PARAM_ALIGNMENT_PADDINGS
            # Padding between parameters (DeepSpeed >= 0.19.7 parameter_alignment): not a permutation of them.
            raise _unmappable(recorded, self._flat_order(), "it pads between parameters (parameter_alignment)")

        def lean(state: dict) -> dict:  # what this layout needs of a rank's state, small enough to gather
            return {"maps": [[(n, a.start, a.numel) for n, a in m.items()] for m in state[PARAM_SLICE_MAPPINGS]],
                    "lean": [t.numel() for t in state[SINGLE_PARTITION_OF_FP32_GROUPS]],
                    "pad": list(state[GROUP_PADDINGS])}

        if everyone:
            saved = [lean(s) for s in states]
        else:
            saved = [None] * ranks
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
            src = self._saved_flat_offsets(i, saved, width, own.get(FLAT_NAMES_KEY), recorded, numel)
            held = [n for n in mine[i] if numel[n]]  # zero-element parameters carry no data
            if src is None or sorted(n for n in src if numel[n]) != sorted(held):
                raise _unmappable(recorded, self._flat_order(),
                                  f"parameter group {i} does not hold the same parameters by name and size")
            total = sum(numel[n] for n in mine[i])
            alignment = self.nccl_start_alignment_factor * ranks
            part = _round_up(total, alignment) // ranks
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
                pieces = [full.narrow(0, src[n], numel[n]) for n in held]
                flat = torch.cat(pieces + [full.new_zeros(tail)])
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

    def _saved_flat_offsets(self, i: int, saved: list[dict], width: int, names: list[list[str]] | None,
                            recorded: Any, numel: dict[str, int]) -> dict[str, int] | None:
        """Where each parameter of group ``i`` starts in the checkpoint's whole flat group (``None``: not known)."""
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
                from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

                order = DeepSpeedZeroOptimizer._round_robin_reorder(self, order, len(saved))[0]
        offsets, at = {}, 0
        for name in order:
            if name not in numel:
                return None
            offsets[name] = at
            at += numel[name]
        return offsets

    @overrides
    def _round_robin_reorder(self, tensor_list: list[Any], num_partitions: int) -> tuple[list[Any], Any]:
        tensors, indices = super()._round_robin_reorder(tensor_list, num_partitions)
        index = self.__dict__.get("_safe_zero_round_robin_groups", 0)  # called once per parameter group, in order
        self._safe_zero_round_robin_groups = index + 1
        session = session_for(self)
        plan = plan_for(session)
        if getattr(self, "parameter_alignment", False) or not _wants(plan, session, tensors):
            return tensors, indices
        # Always whole units first here: keeping an already aligned round-robin order after the group reorder
        # left safe_get_full_fp32_param wrong on 0.18.9 at 2 ranks (not investigated further); whole-first is right.
        order = _aligned_order(tensors, plan, "DeepSpeedZeroOptimizer (round_robin_gradients)", keep_aligned=False)
        if order != sorted(order):
            self._record_flat_order(index, order)
        position = {old: new for new, old in enumerate(order)}
        return _reorder(tensors, order), {original: position[at] for original, at in indices.items()}


class AlignStage3SubGroups(RecordsFlatOrder):
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: where a rank holds a whole parameter (world size 1, or a
    partition group of one), the gathered weight IS its partition, a view into the optimizer's flat lp buffer.
    Order each parameter group whole-16-byte partitions first before DeepSpeed cuts it into sub-groups.

    With a partition group of two or more, every gather builds a fresh buffer, so the stock order stays: no
    partition size has to be a whole number of 16-byte units (at 3 ranks they rarely are), and the flat
    buffers, hence the checkpoints, are exactly stock's.

    The buffer holds the groups back to back, so a weight in a later parameter group is on the grid only if
    the groups before it are whole 16-byte units; the guard reports it otherwise.
    """

    def _holds_whole_params(self) -> bool:
        return self.partition_count == 1

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        session = session_for(self)
        plan = plan_for(session)
        if plan.guard and self._holds_whole_params():  # grouped_mm will get the partition itself: check it now
            for sub_group in self.fp16_groups:
                for param in sub_group:
                    held = param.ds_tensor
                    if (plan.needs(param) and held.numel() >= param.ds_numel
                            and held.data_ptr() % ALIGNMENT_BYTES):
                        why = ("the optimizer parameter groups before it end off the grid in DeepSpeed's flat "
                               "buffer. Put the grouped_mm weights in the first parameter group, or use ZeRO-1/2."
                               if session.uses(FIX) else
                               'the grouped_mm_alignment fix is off; set it to "auto" to align it.')
                        raise AlignmentError(
                            f"safe_zero cannot keep grouped_mm weight {plan.name(param)} 16-byte aligned on ZeRO-3 "
                            f"(data_ptr % 16 = {held.data_ptr() % ALIGNMENT_BYTES}): {why}")

    @overrides
    def _create_fp16_sub_groups(self, params_group: list[Any]) -> list[list[Any]]:
        index = self.__dict__.get("_safe_zero_param_groups_seen", 0)  # called once per parameter group, in order
        self._safe_zero_param_groups_seen = index + 1
        session = session_for(self)
        plan = plan_for(session)
        params_group = list(params_group)
        if self._holds_whole_params() and _wants(plan, session, params_group):
            order = _aligned_order(params_group, plan, "DeepSpeedZeroOptimizer_Stage3", nbytes=_partition_nbytes)
            if order != sorted(order):
                params_group = _reorder(params_group, order)
                self._record_flat_order(index, order)
                session.engaged(FIX, "DeepSpeedZeroOptimizer_Stage3: flattened whole-16-byte partitions first")
        return super()._create_fp16_sub_groups(params_group)


class LoadsUnpaddedCheckpoints:
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
    from deepspeed.checkpoint.constants import PARAM_ALIGNMENT_PADDINGS

    paddings = state.get(PARAM_ALIGNMENT_PADDINGS) if isinstance(state, dict) else None  # None: not loaded here
    if paddings is not None and not any(any(group) for group in paddings):
        state = {key: value for key, value in state.items() if key != PARAM_ALIGNMENT_PADDINGS}
    return state


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class AlignAllReduceFetch:
    """Mixin for ``DeepSpeedZeRoOffload``: ``stage3_use_all_reduce_for_fetch_params`` gathers a module's
    parameters into one buffer at offsets that add up ``ds_numel_aligned`` (the size rounded to the world
    size), so a weight after a 3-element parameter lands 8 bytes off the grid. Rounding every
    ``ds_numel_aligned`` up to whole 16-byte units puts each one on the grid; the value is read by that
    path alone, and the extra zeros (< 16 bytes per parameter) live only in the transient gather buffer.
    """

    @overrides
    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        plan = plan_for(session)
        params = [p for p in module.parameters() if hasattr(p, "ds_numel_aligned")]
        if _wants(plan, session, params):
            bumped = 0
            for param in params:
                grid = max(1, ALIGNMENT_BYTES // param.element_size())
                aligned = _round_up(param.ds_numel_aligned, grid)
                bumped += aligned != param.ds_numel_aligned
                param.ds_numel_aligned = aligned
            if bumped:
                session.engaged(FIX, f"DeepSpeedZeRoOffload: {bumped} all-reduce fetch slot(s) rounded to 16 bytes")


class GuardGatheredAlignment:
    """Mixin for ``PartitionedParameterCoordinator``: once a module's parameters are gathered, check the
    detected weights among them (the ZeRO-3 half of the ``alignment_guard``)."""

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # module id -> its detected weights: fetches run per submodule per step, so look once.
        self._safe_zero_guarded_by_module: dict[int, tuple[torch.nn.Parameter, ...]] = {}
        super().__init__(*args, **kwargs)

    @overrides
    def fetch_sub_module(self, current_submodule: torch.nn.Module, forward: bool) -> None:
        super().fetch_sub_module(current_submodule, forward)
        guarded = self._safe_zero_guarded_by_module.get(id(current_submodule))
        if guarded is None:
            guarded = self._safe_zero_guarded_by_module[id(current_submodule)] = self._guarded(current_submodule)
        for param in guarded:
            if param.numel() and param.data_ptr() % ALIGNMENT_BYTES:
                raise AlignmentError(
                    f"safe_zero alignment guard: grouped_mm weight {plan_for(session_for(self)).name(param)} was "
                    f"gathered {param.data_ptr() % ALIGNMENT_BYTES} bytes off the 16-byte grid by ZeRO-3. CUDA "
                    "grouped_mm would fail with 'expected data_ptr to be aligned to 16 bytes'. Put the grouped_mm "
                    "weights in the first optimizer parameter group, or use ZeRO-1/2.")

    def _guarded(self, module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
        """The detected grouped_mm weights of ``module`` (none when the alignment guard is off)."""
        plan = plan_for(session_for(self))
        if not plan.guard:
            return ()
        return tuple(p for p in module.parameters(recurse=False) if plan.needs(p))


__all__ = ["AlignAllReduceFetch", "AlignFlatGroups", "AlignRoundRobinGroups", "AlignStage3SubGroups", "FIX",
           "FLAT_NAMES_KEY", "GuardGatheredAlignment", "LoadsUnpaddedCheckpoints", "ORDER_KEY", "RecordsFlatOrder"]
