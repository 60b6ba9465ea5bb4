"""``collectives.Reachability``: what the planner asks autograd, at each backward's first hook (ZeRO-1/2)."""

import torch

from safe_zero.fixes.gradless.gradients import Reachability


def test_held_accumulators_answer_each_backward_afresh():
    """With the accumulators held, a walk's ask about the same parameter list in each backward reuses them (no
    lookup per parameter) and still gets each backward's own answer; another list is looked up again."""
    a, b, c = (torch.nn.Parameter(torch.randn(2)) for _ in range(3))
    order = [a, b, c]
    reach = Reachability(hold=True)
    answers = []
    a.register_post_accumulate_grad_hook(lambda _: answers.append(reach(order)))
    (a * b).sum().backward()
    (a * c).sum().backward()
    (a * b * c).sum().backward()
    assert answers == [[True, True, False], [True, False, True], [True, True, True]]
    assert reach._last is not None and reach._last[0] is order
    other = [c, a]
    a.register_post_accumulate_grad_hook(lambda _: answers.append(reach(other)))
    (a * b).sum().backward()
    assert answers[-2:] == [[True, True, False], [False, True]]


def test_unheld_accumulators_are_found_in_each_ask():
    """ZeRO-3 (``hold=False``): nothing is kept between asks."""
    a, b = (torch.nn.Parameter(torch.randn(2)) for _ in range(2))
    reach = Reachability(hold=False)
    answers = []
    a.register_post_accumulate_grad_hook(lambda _: answers.append(reach([a, b])))
    (a * 2).sum().backward()
    (a * b).sum().backward()
    assert answers == [[True, False], [True, True]] and reach._last is None
