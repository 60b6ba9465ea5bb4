"""The one relayout both checkpoint routes use: a flat group moved from one parameter order to another, exactly."""

from __future__ import annotations

import torch

from safe_zero.checkpoint_layout import FlatLayout


def test_a_permutation_moves_whole_parameters_and_keeps_the_tail():
    # Positions in the parameter group, as the permuted route records them; 2 elements of padding after the group.
    numel = {0: 3, 1: 4, 2: 0, 3: 2}
    stock, safe = FlatLayout([0, 1, 2, 3], numel), FlatLayout([1, 3, 0, 2], numel)
    flat = torch.tensor([0.0, 0, 0, 1, 1, 1, 1, 3, 3, 9, 9])
    moved = stock.relaid(flat, safe)
    assert moved.tolist() == [1, 1, 1, 1, 3, 3, 0, 0, 0, 9, 9]
    assert torch.equal(safe.relaid(moved, stock), flat)


def test_by_name_a_layout_may_leave_out_zero_element_parameters():
    numel = {"odd": 3, "experts": 4, "empty": 0}
    saved, mine = FlatLayout(["odd", "empty", "experts"], numel), FlatLayout(["experts", "odd"], numel)
    assert saved.total == mine.total == 7
    assert saved.relaid(torch.arange(7.0), mine).tolist() == [3, 4, 5, 6, 0, 1, 2]
