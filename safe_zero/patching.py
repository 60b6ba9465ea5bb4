"""The patching primitives: one lock, one way to rebind a global (for a call or until undone), and marked overrides.

A leaf module (it imports nothing of safe_zero but :mod:`safe_zero.errors`): the injection, the
integrations and ``safe_zero.Init`` all rebind DeepSpeed globals, and do it only through :func:`swap` or
:func:`swapped`, under :data:`LOCK`, so nested and concurrent swaps restore what was there before.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterable, Iterator, TypeVar

from safe_zero.errors import DeepSpeedDriftError

#: Held while any global is swapped; re-entrant, so a swap inside a swap (initialize inside zero.Init) works.
LOCK = threading.RLock()

_MISSING = object()


def swap(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Bind ``owner.name`` to ``value`` now; return the function that puts the previous binding back.

    For a binding that outlives one call (``install()`` until ``uninstall()``); a scoped one is :func:`swapped`.
    """
    with LOCK:
        previous = getattr(owner, name, _MISSING)
        setattr(owner, name, value)

    def restore() -> None:
        with LOCK:
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

    return restore


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` bound to ``value`` for the ``with`` block, under :data:`LOCK`; the previous binding after.

    Holds the lock for the whole block, so another thread's swap of the same name waits instead of
    interleaving. Yields the previous value (``None`` where there was none).
    """
    with LOCK:
        previous = getattr(owner, name, None)
        restore = swap(owner, name, value)
        try:
            yield previous
        finally:
            restore()


F = TypeVar("F", bound=Callable[..., Any])

_OVERRIDES = "__safe_zero_overrides__"


def overrides(method: F) -> F:
    """Mark a mixin method that overrides a DeepSpeed method and calls it through ``super()``.

    :func:`verify_overrides` checks at import that DeepSpeed still has the method and that its
    signature still takes the arguments the override passes on; unmarked, a renamed DeepSpeed
    method would leave the fix silently off.
    """
    setattr(method, _OVERRIDES, True)
    return method


_CALLS = "__safe_zero_calls__"

M = TypeVar("M", bound=type)


def calls(*names: str) -> Callable[[M], M]:
    """Mark a mixin that calls these methods of the DeepSpeed class it extends without overriding them:
    :func:`verify_overrides` checks at import that DeepSpeed still has them."""
    def mark(mixin: M) -> M:
        setattr(mixin, _CALLS, names)
        return mixin
    return mark


def pass_through(obj: Any, name: str, mixin: type) -> None:
    """``mixin``'s override of method ``name`` has nothing to do on ``obj``: skip it where it leads the chain.

    DeepSpeed calls some methods per module or per parameter every step; an override with nothing to do for this
    model still costs a Python call there. ``obj.name`` is bound on the instance to the first override in the
    class's order whose mixin has not passed through (only a leading run can be skipped: an override inside the
    chain still calls the next with ``super()``). :func:`resume` undoes it.
    """
    idle = obj.__dict__.setdefault("_safe_zero_idle", {}).setdefault(name, set())
    idle.add(mixin)
    _bind_first_busy(obj, name, idle)


def resume(obj: Any, name: str, mixin: type) -> None:
    """``mixin``'s override of ``name`` has something to do on ``obj`` again (after :func:`pass_through`)."""
    idle = obj.__dict__.get("_safe_zero_idle", {}).get(name, set())
    idle.discard(mixin)
    _bind_first_busy(obj, name, idle)


def _bind_first_busy(obj: Any, name: str, idle: set[type]) -> None:
    owners = [klass for klass in type(obj).__mro__ if name in vars(klass)]
    first = next(klass for klass in owners if klass not in idle)
    if first is owners[0]:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = vars(first)[name].__get__(obj, type(obj))


def is_override(method: Any) -> bool:
    return getattr(method, _OVERRIDES, False)


def stock_class(safe: type) -> type:
    """The DeepSpeed class a safe class extends: its last base (the mixins come first)."""
    return safe.__bases__[-1]


def marked_overrides(safe: type) -> Iterator[tuple[type, str, Callable[..., Any]]]:
    """(mixin, name, function) for every marked override in the mixins of ``safe``."""
    stock = stock_class(safe)
    for mixin in safe.__mro__:
        if mixin is stock or issubclass(stock, mixin):
            break
        for name, member in vars(mixin).items():
            if is_override(member):
                yield mixin, name, member


def _passes(method: Callable[..., Any]) -> tuple[list[str], list[str]]:
    """The named positional and the keyword-only parameters of ``method`` (without ``self``)."""
    params = list(inspect.signature(method).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    return positional, keyword


def _undecorated(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Method ``name`` without its decorators, where they hide its signature behind ``(*args, **kwargs)``.

    DeepSpeed's ``instrument_w_nvtx`` does not set ``__wrapped__``; the function it decorates is
    then the closure cell of that name.
    """
    fn = inspect.unwrap(fn)
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and getattr(inner, "__name__", None) == name and inner is not fn:
            return _undecorated(inner, name)
    return fn


def check_override(safe: type, mixin: type, name: str, method: Callable[..., Any]) -> None:
    """Raise :class:`DeepSpeedDriftError` unless ``stock_class(safe).name`` exists and takes what ``method`` passes."""
    stock = stock_class(safe)
    where = f"{stock.__module__}.{stock.__qualname__}.{name}"
    fixed_by = f"safe_zero's {mixin.__qualname__}.{name}"
    target = getattr(stock, name, None)
    if not callable(target):
        raise DeepSpeedDriftError(
            f"{where} is gone; {fixed_by} overrides it and would silently stop applying its fix. "
            "This DeepSpeed has drifted from what safe_zero supports; install a supported release.")
    target = _undecorated(target, name)
    positional, keyword = _passes(method)
    stock_params = list(inspect.signature(target).parameters.values())[1:]
    stock_positional = [p.name for p in stock_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_more = any(p.kind is p.VAR_POSITIONAL for p in stock_params)
    renamed = [(ours, theirs) for ours, theirs in zip(positional, stock_positional) if ours != theirs]
    missing = positional[len(stock_positional):] if not takes_more else []
    try:
        inspect.signature(target).bind_partial(None, *positional, **{k: None for k in keyword})
    except TypeError as error:
        missing = missing or [str(error)]
    if renamed or missing:
        found = f"{name}{inspect.signature(target)}"
        raise DeepSpeedDriftError(
            f"{where} changed its signature to {found}; {fixed_by} passes "
            f"({', '.join(positional + keyword)}) and would no longer fix what it fixes. "
            "This DeepSpeed has drifted from what safe_zero supports; install a supported release.")


def verify_overrides(classes: Iterable[type]) -> None:
    """Check every marked override of the mixins of ``classes`` against the DeepSpeed class it extends."""
    for safe in classes:
        for mixin, name, method in marked_overrides(safe):
            check_override(safe, mixin, name, method)
        stock = stock_class(safe)
        for mixin in safe.__mro__[:safe.__mro__.index(stock)]:
            for name in vars(mixin).get(_CALLS, ()):
                if not callable(getattr(stock, name, None)):
                    raise DeepSpeedDriftError(
                        f"{stock.__module__}.{stock.__qualname__}.{name} is gone; safe_zero's {mixin.__qualname__} "
                        "calls it. This DeepSpeed has drifted from what safe_zero supports; install a supported "
                        "release.")
