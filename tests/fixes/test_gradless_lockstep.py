"""The lockstep of a recording forward where ranks enter different modules, replayed in one process.

Each rank's forward is a sequence of module entries (names, in the model's ``named_modules`` order below); every
round each rank announces its next one (``END`` once done) and ``module_to_gather`` says what all gather together.
The replay checks what the real ranks rely on: every rank enters its own modules in its own order, each gather is
one every rank makes, the rounds end, and a rank gathers nothing it does not need where the model's order is its
forward order. ``skipped_modules`` is checked on the sets the replays leave.
"""

from __future__ import annotations

import pytest

from safe_zero.fixes.gradless.lockstep import END, module_of, module_to_gather, read_of, skipped_modules

#: A VLM-shaped model in ``named_modules`` order: a tower before the language model it feeds.
VLM = ["", "tower", "tower.patch", "tower.blocks", "tower.blocks.0", "tower.blocks.1", "lm", "lm.embed",
       "lm.layers", "lm.layers.0", "lm.layers.1", "lm.head"]
WITH_IMAGE = ["tower.patch", "tower.blocks.0", "tower.blocks.1", "lm.embed", "lm.layers.0", "lm.layers.1", "lm.head"]
TEXT_ONLY = ["lm.embed", "lm.layers.0", "lm.layers.1", "lm.head"]


def replay(forwards: list[list[str]], names: list[str]) -> list[str]:
    """The gathers every rank makes together, in order, while each rank enters ``forwards[rank]`` (``"read:x"``: it
    reads a parameter of ``x`` outside ``x``'s entry)."""
    ids = {name: i for i, name in enumerate(names)}
    order = {i: i for i in ids.values()}
    done = [0] * len(forwards)
    entered: list[list[str]] = [[] for _ in forwards]
    gathers = []

    def announce(event: str) -> int:
        return read_of(ids[event[5:]]) if event.startswith("read:") else ids[event]

    for _ in range(10 * sum(map(len, forwards)) + 10):
        announced = [announce(f[k]) if k < len(f) else END for f, k in zip(forwards, done)]
        chosen = module_to_gather(announced, order)
        if chosen is None and announced[0] == END:
            assert entered == forwards, "every rank entered its own modules, in its own order"
            return gathers
        chosen = module_of(announced[0]) if chosen is None else chosen
        assert chosen != END
        gathers.append(names[chosen])
        for rank, announcement in enumerate(announced):
            if module_of(announcement) == chosen:
                entered[rank].append(forwards[rank][done[rank]])
                done[rank] += 1
    raise AssertionError(f"the rounds did not end: {gathers}")


def entered(forward: list[str], alternatives: list[str] = ()) -> set[str]:
    """The modules whose hooks fire in ``forward``: its modules and the containers that call them."""
    ancestors = {name.rsplit(".", k)[0] for name in forward for k in range(1, name.count(".") + 1)}
    return {"", *forward, *(ancestors - set(alternatives))}


def test_ranks_that_agree_gather_each_module_once():
    assert replay([TEXT_ONLY, TEXT_ONLY], VLM) == TEXT_ONLY


@pytest.mark.parametrize("forwards", [[WITH_IMAGE, TEXT_ONLY], [TEXT_ONLY, WITH_IMAGE],
                                      [WITH_IMAGE, TEXT_ONLY, WITH_IMAGE], [TEXT_ONLY, TEXT_ONLY, WITH_IMAGE]])
def test_a_tower_some_ranks_skip_costs_no_extra_gather_where_it_comes_first(forwards):
    """The ranks without an image serve the tower's gathers and wait at ``lm.embed``: nothing is gathered twice
    and no rank holds the language model's modules ahead of its own forward."""
    assert replay(forwards, VLM) == WITH_IMAGE
    alternatives = ["tower.blocks", "lm.layers"]  # ModuleLists: indexed, never called
    assert skipped_modules([entered(f, alternatives) for f in forwards], alternatives) == ["tower"]


@pytest.mark.parametrize("forwards", [[["read:tower.patch"] + WITH_IMAGE, TEXT_ONLY],
                                      [TEXT_ONLY, ["read:tower.patch"] + WITH_IMAGE, TEXT_ONLY]])
