"""Ranks replayed as threads of one process (the store and the replay world's tests)."""

from __future__ import annotations

import threading
from typing import Any, Callable


def on_threads(*actions: Callable[[], Any], timeout: float = 30) -> list[Any]:
    """Run each rank's actions on its own thread; each rank's result, or the exception it raised."""
    results: list[Any] = [None] * len(actions)

    def run(rank: int) -> None:
        try:
            results[rank] = actions[rank]()
        except Exception as error:  # noqa: BLE001 - the replay compares each rank's outcome
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(actions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    return results
