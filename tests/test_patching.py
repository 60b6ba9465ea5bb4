"""swapped(): the one way safe_zero rebinds a global; the previous binding, and the previous session, come back."""

import threading
import types

import pytest


def test_swapped_restores_the_previous_binding_also_on_error_and_when_nested():
    from safe_zero.patching import swapped

    owner = types.SimpleNamespace(name="stock")
    with pytest.raises(KeyError):
        with swapped(owner, "name", "outer") as previous:
            assert previous == "stock" and owner.name == "outer"
            with swapped(owner, "name", "inner") as previous:
                assert previous == "outer" and owner.name == "inner"
            assert owner.name == "outer"
            raise KeyError
    assert owner.name == "stock"
    with swapped(owner, "absent", 1):
        assert owner.absent == 1
    assert not hasattr(owner, "absent")


def test_swapped_holds_the_lock_so_another_thread_waits():
    from safe_zero.patching import swapped

    owner = types.SimpleNamespace(name="stock")
    seen = []

    def theirs():
        with swapped(owner, "name", "theirs") as previous:
            seen.append(previous)

    with swapped(owner, "name", "ours"):
        thread = threading.Thread(target=theirs)
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and owner.name == "ours"  # waiting for the lock
    thread.join(5)
    assert seen == ["stock"]  # it swapped only after ours was restored


def test_injection_restores_the_session_that_was_current_before():
    from safe_zero.injection import injected
    from safe_zero.session import Session, current_session, made_current

    outer, inner = Session(), Session()
    with made_current(outer):
        with injected(inner, bindings=()):
            assert current_session() is inner
        assert current_session() is outer  # was None after an injection, whatever was current before
    assert current_session() is None


def test_pass_through_skips_a_leading_run_of_idle_overrides_and_resume_undoes_it():
    from safe_zero.patching import pass_through, resume

    calls = []

    class Stock:
        def step(self):
            calls.append("stock")

    class Outer:
        def step(self):
            calls.append("outer")
            super().step()

    class Inner:
        def step(self):
            calls.append("inner")
            super().step()

    class Safe(Outer, Inner, Stock):
        pass

    def run(obj):
        calls.clear()
        obj.step()
        return list(calls)

    obj = Safe()
    pass_through(obj, "step", Inner)
    assert run(obj) == ["outer", "inner", "stock"], "an idle override inside the chain still runs"
    pass_through(obj, "step", Outer)
    assert run(obj) == ["stock"]
    resume(obj, "step", Inner)
    assert run(obj) == ["inner", "stock"]
    resume(obj, "step", Outer)
    assert run(obj) == ["outer", "inner", "stock"] and "step" not in vars(obj)
    assert run(Safe()) == ["outer", "inner", "stock"], "per instance"
