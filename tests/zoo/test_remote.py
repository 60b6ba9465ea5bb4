"""The remote-code MoE models of tests/zoo/remote: loaded through ``auto_map`` offline, reproducible, trainable, and
routing the ranks' batches to different experts (an expert a rank's tokens skip is never entered there)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.zoo.remote import REMOTE_MODELS, batch, folder, load

STEPS = 3


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every routed expert: the items of each ``nn.ModuleList`` named ``experts``, by qualified name."""
    found = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, torch.nn.ModuleList):
            found.update({f"{name}.{i}": expert for i, expert in enumerate(module)})
    return found


def _entered(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> set[str]:
    """The experts a forward and backward on ``inputs`` enters (forward hooks), leaving model's grads set."""
    entered: set[str] = set()
    handles = [expert.register_forward_hook(lambda *_, name=name: entered.add(name))
               for name, expert in _experts(model).items()]
    try:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return entered


@pytest.fixture(scope="module", params=REMOTE_MODELS)
def loaded(request) -> tuple[str, torch.nn.Module]:
    return request.param, load(request.param)


def test_loads_through_auto_map(loaded):
    name, model = loaded
    auto_map = json.loads((folder(name) / "config.json").read_text())["auto_map"]
    module, cls = auto_map["AutoModelForCausalLM"].rsplit(".", 1)
    # The class came from the folder's code, copied into transformers' dynamic modules, not from transformers itself.
    assert type(model).__name__ == cls
    assert type(model).__module__.startswith("transformers_modules.") and type(model).__module__.endswith(module)
    assert type(model.config).__module__.startswith("transformers_modules.")
    experts = _experts(model)
    assert len(experts) >= 4 and all(any(isinstance(m, torch.nn.Linear) for m in e.modules()) for e in experts.values())
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.attention_dropout == 0.0
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("name", REMOTE_MODELS)
def test_equal_seeds_equal_weights(name):
    first, again, other = load(name, seed=3), load(name, seed=3), load(name, seed=4)
    for (key, a), b, c in zip(first.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), key
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


def test_batches_are_deterministic():
    for name in REMOTE_MODELS:
        b = batch(name, rank=1, step=2)
        assert b["input_ids"].shape == (2, 16) and torch.equal(b["labels"], b["input_ids"])
        assert all(torch.equal(b[k], v) for k, v in batch(name, rank=1, step=2).items())
        assert not torch.equal(batch(name, rank=0, step=2)["input_ids"], b["input_ids"])
        assert not torch.equal(batch(name, rank=1, step=1)["input_ids"], b["input_ids"])


def test_finite_loss_and_backward(loaded):
    name, model = loaded
    model.zero_grad(set_to_none=True)
    loss = model(**batch(name, rank=0, step=0)).loss
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_ranks_route_to_different_experts(loaded):
    """World size 2: in some step an expert takes rank 0's tokens and none of rank 1's; an expert a batch skips is
    never entered and its parameters get no gradient (None), an entered one gets them all."""
    name, model = loaded
    experts = _experts(model)
    only_rank_0 = set()
    for step in range(STEPS):
        entered = []
        for rank in (0, 1):
            entered.append(_entered(model, batch(name, rank, step)))
            for expert_name, expert in experts.items():
                grads = [p.grad is not None for p in expert.parameters()]
                assert all(grads) if expert_name in entered[-1] else not any(grads), (rank, step, expert_name)
        only_rank_0 |= entered[0] - entered[1]
    assert only_rank_0
