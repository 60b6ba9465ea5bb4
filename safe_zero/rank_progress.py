"""Where each rank stands in training, posted to the process group's store: a rank that leaves training (a checkpoint
save, the engine's ``destroy``) sees a rank that went on without it, instead of hanging in a collective that rank
waits in.

Without ``Join``, a rank that ran out of batches goes on to its save while the others begin another micro-step and
wait in its first collective for good (NCCL) or until gloo sees the peer gone. Nothing in a collective can tell them
apart from a slow rank; the store can, at a cost the training steps barely carry:

- A rank beginning micro-step ``m + 1`` posts ``m + 1`` once, with a ``set`` (the store does not answer it): one
  small message per rank per micro-step, no wait and no collective. The posts go round a ring of slots (one per
  micro-step the ranks can be apart, plus two), so the store holds a fixed number of keys.
- A rank at a meeting (``save_checkpoint``, the ZeRO-3 16-bit state dict: every rank makes them) after micro-step
  ``m`` waits for every rank to arrive after the same micro-step; if one posted that it began micro-step ``m + 1``,
  or arrived after another micro-step, every rank there raises :class:`UnevenInputsError` (one waiting in that
  micro-step's collective stops when the raising rank's process ends: gloo sees the peer gone, a launcher ends the
  job). A rank that never comes is waited for as long as the process group waits in a collective (stock's wait).
- A rank leaving without a meeting (``destroy``, which makes no collective) raises if a rank already posted a later
  micro-step; it does not wait, as stock does not.

What it cannot see: a rank that leaves by other ways (its process ends, a barrier, the process group destroyed)
before the others post their next micro-step. This module imports nothing of DeepSpeed or torch: ``uneven_inputs``
hands it the store and the engine's keys there (``safe_zero.ranks``), and the replays (``tests/test_rank_progress.py``)
run it over torch's ``HashStore`` with one thread per rank.
"""

from __future__ import annotations

import time
from typing import Any

from safe_zero.errors import UnevenInputsError

#: The longest sleep between two looks at the store while a rank waits at a meeting (seconds).
LONGEST_POLL = 0.05


#: What every uneven-input error tells the user to do instead.
USE_JOIN = ("Train inside `with torch.distributed.algorithms.Join([engine]):` (Accelerate: `with "
            "accelerator.join_uneven_inputs([model], even_batches=False):`) so that a rank that runs out of batches "
            "shadows the others' steps with a zero gradient, and save after the Join block; or give every rank the "
            "same number of batches.")


class RankProgress:
    """One engine's posts and meetings in ``store`` (keys under ``prefix``), as rank ``rank`` of ``world``.

    ``slots``: how many micro-steps apart the ranks can be plus two (gradient accumulation steps + 2: ZeRO-1 makes no
    collective between boundaries). ``timeout``: seconds a meeting waits for a rank that does not come.
    """

    __slots__ = ("store", "rank", "world", "prefix", "slots", "timeout", "began", "meetings")

    def __init__(self, store: Any, rank: int, world: int, prefix: str, slots: int, timeout: float) -> None:
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix
        self.slots, self.timeout = slots, timeout
        #: The micro-step this rank last posted it began (0: none).
        self.began = 0
        #: Meetings held so far: the next one's number (the same on every rank, as every rank makes them).
        self.meetings = 0

    def begin(self, micro_steps: int) -> None:
        """This rank, ``micro_steps`` micro-steps done, begins the next one: post it (once per micro-step)."""
        if self.began != micro_steps + 1:
            self.began = micro_steps + 1
            self.store.set(self._slot(self.began), str(self.began))

    def leave(self, micro_steps: int, where: str) -> None:
        """This rank leaves training at ``where`` after ``micro_steps``, without waiting for the others: raise if one
        of them already posted a later micro-step."""
        ahead = self._posted_after(micro_steps)
        if ahead is not None:
            raise UnevenInputsError(self._went_on(where, micro_steps, ahead))

    def meet(self, micro_steps: int, where: str) -> None:
        """Wait at ``where`` until every rank arrives after ``micro_steps`` micro-steps; raise if a rank began a later
        one, arrived after another number, or did not come within the timeout."""
        base = f"{self.prefix}/meet{self.meetings}"
        self.meetings += 1
        self.store.set(f"{base}/rank{self.rank}", str(micro_steps))
        arrived_alike = f"{base}/at{micro_steps}"
        self.store.add(arrived_alike, 1)  # before "all": whoever counts all arrived also finds this one counted
        self.store.add(f"{base}/all", 1)
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while True:
            arrived = int(self.store.add(f"{base}/all", 0))
            if int(self.store.add(arrived_alike, 0)) == self.world:
                return
            ahead = self._posted_after(micro_steps)
            if ahead is not None:
                raise UnevenInputsError(self._went_on(where, micro_steps, ahead))
            if arrived == self.world:
                raise UnevenInputsError(self._arrived_apart(base, where))
            if time.monotonic() > deadline:
                raise UnevenInputsError(self._never_came(base, where, micro_steps))
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_POLL)

    def _slot(self, micro_step: int) -> str:
        return f"{self.prefix}/began{micro_step % self.slots}"

    def _posted_after(self, micro_steps: int) -> int | None:
        """The later micro-step a rank posted it began, or ``None``. If this rank posted the next one itself (a
        forward it did not step), the slot cannot tell whose post it holds: the counts decide then."""
        key = self._slot(micro_steps + 1)
        if self.began == micro_steps + 1 or not self.store.check([key]):
            return None
        posted = int(self.store.get(key))
        return posted if posted > micro_steps else None

    def _went_on(self, where: str, micro_steps: int, ahead: int) -> str:
        return (f"rank {self.rank} reached {where} after micro-step {micro_steps} while another rank began micro-step "
                f"{ahead}: the ranks ran different numbers of batches, and that rank now waits in a collective this "
                f"rank will not make (stock DeepSpeed hangs here, or aborts on gloo). {USE_JOIN}")

    def _arrived_apart(self, base: str, where: str) -> str:
        steps = {r: int(self.store.get(f"{base}/rank{r}")) for r in range(self.world)}
        return (f"the ranks reached {where} after different numbers of micro-steps ({_by_rank(steps)}): they ran "
                f"different numbers of batches, which the saved state would not say. {USE_JOIN}")

    def _never_came(self, base: str, where: str, micro_steps: int) -> str:
        missing = [r for r in range(self.world) if not self.store.check([f"{base}/rank{r}"])]
        return (f"rank {self.rank} waited {self.timeout:.0f} s at {where} after micro-step {micro_steps} for rank(s) "
                f"{', '.join(map(str, missing))}, which neither came nor posted a later micro-step: if they are still "
                f"training, the ranks ran different numbers of batches. {USE_JOIN}")


def _by_rank(values: dict[int, int]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in values.items())


__all__ = ["RankProgress", "UnevenInputsError"]
