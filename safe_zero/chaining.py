"""Calling whatever is bound to ``deepspeed.initialize`` (a profiler, a tracer, a test mock) with safe_zero's classes.

The integrations (Lightning's strategies, the Accelerate dispatcher) take over
``deepspeed.initialize``. Someone else may have wrapped it first. Skipping that wrapper would
silently drop the profiler or the mock; refusing would make safe_zero unusable beside them. So the
integrations call the wrapper they found, and what it calls further down (DeepSpeed's own
``initialize``) runs with safe_zero's classes injected, exactly as :func:`safe_zero.initialize` runs it.
"""

from __future__ import annotations

from typing import Any, Callable

from safe_zero import injection

#: safe_zero's own functions that may sit on ``deepspeed.initialize``: they go through safe_zero already.
_ROUTES: list[Callable[..., Any]] = [injection._installed_initialize]


def register_route(route: Callable[..., Any]) -> None:
    """Declare a function safe_zero binds to ``deepspeed.initialize`` that itself goes through safe_zero."""
    if route not in _ROUTES:
        _ROUTES.append(route)


def routes_through_safe_zero(fn: Any) -> bool:
    """Whether ``fn`` is one of safe_zero's own routes, or a ``functools.wraps`` wrapper around one."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        if any(fn is route for route in _ROUTES):
            return True
        seen.add(id(fn))
        fn = vars(fn).get("__wrapped__") if hasattr(fn, "__dict__") else None
    return False


def initialize_through(outer: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
    """:func:`safe_zero.initialize` that calls ``outer`` where it would call DeepSpeed's own ``initialize``.

    ``outer`` is what was bound to ``deepspeed.initialize`` before the integration took it over.
    DeepSpeed's own function, or one of safe_zero's routes, is not called twice: then this is plain
    :func:`safe_zero.initialize`. A foreign ``outer`` runs once, inside the injection; the
    ``deepspeed.initialize`` it calls (DeepSpeed's, captured when it wrapped it) builds safe_zero's
    classes. Whatever ``outer`` returns is checked like DeepSpeed's own result.
    """
    if outer is injection.STOCK_INITIALIZE or routes_through_safe_zero(outer):
        return injection.initialize(*args, **kwargs)
    # A safe_zero.initialize that ``outer`` may reach in turn calls DeepSpeed's own: no loop.
    return injection.initialize_calling(outer, *args, **kwargs)
