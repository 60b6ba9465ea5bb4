"""The ranks as safe_zero's protocols see them: collectives and the process group's store, behind one interface.

- :class:`Ranks`: what the rank agreement (``fixes.gradless.planner``) and ZeRO-3's module order
  (``fixes.gradless.order``) ask of the other ranks.
- :class:`ProcessGroupRanks`: that on DeepSpeed's process groups and the default store, for one engine.
- :class:`ReplayWorld`: the same for ranks that are threads of one process, which the replay tests drive the
  protocols' own code through: a rank left in a collective the others never make, or one whose collective differs
  from theirs, raises :class:`Hang` there (gloo aborts there; NCCL hangs or computes wrong).
- :func:`default_store` and :meth:`ProcessGroupRanks.prefix`: the store and the one name of an engine in it, which the
  module order and the rank progress (``rank_progress``, through ``uneven_inputs``) both use.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import threading
from collections import defaultdict
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

#: The integer type of an all-gathered row, by the bits its values need: the bytes on the wire are the protocols'
#: cost (``tests/benchmarks/test_costs.py`` counts them).
_DTYPES = {8: torch.uint8, 32: torch.int32, 64: torch.int64}


class InFlight(Protocol):
    """An all-reduce (MIN) started by :meth:`Ranks.all_reduce_min`."""

    def done(self) -> bool:
        """Whether the result is in (without waiting)."""

    def result(self) -> list[int]:
        """The reduced flags (waits for them)."""


class Ranks(Protocol):
    """What safe_zero's protocols ask of the ranks of a data-parallel group."""

    def world_size(self, group: Any) -> int:
        """The ranks in ``group``."""

    def all_gather(self, group: Any, row: list[int], bits: int = 64) -> list[list[int]]:
        """Every rank's ``row`` (the same length everywhere, each value fitting in ``bits``: 8, 32 or 64), in rank
        order."""

    def all_reduce_min(self, group: Any, flags: list[bool]) -> InFlight:
        """Start the MIN all-reduce of one flag per element over ``group``."""

    def prefix(self, group: Any) -> str:
        """The engine's keys in the store (the same on each of ``group``'s ranks, unlike any other engine's)."""

    def meet(self, group: Any, key: str, value: int, timeout: float) -> list[int] | None:
        """Every rank's ``value`` posted under ``key`` (unique to this meeting among this engine's), in rank order,
        without a collective (the process group's store); ``None`` if some rank did not post within ``timeout``
        seconds."""


def default_store() -> Any | None:
    """The default process group's store, or ``None`` where there is none (no process group, or a torch without
    ``_get_default_store``)."""
    store_of = getattr(torch_dist.distributed_c10d, "_get_default_store", None)
    return store_of() if store_of is not None and torch_dist.is_initialized() else None


#: Engines named per group of ranks: the same count on each of its ranks, also where a process builds engines on
#: other groups too.
_NAMED: defaultdict[tuple[int, ...], itertools.count] = defaultdict(itertools.count)


def engine_prefix(group: Any) -> str:
    """A new engine's keys in the store: ``safe_zero/<its ranks, hashed>/<engines named on them before>``, the same
    on each of its ranks. Called once per engine (:meth:`ProcessGroupRanks.prefix`)."""
    ranks = tuple(torch_dist.get_process_group_ranks(group if group is not None else torch_dist.group.WORLD))
    digest = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    return f"safe_zero/{digest}/{next(_NAMED[ranks])}"


class _Flags:
    def __init__(self, flags: torch.Tensor, work: Any) -> None:
        self.flags, self.work = flags, work

    def done(self) -> bool:
        return bool(self.work.is_completed())

    def result(self) -> list[int]:
        self.work.wait()
        return self.flags.tolist()


class ProcessGroupRanks:
    """:class:`Ranks` on DeepSpeed's process groups (its comm backend, where DeepSpeed's own collectives go) and the
    default store. One per engine (``Session.ranks``): it names the engine in the store (:meth:`prefix`) for every
    protocol that meets there."""

    def __init__(self) -> None:
        self._prefix: str | None = None

    def prefix(self, group: Any) -> str:
        """The engine's keys in the store, named on first use by its data-parallel ``group``."""
        if self._prefix is None:
            self._prefix = engine_prefix(group)
        return self._prefix

    @staticmethod
    def world_size(group: Any) -> int:
        return int(dist.get_world_size(group=group))

    @staticmethod
    def all_gather(group: Any, row: list[int], bits: int = 64) -> list[list[int]]:
        mine = torch.tensor(row, dtype=_DTYPES[bits], device=get_accelerator().current_device_name())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(everyone, mine, group=group)
        return [t.tolist() for t in everyone]

    @staticmethod
    def all_reduce_min(group: Any, flags: list[bool]) -> _Flags:
        tensor = torch.tensor(flags, dtype=torch.uint8, device=get_accelerator().current_device_name())
        return _Flags(tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group, async_op=True))

    def meet(self, group: Any, key: str, value: int, timeout: float) -> list[int] | None:
        store = default_store()
        if store is None or torch_dist.get_world_size() < 2:
            return [value]
        key = f"{self.prefix(group)}/{key}"
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        store.set(f"{key}/{rank}", str(value))
        try:
            store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
            return None
        return [int(store.get(f"{key}/{r}")) for r in range(world)]


