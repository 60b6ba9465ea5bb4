"""A blocking ZeRO-3 coalesced all-gather that waits only on its last handle (DeepSpeed < 0.19.8, CPU).

gloo may complete the earlier gathers at any time before their handles are waited on; the
stand-in below takes the latest completion gloo allows: an asynchronous all-gather writes NaN
into its output at launch and the real data only when its handle is waited on. Under that
schedule stock DeepSpeed before 0.19.8 hands back NaN parameters (what an unlucky gloo
schedule gave as an ``inf`` loss), and safe_zero gives the same values as without the stand-in.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from packaging.version import Version
from torch import nn

from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import coalesced_gather_wait
from tests.support.models import build, ds_config, train

NEEDED = coalesced_gather_wait.FIX.needed(DEEPSPEED_VERSION)


class Stack(nn.Module):
    """Several parameters per coalesced gather."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


class _CompletesAtWait:

    def __init__(self, run: Any) -> None:
        self._run = run
        self._done = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if not self._done:
            self._run()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


@contextlib.contextmanager
def gathers_complete_at_wait() -> Iterator[None]:
    """Asynchronous all-gathers through ``deepspeed.comm`` complete only when waited on; NaN until then."""
    from deepspeed import comm

    def deferred(stock: Any, output_of: Any) -> Any:
        def launch(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            if not async_op:
                return stock(*args, **kwargs)
            for out in output_of(args, kwargs):
                out.fill_(float("nan"))
            return _CompletesAtWait(lambda: stock(*args, async_op=False, **kwargs))
        return launch

    names = {"all_gather_into_tensor": lambda a, kw: [a[0] if a else kw["output_tensor"]],
             "all_gather": lambda a, kw: a[0] if a else kw["tensor_list"]}
    saved = {name: getattr(comm, name) for name in names}
    for name, output_of in names.items():
        setattr(comm, name, deferred(saved[name], output_of))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


def _engine(safe: bool, **zero: Any) -> tuple[Any, nn.Module]:
    import deepspeed

    import safe_zero

    model = build(Stack)
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(),
                      config=ds_config(3, world_size=2, **zero))
    return engine, model


def gathered_equals_initial(safe: bool, defer: bool) -> dict:
    """``GatheredParameters`` of every parameter at once: do the values equal the model's initial ones?"""
    import deepspeed

    initial = [p.detach().clone() for p in build(Stack).parameters()]
    engine, model = _engine(safe, stage3_param_persistence_threshold=0)
    with gathers_complete_at_wait() if defer else contextlib.nullcontext():
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            got = [p.detach().clone() for p in model.parameters()]
    return {"equal": [torch.equal(g, i.to(g.dtype)) for g, i in zip(got, initial)],
            "nan": [bool(g.isnan().any()) for g in got],
            "report": dict(engine.safe_zero_session.report) if safe else {}}


def train_persistent(safe: bool, defer: bool, steps: int = 3) -> dict:
    """Every parameter persistent: after each step DeepSpeed re-gathers them all in one blocking call."""
    engine, _ = _engine(safe, stage3_param_persistence_threshold=10**6)
    step = engine.step

    def deferred_step(*args: Any, **kwargs: Any) -> Any:
        with gathers_complete_at_wait():
            return step(*args, **kwargs)

    if defer:
        engine.step = deferred_step
    return {"losses": train(engine, steps),
            "report": dict(engine.safe_zero_session.report) if safe else {}}


def test_fix_is_needed_before_0_19_8():
    versions = ["0.18.0", "0.18.9", "0.19.0", "0.19.6", "0.19.7", "0.19.8"]
    assert [coalesced_gather_wait.FIX.needed(Version(v)) for v in versions] == [True] * 5 + [False]


def test_stock_gathered_parameters_under_late_completion(ranks):
    for r in ranks.run(2, gathered_equals_initial, safe=False, defer=True):
        if NEEDED:
            # Only the last parameter's gather was waited on: every other one is still the NaN placeholder.
            assert r["nan"][:-1] == [True] * (len(r["nan"]) - 1) and r["nan"][-1] is False
        else:
            assert all(r["equal"])


def test_safe_zero_gathered_parameters_under_late_completion(ranks):
    for r in ranks.run(2, gathered_equals_initial, safe=True, defer=True):
        assert all(r["equal"]) and not any(r["nan"])
        assert ("coalesced_gather_wait" in r["report"]) == NEEDED


def test_stock_persistent_parameters_under_late_completion(ranks):
    for r in ranks.run(2, train_persistent, safe=False, defer=True):
        assert math.isfinite(r["losses"][0])
        if NEEDED:
            assert not any(math.isfinite(loss) for loss in r["losses"][1:]), r["losses"]
        else:
            assert all(math.isfinite(loss) for loss in r["losses"])


def test_safe_zero_persistent_parameters_train_as_without_late_completion(ranks):
    deferred = ranks.run(2, train_persistent, safe=True, defer=True)
    undisturbed = ranks.run(2, train_persistent, safe=True, defer=False)
    for r, u in zip(deferred, undisturbed):
        assert all(math.isfinite(loss) for loss in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
        assert r["losses"] == u["losses"]  # bit-identical: the same gathers, only completed in time
    assert deferred[0]["losses"] == deferred[1]["losses"]
