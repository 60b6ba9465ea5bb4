"""The ranks' module entries while DeepSpeed records its ZeRO-3 module order, kept in lockstep where they diverge,
and the modules some ranks skipped found from them (docs/rank_agreement.md, "Modules some ranks skip").

Pure logic, no torch: ``order.ModuleOrder`` feeds it what the ranks announced and carries
out what it returns, and the tests replay per-rank module sequences through it in one process.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

#: What a rank announces once its forward is over, while another rank still has modules to enter.
END = -1


def read_of(module: int) -> int:
    """What a rank announces before it reads a parameter of ``module`` that is not gathered, outside the module's
    own entry (``self.proj.weight.dtype`` before calling ``self.proj``; a weight of another module): DeepSpeed would
    gather that parameter alone, a collective unlike the module's fetch, so it is told apart from an entry."""
    return END - 1 - module


def module_of(announcement: int) -> int:
    """The module an announcement is about (``END`` stays ``END``)."""
    return announcement if announcement >= END else END - 1 - announcement


def module_to_gather(announced: Sequence[int], order: Mapping[int, int]) -> int | None:
    """One round: every rank announced the module it is about to gather or read (``END``: its forward is over).

    ``None`` where all announced the same: each goes on with its own gather, as DeepSpeed does. Otherwise every
    rank gathers the returned module's parameters together, the ranks that announced it (entry or read) go on with
    it gathered, and the others announce theirs again. The module first in ``order`` (the model's ``named_modules``
    order, which is usually its forward order: a tower before the model it feeds) goes first, and ``END`` last, so
    every round lets at least one rank on and the rounds end once every rank announced ``END``.
    """
    if len(set(announced)) == 1:
        return None
    first = min(announced, key=lambda a: (a == END, order.get(module_of(a), len(order))))
    return module_of(first)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _partial(per_rank: Sequence[Iterable[str]]) -> set[str]:
    first, *rest = [set(names) for names in per_rank]
    return first.union(*rest) - first.intersection(*rest)


def _runs_differ(runs: Sequence[Mapping[str, int]]) -> set[str]:
    names = set().union(*runs)
    return {name for name in names if len({counts.get(name, 0) for counts in runs}) > 1}


def skipped_modules(entered: Sequence[Iterable[str]], alternatives: Iterable[str] = (),
                    read: Sequence[Iterable[str]] = (), runs: Sequence[Mapping[str, int]] = ()) -> list[str]:
    """The outermost modules (qualified names) that some ranks entered in a forward and others did not, entered a
    different number of times, or whose parameters some ranks read from outside them and others did not.

    ``entered``: per rank, the modules its forward entered (hooks fired); ``read``: per rank, the modules whose
    parameters it read outside their own entry (``read_of``); ``runs``: per rank, how often it entered each module
    (a tower run once for an image and once for a video). A member of one of the ``alternatives`` (an
    ``nn.ModuleList``/``ModuleDict`` of experts, which the forward indexes but never calls) stands for the whole
    container: another member may be skipped by other ranks next time.
    """
    partial = _partial(entered) | (_partial(read) if read else set()) | (_runs_differ(runs) if runs else set())
    alternatives = set(alternatives)
    found: set[str] = set()
    for name in partial:
        while name and _parent(name) in partial:
            name = _parent(name)
        found.add(_parent(name) if name and _parent(name) in alternatives else name)
    return sorted(n for n in found if not any(n.startswith(f"{outer}.") for outer in found))


__all__ = ["END", "module_of", "module_to_gather", "read_of", "skipped_modules"]