class Hang(Exception):
    """A replayed rank waited for a collective the other ranks did not make, or made another one."""


class ReplayWorld:
    """Ranks that are threads of one process: the k-th collective of every rank meets the k-th of the others, and a
    store. ``timeout``: seconds a collective waits for the other ranks before it raises :class:`Hang`."""

    def __init__(self, size: int, timeout: float = 2.0) -> None:
        self.size, self.timeout = size, timeout
        #: Per collective number, each rank's ``(kind, value)``.
        self.posts: dict[int, dict[int, tuple[str, Any]]] = {}
        self.store: dict[str, dict[int, int]] = {}
        self.changed = threading.Condition()

    def rank(self, rank: int, late: bool = False) -> ReplayRanks:
        """Rank ``rank``'s :class:`Ranks` (``late``: its all-reduces land only when waited for)."""
        return ReplayRanks(self, rank, late)

    def post(self, rank: int, k: int, kind: str, value: Any) -> None:
        with self.changed:
            self.posts.setdefault(k, {})[rank] = (kind, value)
            self.changed.notify_all()

    def complete(self, k: int) -> bool:
        with self.changed:
            return len(self.posts.get(k, {})) == self.size

    def values(self, k: int) -> list[Any]:
        """Every rank's value of collective ``k``, once all made it; :class:`Hang` where one did not in time, or
        made another kind of collective."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.posts.get(k, {})) == self.size, timeout=self.timeout):
                raise Hang(f"collective #{k}: only ranks {sorted(self.posts.get(k, {}))} made it")
            kinds = {kind for kind, _ in self.posts[k].values()}
            if len(kinds) > 1:
                raise Hang(f"collective #{k} mismatched: {self.posts[k]}")
            return [self.posts[k][r][1] for r in range(self.size)]


class _ReplayFlags:
    def __init__(self, world: ReplayWorld, k: int, late: bool) -> None:
        self.world, self.k, self.late = world, k, late

    def done(self) -> bool:
        return not self.late and self.world.complete(self.k)

    def result(self) -> list[int]:
        return [min(column) for column in zip(*self.world.values(self.k))]


class ReplayRanks:
    """One rank of a :class:`ReplayWorld`: :class:`Ranks`, and :meth:`collective` for a stand-in's own collectives
    (DeepSpeed's parameter gathers, its trace check). ``kinds`` lists the collectives it made, ``count`` how many of
each kind and length (``"all_gather/1"``)."""

    def __init__(self, world: ReplayWorld, rank: int, late: bool) -> None:
        self.world, self.rank, self.late = world, rank, late
        self.kinds: list[str] = []
        self.count: dict[str, int] = {}

    def collective(self, kind: str, value: Any, alike: bool = False) -> list[Any]:
        """Every rank's ``value`` of this rank's next collective (``alike``: :class:`Hang` unless all are equal)."""
        values = self.world.values(self._post(kind, value))
        if alike and any(v != values[0] for v in values):
            raise Hang(f"collective #{len(self.kinds) - 1} ({kind}): the ranks made it with {values}")
        return values

    def _post(self, kind: str, value: Any) -> int:
        k, sized = len(self.kinds), f"{kind}/{len(value)}"
        self.kinds.append(kind)
        self.count[sized] = self.count.get(sized, 0) + 1
        self.world.post(self.rank, k, sized, value)
        return k

    def world_size(self, group: Any) -> int:
        return self.world.size

    @staticmethod
    def prefix(group: Any) -> str:
        return "replay"

    def all_gather(self, group: Any, row: list[int], bits: int = 64) -> list[list[int]]:
        assert all(0 <= v < 1 << bits if bits == 8 else -(1 << bits - 1) <= v < 1 << bits - 1 for v in row), row
        return self.collective("all_gather", row)

    def all_reduce_min(self, group: Any, flags: list[bool]) -> _ReplayFlags:
        return _ReplayFlags(self.world, self._post("all_reduce", [int(f) for f in flags]), self.late)

    def meet(self, group: Any, key: str, value: int, timeout: float) -> list[int] | None:
        world = self.world
        with world.changed:
            posts = world.store.setdefault(key, {})
            posts[self.rank] = value
            world.changed.notify_all()
            if not world.changed.wait_for(lambda: len(posts) == world.size, timeout):
                return None
            return [posts[r] for r in range(world.size)]


__all__ = ["Hang", "InFlight", "ProcessGroupRanks", "Ranks", "ReplayRanks", "ReplayWorld", "default_store",
           "engine_prefix"]