def test_a_tower_read_before_any_entry_is_served_like_an_entry(forwards):
    """A tower whose first module has no parameters of its own reads its child's weight (Qwen2-VL's
    ``self.proj.weight.dtype``): the read is announced, the others serve it, and the tower is found skipped."""
    assert replay(forwards, VLM) == ["tower.patch"] + WITH_IMAGE
    alternatives = ["tower.blocks", "lm.layers"]
    entries = [[e for e in f if not e.startswith("read:")] for f in forwards]
    reads = [{e[5:] for e in f if e.startswith("read:")} for f in forwards]
    assert skipped_modules([entered(f, alternatives) for f in entries], alternatives, reads) == ["tower"]


def test_a_read_and_an_entry_of_one_module_share_one_gather():
    """Announced apart (DeepSpeed gathers a read parameter alone, an entered module whole), served together."""
    assert replay([["read:lm.embed", "lm.head"], ["lm.embed", "lm.head"]], VLM) == ["lm.embed", "lm.head"]


def test_a_weight_read_outside_its_module_on_some_ranks_is_kept_gathered():
    """Every rank enters ``lm.embed``; the ranks with an image also read its weight from the tower: what they read
    is kept gathered with the tower, or the next forward would diverge again at the same read."""
    with_image = ["lm.embed", "tower.patch", "read:lm.embed", "lm.head"]
    text_only = ["lm.embed", "lm.head"]
    assert replay([with_image, text_only], VLM) == ["lm.embed", "tower.patch", "lm.embed", "lm.head"]
    entries = [entered(["lm.embed", "tower.patch", "lm.head"]), entered(text_only)]
    assert skipped_modules(entries, (), [{"lm.embed"}, set()]) == ["lm.embed", "tower"]


def test_a_model_registered_out_of_forward_order_still_lines_up():
    """The tower registered after the language model it feeds: the text-only rank runs ahead while the other
    serves; then the other runs the tower and gathers the language model's modules again. More gathers, the same
    modules entered, and the rounds end."""
    names = ["", "lm", "lm.embed", "lm.head", "tower", "tower.patch"]
    with_image, text_only = ["tower.patch", "lm.embed", "lm.head"], ["lm.embed", "lm.head"]
    assert replay([with_image, text_only], names) == ["lm.embed", "lm.head", "tower.patch", "lm.embed", "lm.head"]


def test_experts_each_rank_routes_differently():
    names = ["", "router", "experts", "experts.0", "experts.1", "experts.2", "experts.3", "head"]
    forwards = [["router", "experts.0", "experts.1", "head"], ["router", "experts.1", "experts.2", "head"],
                ["router", "experts.3", "head"]]
    gathers = replay(forwards, names)
    assert gathers == ["router", "experts.0", "experts.1", "experts.2", "experts.3", "head"]
    sets = [entered(f, ["experts"]) for f in forwards]
    assert skipped_modules(sets, alternatives=["experts"]) == ["experts"], "one member skipped: all kept"
    assert skipped_modules(sets) == ["experts.0", "experts.1", "experts.2", "experts.3"]  # rank 2 skips 1


def test_modules_every_rank_enters_in_another_order_are_not_skipped():
    names = ["", "a", "b"]
    assert replay([["a", "b"], ["b", "a"]], names) == ["a", "b", "a"]
    assert skipped_modules([{"", "a", "b"}, {"", "b", "a"}]) == []


def test_the_outermost_skipped_module_stands_for_what_it_holds():
    assert skipped_modules([entered(["lm.embed", "tower.patch", "tower.blocks.0"]), entered(["lm.embed"])]) == ["tower"]
    assert skipped_modules([{"", "a", "a.b"}, {"", "a"}, {"", "a", "a.c"}]) == ["a.b", "a.c"]


def test_a_module_run_a_different_number_of_times_is_kept_gathered():
    """An image and a video through one tower on rank 0, an image on rank 1: both entered it, not as often."""
    entered = [{"", "tower", "tower.0", "head"}] * 2
    runs = [{"": 1, "tower": 2, "tower.0": 2, "head": 1}, {"": 1, "tower": 1, "tower.0": 1, "head": 1}]
    assert skipped_modules(entered, (), (), runs) == ["tower"]
    assert skipped_modules(entered, (), (), [runs[0], runs[0]]) == []
