"""Parameters that some ranks use and others don't: DDP's answer, checked against single-process training.

Each rank trains on its own micro-batches; the reference is one process training plain ``torch.optim.AdamW``
(+ ``clip_grad_norm_``) in fp32 on the global batch (the mean of the ranks' losses), where a parameter a rank
did not use contributes nothing -- exactly DDP with ``find_unused_parameters=True``. Two models:
``ExpertMoE`` (each rank's tokens go to two of four experts, every expert used somewhere each step) and
``OptionalTower`` (rank 1 has no image, so its tower never runs there).

Besides the parameters after the steps, ``assert_ddp_exact`` compares every step's reduced gradient
(``safe_get_full_grad``) with the single-process gradient at the same weights, which Adam cannot hide; SGD
without clipping (``test_safe_zero_is_ddp_exact_under_sgd``) turns a gradient-scale error into a parameter error of
the same size. bf16, with DeepSpeed's bf16 reduction, is held to ``BF16_TOLERANCE`` of the fp32 gradient, a band
calibrated on stock where stock is right. A stock failure must be the ranks' collectives not pairing up
(``assert_collective_mismatch``), not any hang or crash.
"""

from __future__ import annotations

import re
import time
import warnings

import pytest
import torch
from packaging.version import Version

from rig import RankFailure
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.errors import ReentrantCheckpointWarning
from safe_zero.fixes import flat_buffer_autograd
from tests.support.collective_mismatch import MISMATCH, main_stack
from tests.support.models import OptionalTower, ReadingTower, build
from tests.support.rank_dependent import LR, MODELS, STEPS, TOLERANCE, config, max_error, micro_batch, reference


def _cast(batch: tuple, dtype: str) -> tuple:
    """A bf16 engine's module is bf16: its float inputs too (the reference takes the fp32 ones)."""
    if dtype != "bf16":
        return batch
    return tuple(t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in batch)


def _master_weights(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights of every trainable parameter (a collective per parameter, alike on every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in engine.module.named_parameters()
            if p.requires_grad}


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """The reduced (averaged) gradient of every trainable parameter, assembled from the ranks' fp32 partitions
    (``safe_get_full_grad``: a collective per parameter, in the same order on every rank)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().float().clone() for n, p in engine.module.named_parameters()
            if p.requires_grad}


def _train(model: str, stage: int, safe: bool, world_size: int, accumulation: int = 1, options: dict | None = None,
           dtype: str = "fp32", optimizer: str = "adamw", grads: bool = False, **zero) -> dict:
    """``grads``: also each step's reduced gradients (before the optimizer step); ``dtype="bf16"``: the module
    and its inputs in bf16, and ``params`` are the fp32 master weights (what the optimizer updates)."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    net = build(MODELS[model])
    trainable = [p for p in net.parameters() if p.requires_grad]
    client = torch.optim.SGD(trainable, lr=LR) if optimizer == "sgd" else None
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=trainable, optimizer=client,
                      config=config(stage, world_size, accumulation, options, dtype=dtype, optimizer=optimizer, **zero))
    losses, step_grads, step_weights = [], [], []
    # DeepSpeed's own safe_get_full_grad assembles wrong-sized fragments under round_robin_gradients (0.19.8: "The
    # size of tensor a (8) must match the size of tensor b (64)"), stock or not: there the parameters are compared.
    skipped = "round_robin_gradients" if grads and zero.get("round_robin_gradients") else None
    grads = grads and not skipped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReentrantCheckpointWarning)
        for step in range(STEPS):
            if grads:
                step_weights.append(_master_weights(engine))
            for micro in range(accumulation):
                loss = engine(*_cast(micro_batch(model, rank, world_size, step * accumulation + micro), dtype))
                engine.backward(loss)
                if grads and micro == accumulation - 1:
                    step_grads.append(_full_grads(engine))
                engine.step()
            losses.append(loss.float().item())
    if dtype == "bf16":
        state = _master_weights(engine)
    else:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            state = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    report = dict(getattr(engine, "safe_zero_session", None).report) if safe else {}
    warned = [str(w.message) for w in caught if issubclass(w.category, ReentrantCheckpointWarning)]
    return {"params": state, "losses": losses, "report": report, "warned": warned, "grads": step_grads,
            "grads_skipped": skipped,
            "weights": step_weights, "dtype": dtype, "model": model, "world_size": world_size,
            "accumulation": accumulation}


#: The exit code of a rank ``_watched`` ended after another rank failed: its stack is in its log.
ENDED_AFTER_A_PEER_FAILED = 75


def _watched(log_dir: str, dump_after: float, grace: float = 10, body: str = "_train", **kwargs) -> dict:
    """``body(**kwargs)`` with this rank's stderr (gloo's abort text) in ``log_dir/rank<N>.txt``. A rank that raises
    leaves a marker there; a rank still running ``grace`` seconds after another rank's marker appeared writes every
    thread's Python stack to its log (what it is blocked in) and exits with ``ENDED_AFTER_A_PEER_FAILED``, so the job
    ends in seconds instead of at the pool's timeout. A rank still running ``dump_after`` seconds into the job with
    no rank failed writes its stack too (``faulthandler``), for the pool's timeout to report."""
    import faulthandler
    import glob
    import os
    import threading

    import torch.distributed as dist

    rank = dist.get_rank()
    log = open(os.path.join(log_dir, f"rank{rank}.txt"), "w")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(dump_after, file=log)
    done = threading.Event()

    def watch() -> None:
        mine = os.path.join(log_dir, f"failed{rank}")
        while not done.wait(0.1):
            if any(path != mine for path in glob.glob(os.path.join(log_dir, "failed*"))):
                if not done.wait(grace):
                    faulthandler.dump_traceback(file=log, all_threads=True)
                    log.flush()
                    os._exit(ENDED_AFTER_A_PEER_FAILED)
                return

    threading.Thread(target=watch, daemon=True).start()
    try:
        return globals()[body](**kwargs)
    except BaseException:
        open(os.path.join(log_dir, f"failed{rank}"), "w").close()
        raise
    finally:
        done.set()
        faulthandler.cancel_dump_traceback_later()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


def _slow(seconds: float, **kwargs) -> dict:
    """Rank 1 sleeps ``seconds`` first: a run that is merely slow (the stock-failure check must not accept it)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds)
    return _train(**kwargs)


def stock_failure(ranks, tmp_path, world_size: int = 2, timeout: float = 60, body: str = "_train",
                  **kwargs) -> tuple[BaseException, dict[int, str]]:
    """Run a body that must fail on stock DeepSpeed, watched (``_watched``): the rig's error and each rank's log.

    A run that trains first, on the same stage, so that the watched one does not start with the lazy imports a
    fresh pool's first engine makes (on a loaded box they alone can outlast ``_watched``'s patience)."""
    ranks.run(world_size, _train, model="moe-dense", safe=True, world_size=world_size, stage=kwargs.get("stage", 2))
    logs = tmp_path / "ranks"
    logs.mkdir()
    pool = ranks(world_size)
    with pytest.raises((RankFailure, RuntimeError, TimeoutError)) as failure:
        pool.run(_watched, log_dir=str(logs), dump_after=timeout - 6, body=body, timeout=timeout,
                 world_size=world_size, **kwargs)
    # The rig SIGKILLs the ranks left behind without reaping them: until they are gone the pool still looks alive and
    # would be handed to the next test (which then fails "died during job N", exit codes -9).
    deadline = time.monotonic() + 30
    while isinstance(failure.value, (RuntimeError, TimeoutError)) and pool.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return failure.value, {r: (logs / f"rank{r}.txt").read_text() if (logs / f"rank{r}.txt").exists() else ""
                           for r in range(world_size)}


def assert_collective_mismatch(error: BaseException, logs: dict[int, str], expected: str = MISMATCH.pattern) -> str:
    """The failure is the ranks' collectives not pairing up, not a slow run or an unrelated crash: a rank raised
    or printed one of ``expected``'s mismatch messages, every rank that died was aborted by gloo (SIGABRT, its
    message in its log) or ended by ``_watched`` after another rank failed, and every rank that never returned
    (ended so, or given up on by the pool) was blocked inside a ``torch.distributed`` collective. Returns the
    messages found."""
    text = str(error)
    said = [m.group(0) for m in re.finditer(expected, text)]
    stuck = []
    if isinstance(error, TimeoutError):
        finished = {int(r) for r in re.findall(r"\d+", re.search(r"finished: \[([\d, ]*)\]", text).group(1))}
        stuck = sorted(set(logs) - finished)
    elif not isinstance(error, RankFailure):  # the rig's "a worker of the pool died"
        codes = re.search(r"exit codes by rank: \{([^}]*)\}", text)
        assert codes, text
        for rank, code in ((int(r), int(c)) for r, c in re.findall(r"(\d+): (-?\d+)", codes.group(1))):
            if code == ENDED_AFTER_A_PEER_FAILED:
                stuck.append(rank)
                continue
            assert code == -6, f"rank {rank} died with exit code {code}, not gloo's abort: {text}\n{logs[rank]}"
            found = re.search(expected, logs[rank])
            assert found, f"rank {rank} aborted without a collective-mismatch message: {text}\n{logs[rank]}"
            said.append(found.group(0))
    assert said, f"no rank reported a collective mismatch: {text}\n" + "\n".join(logs.values())
    for rank in stuck:
        stack = main_stack(logs[rank])
        assert stack, f"rank {rank} never returned and left no stack dump: {logs[rank]}"
        assert stack[0].split(":")[0].endswith("torch/distributed/distributed_c10d.py"), (
            f"rank {rank} never returned but was not waiting in a collective: {stack[:6]}")
    return "; ".join(said)


def _cpu_skips_uncontiguous_all_reduce() -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import split_half_float_double

    return split_half_float_double([torch.zeros(1)]) == []


def gradients_at(result: dict) -> list[dict[str, torch.Tensor]]:
    """The single-process fp32 gradient on the global batch at the weights each of ``result``'s steps computed
    with (a bf16 run: its master weights and inputs rounded to bf16, then computed in fp32), so that a gradient
    is checked on its own, whatever the optimizer made of the steps before."""
    model, world_size, accumulation = result["model"], result["world_size"], result["accumulation"]
    bf16 = result["dtype"] == "bf16"
    rounded = (lambda t: t.to(torch.bfloat16).float()) if bf16 else (lambda t: t)
    net = build(MODELS[model])
    expected = []
    for step, weights in enumerate(result["weights"]):
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(rounded(weights[n]) if n in weights else rounded(p))
        net.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            batches = [micro_batch(model, r, world_size, step * accumulation + micro) for r in range(world_size)]
            batches = [tuple(rounded(t) if isinstance(t, torch.Tensor) else t for t in b) for b in batches]
            (torch.stack([net(*b) for b in batches]).mean() / accumulation).backward()
        expected.append({n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for n, p in net.named_parameters() if p.requires_grad})
    return expected


def relative_grad_error(result: dict) -> float:
    """The largest difference between a reduced gradient and ``gradients_at``'s, over steps and parameters, as a
    fraction of that step's largest reference gradient element."""
    expected = gradients_at(result)
    assert len(result["grads"]) == len(expected) == STEPS
    errors = []
    for got, want in zip(result["grads"], expected):
        assert got.keys() == want.keys()
        scale = max(w.abs().max().item() for w in want.values())
        errors.append(max((got[n] - want[n]).abs().max().item() for n in want) / scale)
    return max(errors)


#: fp32: a reduced gradient's largest difference from the single-process one, over each step's largest element
#: (measured: 0 at 2 ranks, <= 1.7e-7 at 3, where gloo sums three addends; a gradient-scale error is O(1)).
GRAD_TOLERANCE = 1e-5


def assert_ddp_exact(result: dict, expected: dict[str, torch.Tensor]) -> None:
    """The parameters after ``STEPS`` match the single-process reference, and so does every step's reduced
    gradient (``_train(grads=True)``), which Adam's normalisation cannot hide: a gradient off by a factor moves
    an Adam update hardly at all, and not at all in its first step."""
    assert max_error(result, expected) < TOLERANCE
    if result.get("grads_skipped"):
        return
    assert result["grads"], "train with grads=True"
    error = relative_grad_error(result)
    assert error < GRAD_TOLERANCE, f"reduced gradients differ from the single-process ones by {error:.2e}"


ZERO12_ROUTES = {
    "stage1": dict(stage=1),
    "stage1-overlap": dict(stage=1, overlap_comm=True),
    "stage2": dict(stage=2),
    "stage2-overlap": dict(stage=2, overlap_comm=True),
    "stage2-no-contiguous": dict(stage=2, contiguous_gradients=False),
    "stage2-round-robin": dict(stage=2, round_robin_gradients=True),
    "stage2-small-buckets": dict(stage=2, reduce_bucket_size=40, allgather_bucket_size=40),
    "stage2-offload": dict(stage=2, offload_optimizer={"device": "cpu"}),
}


@pytest.mark.parametrize("route", [r for r in ZERO12_ROUTES if r != "stage2-small-buckets"])  # that one crashes
def test_stock_zero12_trains_an_moe_with_rank_dependent_experts_silently_wrong(ranks, route):
    kwargs = ZERO12_ROUTES[route]
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # 0.18.7-0.18.x: stock ZeRO-1/2 stops earlier on gloo
        with pytest.raises(RankFailure, match="Output 0 of Split is a view"):
            ranks.run(2, _train, model="moe", safe=False, world_size=2, **kwargs)
        return
    results = ranks.run(2, _train, model="moe", safe=False, world_size=2, **kwargs)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results), "stock runs without an error"
    assert max_error(results[0], reference("moe", 2)) > 1e-3, "stock ZeRO mixes up the ranks' expert gradients"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", list(ZERO12_ROUTES))
def test_safe_zero12_is_ddp_exact_on_an_moe_with_rank_dependent_experts(ranks, route, world_size):
    if route == "stage2-no-contiguous" and _cpu_skips_uncontiguous_all_reduce():
        pytest.xfail("this DeepSpeed never all-reduces ZeRO-2 gradients with contiguous_gradients=false on the CPU "
                     "accelerator (split_half_float_double matches no CPU tensor type): every rank trains on its own "
                     "gradient, stock or safe_zero; CUDA is not affected")
    results = ranks.run(world_size, _train, grads=True, model="moe", safe=True, world_size=world_size,
                        **ZERO12_ROUTES[route])
    expected = reference("moe", world_size)
    for r in results:
        assert_ddp_exact(r, expected)
    assert "gradless_params" in results[0]["report"]


def test_stock_zero12_trains_experts_that_move_between_ranks_silently_wrong(ranks):
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # 0.18.7-0.18.x: stock ZeRO-1/2 stops earlier on gloo
        with pytest.raises(RankFailure, match="Output 0 of Split is a view"):
            ranks.run(2, _train, model="moe-shuffled", safe=False, world_size=2, stage=2, overlap_comm=True)
        return
    results = ranks.run(2, _train, model="moe-shuffled", safe=False, world_size=2, stage=2, overlap_comm=True)
    assert max_error(results[0], reference("moe-shuffled", 2)) > 1e-3


@pytest.mark.parametrize("route", ["stage1", "stage2-overlap"])
def test_a_model_every_rank_uses_fully_trains_as_stock_does_at_three_ranks(ranks, route):
    """Never worse than stock: where stock is already DDP-exact, so is safe_zero's agreed order (world size 3)."""
    expected = reference("moe-dense", 3)
    for r in ranks.run(3, _train, grads=True, model="moe-dense", safe=True, world_size=3, **ZERO12_ROUTES[route]):
        assert_ddp_exact(r, expected)
    if not flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # stock ZeRO-1/2 cannot step at 3 gloo ranks there
        for r in ranks.run(3, _train, grads=True, model="moe-dense", safe=False, world_size=3,
                           **ZERO12_ROUTES[route]):
            assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", ["stage1-overlap", "stage2", "stage2-overlap", "stage2-round-robin"])
def test_safe_zero12_is_ddp_exact_when_the_ranks_use_other_parameters_every_step(ranks, route, world_size):
    """After the first step the ranks walk one agreed reduction order without a collective: hooks that fire in
    another order than rank 0's first-step order wait their turn, unused parameters go as zeros in theirs."""
    results = ranks.run(world_size, _train, grads=True, model="moe-shuffled", safe=True, world_size=world_size,
                        **ZERO12_ROUTES[route])
    expected = reference("moe-shuffled", world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_safe_zero12_is_ddp_exact_with_gradient_accumulation(ranks, stage, overlap, world_size):
    results = ranks.run(world_size, _train, grads=True, model="moe", safe=True, world_size=world_size, accumulation=2,
                        stage=stage, overlap_comm=overlap)
    expected = reference("moe", world_size, accumulation=2)
    for r in results:
        assert_ddp_exact(r, expected)


def test_every_rank_using_every_expert_matches_the_reference_on_stock_too(ranks):
    """The control: with one rank the reference and DeepSpeed agree, stock or not, so the reference is right."""
    results = ranks.run(1, _train, model="moe", safe=False, world_size=1, stage=2)
    assert max_error(results[0], reference("moe", 1)) < TOLERANCE


def test_stock_zero3_stops_on_rank_dependent_experts(ranks, tmp_path):
    # One rank raises within seconds (at step 2), the other waits in a collective until the pool's timeout.
    error, logs = stock_failure(ranks, tmp_path, model="moe", safe=False, stage=3)
    assert_collective_mismatch(error, logs, expected="Detected a disagreement on list contents")


#: ZeRO-3 variants of the rank-dependent cells (ids kept from the former ``persistence`` parameter): DeepSpeed's
#: default persistence, none, and every parameter offloaded to the CPU with its optimizer (``offload_param`` gathers
#: from the CPU copies and reduces into the offloaded fp32 partitions).
ZERO3_VARIANTS = {"0": {"stage3_param_persistence_threshold": 0}, "None": {},
                  "offload_param": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(ZERO3_VARIANTS))
def test_safe_zero3_gathers_moe_blocks_whole_and_is_ddp_exact(ranks, world_size, variant):
    zero = ZERO3_VARIANTS[variant]
    results = ranks.run(world_size, _train, grads=True, model="moe", safe=True, world_size=world_size, stage=3, **zero)
    expected = reference("moe", world_size)
    for r in results:
        assert_ddp_exact(r, expected)
    assert any("MoE block(s) gathered whole" in what for what in results[0]["report"]["gradless_params"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_safe_zero12_is_ddp_exact_on_an_optional_tower(ranks, stage, overlap, world_size):
    results = ranks.run(world_size, _train, grads=True, model="tower", safe=True, world_size=world_size, stage=stage,
                        overlap_comm=overlap)
    expected = reference("tower", world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("model", ["tower", "tower-reads"])
def test_stock_zero3_fails_on_an_optional_tower(ranks, tmp_path, model):
    # The rank that runs the tower gathers its parameters, the other the head's: gloo aborts one process
    # ("Received data size doesn't match expected size. Is there a distributed collective mismatch"), or one
    # rank waits in the collective until the pool's timeout.
    error, logs = stock_failure(ranks, tmp_path, model=model, safe=False, stage=3)
    assert_collective_mismatch(error, logs)


def test_stock_zero12_fails_on_an_optional_tower(ranks, tmp_path):
    # The ranks' buckets hold different parameters, so their all-reduces differ in size: gloo aborts a process
    # ("Connection reset by peer", or a size mismatch) while the other waits. DeepSpeed 0.18.7-0.18.x may stop a rank
    # earlier, on its own error.
    expected = MISMATCH.pattern
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        expected += "|Output 0 of Split is a view"
    error, logs = stock_failure(ranks, tmp_path, model="tower", safe=False, stage=2)
    assert_collective_mismatch(error, logs, expected=expected)


@pytest.mark.parametrize("world_size", [2, 3])
def test_safe_zero3_stops_on_an_optional_tower_naming_the_module_and_the_setting(ranks, world_size):
    """With ``"optional_modules": false`` the ranks that diverge stop together, where stock hangs or aborts."""
    with pytest.raises(RankFailure) as failure:
        ranks.run(world_size, _train, model="tower", safe=True, world_size=world_size, stage=3,
                  options={"optional_modules": False}, timeout=60)
    message = str(failure.value)
    assert "RankDivergenceError" in message and "rank 0 `tower.0`" in message and "rank 1 `head`" in message
    assert '"optional_modules": ["tower"]' in message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["tower", "tower-moving", "moe-root", "tower-reads", "tower-reads-foreign",
                                   "tower-tied", "tower-functional", "tower-whole-reads"])
def test_safe_zero3_is_ddp_exact_with_no_configuration_where_ranks_skip_modules(ranks, model, world_size):
    """``tower``: only even ranks run it; ``tower-moving``: the ranks that run it change every step; ``moe-root``:
    an experts ``ModuleList`` beside the root; ``tower-reads``: the tower's first module has no parameters of its own
    and reads its child's weight before calling it (Qwen2-VL's patch embedding); ``tower-reads-foreign``: the image
    path reads a weight of a module every rank runs, outside it; ``tower-tied``: a tower layer shares its weight with a
    module every rank runs; ``tower-functional``: every rank reads a weight without entering its module, the text-only
    ranks while the others are in the tower (served by the lockstep, and gathered again for the backward);
    ``tower-whole-reads``: the text-only ranks run a block gathered whole for them while the others are in the tower,
    and it reads its child's weight without entering the child. The towers are found in the first forward (the ranks
    diverge, go on in lockstep and keep what some skipped gathered), the root's experts when the engine is built.
    (bf16: the ``stage3-found`` and ``stage3-root-experts`` cells below.)"""
    results = ranks.run(world_size, _train, grads=True, model=model, safe=True, world_size=world_size, stage=3,
                        timeout=90, **GATHERING)
    expected = reference(model, world_size)
    for r in results:
        assert_ddp_exact(r, expected)
    found = "some ranks skipped them" if model.startswith("tower") else "experts beside the model's root"
    kept = [what for what in results[0]["report"]["gradless_params"] if "kept gathered" in what]
    assert len(kept) == 1 and found in kept[0] and "per rank" in kept[0], kept
    # ``tower-reads-foreign``: what the tower reads of ``inp`` from outside it stays gathered with it.
    kept_names = {"moe-root": "experts", "tower-reads-foreign": "inp, tower"}.get(model, "tower")
    assert f"optional module(s) {kept_names} kept" in kept[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_safe_zero3_keeps_a_persistent_weight_read_in_a_module_gathered_whole(ranks, world_size):
    """``tower-whole-reads`` at DeepSpeed's default persistence (every parameter of this model persistent): the block's
    weight the text-only ranks read while they ran it whole stays gathered on them when the lockstep gathers the block
    again for the image ranks (it is not registered for a fetch: DeepSpeed never registers a persistent one)."""
    results = ranks.run(world_size, _train, grads=True, model="tower-whole-reads", safe=True, world_size=world_size,
                        stage=3, timeout=90)
    expected = reference("tower-whole-reads", world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(ZERO3_VARIANTS))
def test_safe_zero3_is_ddp_exact_on_an_optional_tower_listed_in_optional_modules(ranks, world_size, variant):
    zero = ZERO3_VARIANTS[variant]
    results = ranks.run(world_size, _train, grads=True, model="tower", safe=True, world_size=world_size, stage=3,
                        options={"optional_modules": ["tower"]}, **zero)
    expected = reference("tower", world_size)
    for r in results:
        assert_ddp_exact(r, expected)
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert any("optional module(s) tower kept gathered" in what for what in results[0]["report"]["gradless_params"])


#: ZeRO-3 with every parameter partitioned, released after each use, never prefetched (this model is small enough to
#: be prefetched whole) and reduced in buckets of 12 elements: every backward gathers module by module, with bucket
#: flushes between those gathers.
GATHERING = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0,
                 reduce_bucket_size=12)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["shift", "shift-later"])
def test_safe_zero3_is_ddp_exact_when_a_module_every_rank_runs_uses_a_parameter_on_some(ranks, model, world_size):
    """From the second step each rank walks the agreed order on the module clock, without a collective: a parameter
    it did not use goes out as zeros before the gathers of the module that follows rank 0's hook for it (``shift``),
    or at the end of the backward where rank 0 did not reach it in the first step (``shift-later``)."""
    results = ranks.run(world_size, _train, grads=True, model=model, safe=True, world_size=world_size, stage=3,
                        timeout=90, **GATHERING)
    expected = reference(model, world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", ["accumulation", "offload", "offload_param"])
def test_safe_zero3_walk_is_ddp_exact_with_gradient_accumulation_and_cpu_offload(ranks, route, world_size):
    """Every micro-step's backward reduces on ZeRO-3, so each one walks; with the optimizer on the CPU the
    reductions feed the offloaded partitions, and with ``offload_param`` the gathers read the CPU copies."""
    accumulation = 2 if route == "accumulation" else 1
    zero = {"offload": dict(offload_optimizer={"device": "cpu"}),
            "offload_param": ZERO3_VARIANTS["offload_param"]}.get(route, {})
    results = ranks.run(world_size, _train, grads=True, model="shift", safe=True, world_size=world_size, stage=3,
                        accumulation=accumulation, timeout=90, **GATHERING, **zero)
    expected = reference("shift", world_size, accumulation=accumulation)
    for r in results:
        assert_ddp_exact(r, expected)


def test_stock_zero3_fails_when_a_module_every_rank_runs_uses_a_parameter_on_some(ranks, tmp_path):
    # Rank 1 skips body.shift in step 2: even in the default single bucket its reduce-scatter is smaller than rank
    # 0's, and gloo aborts a process (with GATHERING the ranks' flushes and gathers no longer pair up: a hang).
    error, logs = stock_failure(ranks, tmp_path, model="shift", safe=False, stage=3)
    assert_collective_mismatch(error, logs)


@pytest.mark.main_leg_only  # the tests' own check, the same on every release
def test_the_stock_failure_check_refuses_a_run_that_is_only_slow(ranks, tmp_path):
    """The check the stock-failure tests make, fed a stock run that would succeed but for one rank's sleep past the
    pool's timeout (``moe-dense`` at ZeRO-3: stock trains it on every release): it must not pass for a collective
    mismatch, even where a mismatch message is added to it."""
    error, logs = stock_failure(ranks, tmp_path, timeout=12, body="_slow", seconds=30, model="moe-dense", safe=False,
                                stage=3)
    assert isinstance(error, TimeoutError), error
    assert main_stack(logs[1])[0].endswith(":_slow"), logs[1]  # rank 1 was caught asleep
    with pytest.raises(AssertionError, match="no rank reported a collective mismatch"):
        assert_collective_mismatch(error, logs)
    with pytest.raises(AssertionError, match="never returned but was not waiting in a collective"):
        assert_collective_mismatch(TimeoutError(f"{error}; rank 0: RuntimeError: Connection reset by peer"), logs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_safe_zero3_is_ddp_exact_when_the_ranks_that_run_an_optional_module_change(ranks, world_size):
    results = ranks.run(world_size, _train, grads=True, model="tower-moving", safe=True, world_size=world_size, stage=3,
                        options={"optional_modules": ["tower"]}, timeout=90, **GATHERING)
    expected = reference("tower-moving", world_size)
    for r in results:
        assert_ddp_exact(r, expected)


def test_safe_zero3_waits_for_a_gradient_that_moves_past_a_gather_on_every_rank_alike(ranks):
    """In step 2 ``body.scale``'s gradient arrives after ``body.child``'s gathers, where the agreed order has it
    before them, on every rank alike: every rank's walk waits for it, so they still reduce in one order."""
    results = ranks.run(2, _train, grads=True, model="moving", safe=True, world_size=2, stage=3, timeout=90,
                        **GATHERING)
    expected = reference("moving", 2)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("safe", [False, True])
def test_zero3_trains_a_gradient_that_moves_on_one_rank_as_stock_does(ranks, safe):
    """Only rank 1's ``body.scale`` gradient moves. With one bucket per backward stock DeepSpeed reduces it sorted by
    parameter, so where it arrives does not matter; safe_zero's walk waits for it on rank 1 only and trains the same."""
    if not safe and DEEPSPEED_VERSION < Version("0.19"):
        # Measured on 0.18.9: stock's run is off the reference in about 1 run of 4 (max error 0.34), so there is no
        # stock behaviour to match; safe_zero's run is still checked against the reference below.
        pytest.skip("DeepSpeed 0.18.x stock ZeRO-3 trains this model right only in some runs")
    results = ranks.run(2, _train, grads=True, model="moving-rank1", safe=safe, world_size=2, stage=3)
    expected = reference("moving-rank1", 2)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("safe", [False, True])
def test_zero3_module_order_that_changes_on_every_rank_alike(ranks, safe):
    """Every rank drops the tower after the first step. Stock records its trace again, on every rank alike, and
    trains on but not to the reference. safe_zero's ranks each shadow the recorded tower (its gathers without its
    compute); the tower, used by no rank, takes zero gradients: DDP-exact."""
    results = ranks.run(2, _train, grads=True, model="tower-late", safe=safe, world_size=2, stage=3)
    expected = reference("tower-late", 2)
    for r in results:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        if safe:
            assert_ddp_exact(r, expected)
        else:
            assert max_error(r, expected) > 1e-4


def test_stock_zero3_hangs_where_a_rank_skips_a_module_after_the_recorded_step(ranks, tmp_path):
    """Red on stock: the trace recorded the tower on both ranks; in step 2 rank 1 skips it and every rank waits in a
    collective the other never makes (on NCCL too: a hang until the job's timeout)."""
    error, logs = stock_failure(ranks, tmp_path, model="tower-skip-later", safe=False, stage=3, timeout=30)
    assert isinstance(error, TimeoutError), error
    for rank, log in logs.items():
        stack = main_stack(log)
        # waiting on a gather: in torch.distributed, or in DeepSpeed's fetch (its handle's wait)
        assert any(f.endswith(":fetch_sub_module") or "torch/distributed/" in f for f in stack[:8]), (rank, stack[:8])


def test_safe_zero3_stops_where_a_rank_runs_a_module_more_often_than_the_recorded_step(ranks):
    """The recorded step ran the tower once on every rank; in step 2 rank 1 runs it for an image and a video. No
    shadow covers a run the others do not make: rank 1 waits the configured time for the others to leave the order
    too, then raises naming the tower and the setting that keeps it gathered (rank 0 is left in its gather, until a
    launcher ends the job)."""
    expected = r'rank 1: RankDivergenceError: .*entered `tower` where .* has `head`.*"optional_modules": \["tower"\]'
    with pytest.raises(TimeoutError, match=expected):
        ranks.run(2, _train, model="video-later", safe=True, world_size=2, stage=3,
                  options={"module_order_timeout": 3}, timeout=60, grace=3, **GATHERING)


@pytest.mark.parametrize("model, variant", [("tower-checkpointed-rotating", {}), ("tower-frozen-rotating", {}),
                                            ("tower-rotating", {"accumulation": 2})],
                         ids=["checkpointed", "frozen", "accumulation"])
def test_safe_zero3_shadows_a_skipped_tower_under_checkpointing_freezing_and_accumulation(ranks, model, variant):
    """bf16: ``BF16_CELLS["stage3-shadowed"]``."""
    results = ranks.run(2, _train, grads=True, model=model, safe=True, world_size=2, stage=3, timeout=90,
                        **variant, **PREFETCHING)
    expected = reference(model, 2, accumulation=variant.get("accumulation", 1))
    for r in results:
        assert_ddp_exact(r, expected)


#: ZeRO-3 with prefetching: every gather after the recorded step is planned from its trace, so a shadowing rank's
#: coordinator must stand exactly where the others' do.
PREFETCHING = dict(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=20, reduce_bucket_size=12)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["tower-skip-later", "tower-rotating", "tower-reads-rotating", "video-first"])
@pytest.mark.parametrize("zero", [GATHERING, PREFETCHING], ids=["gathering", "prefetching"])
def test_safe_zero3_is_ddp_exact_where_ranks_skip_a_module_after_the_recorded_step(ranks, model, world_size, zero):
    """The trace recorded the tower on every rank; later a rank skips it (``tower-rotating``: the ranks that skip it
    change, and in step 3 at 2 ranks rank 0 skips where it ran in step 2). That rank makes the tower's gathers,
    forward and backward, without its compute, and hands over zeros for its gradients where the others hand over
    theirs: DDP-exact, with no setting."""
    results = ranks.run(world_size, _train, grads=True, model=model, safe=True, world_size=world_size, stage=3,
                        timeout=90, **zero)
    expected = reference(model, world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("route", ["stage1-overlap", "stage2", "stage2-overlap", "stage3"])
def test_activation_checkpointing_is_ddp_exact(ranks, route, reentrant, world_size):
    """Reentrant: the checkpointed block's gradients arrive in a nested backward (another graph task) of the same
    step, and wait for the epilogue (with a warning). Non-reentrant: one graph task, nothing changes."""
    kwargs = dict(stage=3) if route == "stage3" else ZERO12_ROUTES[route]
    model = "moe-checkpointed" if reentrant else "moe-checkpointed-nonreentrant"
    results = ranks.run(world_size, _train, grads=True, model=model, safe=True, world_size=world_size, **kwargs)
    expected = reference(model, world_size)
    for r in results:
        assert_ddp_exact(r, expected)
        assert bool(r["warned"]) == reentrant, r["warned"]


@pytest.mark.parametrize("stage", [2, 3])
def test_reentrant_checkpointing_turned_on_after_the_first_step_stops_with_what_to_do(ranks, stage):
    """The agreed order is walked without a collective, trusting the outer graph for what a rank reaches; a nested
    backward that begins later reaches parameters already reduced as zeros, and the step stops before its update."""
    with pytest.raises(RankFailure, match="nested backward.*use_reentrant=False"):
        ranks.run(2, _train, model="moe-checkpointed-late", safe=True, world_size=2, stage=stage)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_find_unused_parameters_false_trains_a_model_every_rank_uses_without_the_agreement(ranks, stage, world_size):
    results = ranks.run(world_size, _train, grads=True, model="moe-dense", safe=True, world_size=world_size,
                        stage=stage, options={"find_unused_parameters": False})
    expected = reference("moe-dense", world_size)
    for r in results:
        assert_ddp_exact(r, expected)


@pytest.mark.parametrize("world_size,stage", [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2)])
def test_find_unused_parameters_false_refuses_a_parameter_some_rank_did_not_use(ranks, stage, world_size):
    # ZeRO-3 gathers MoE blocks whole (leaf modules, zero-filled by DeepSpeed): its case is the listed tower.
    model, options = ("tower", {"optional_modules": ["tower"]}) if stage == 3 else ("moe", {})
    zero = {"overlap_comm": True} if stage == 1 else {}
    # The check is local (no collective): the rank that missed the parameter raises; at ZeRO-3 the other one
    # waits in its next gather until the pool gives up (a launcher ends the job when a rank exits), which is why
    # world size 3 (every rank misses two experts, so every rank raises at once) runs ZeRO-1/2 only.
    with pytest.raises((RankFailure, TimeoutError), match="UnusedParameterError.*find_unused_parameters") as failure:
        ranks.run(world_size, _train, model=model, safe=True, world_size=world_size, stage=stage,
                  options={"find_unused_parameters": False, **options}, timeout=60, grace=5, **zero)
    if stage < 3:  # every rank misses some expert of ExpertMoE's routes: every rank refuses
        assert isinstance(failure.value, RankFailure) and len(failure.value.errors) == world_size, failure.value


#: Rank-dependent routes with SGD (one model each): ``stage3`` reduces the MoE as a leaf module, ``stage3-walk``
#: walks the agreed order on the module clock, ``stage3-optional`` keeps a tower whose ranks change gathered.
SGD_ROUTES = {
    "stage1": ("moe", dict(stage=1)),
    "stage2-overlap": ("moe", dict(stage=2, overlap_comm=True)),
    "stage2-offload": ("moe", dict(stage=2, offload_optimizer={"device": "cpu"})),
    "stage3": ("moe", dict(stage=3)),
    "stage3-walk": ("shift", dict(stage=3, **GATHERING)),
    "stage3-optional": ("tower-moving", dict(stage=3, options={"optional_modules": ["tower"]}, **GATHERING)),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", list(SGD_ROUTES))
def test_safe_zero_is_ddp_exact_under_sgd(ranks, route, world_size):
    """SGD without clipping moves each parameter by ``LR`` times its reduced gradient, so a gradient off by a
    factor (say, averaged over the ranks that used a parameter instead of all of them) moves the parameters by
    as much, where Adam's normalisation hides it; every step's reduced gradient is compared too."""
    if route == "stage2-offload" and world_size == 3:
        pytest.skip("offload's reduction is stage2's: world size 2 covers its copy to the CPU partitions")
    model, zero = SGD_ROUTES[route]
    results = ranks.run(world_size, _train, model=model, safe=True, world_size=world_size, optimizer="sgd",
                        grads=True, timeout=90, **zero)
    expected = reference(model, world_size, optimizer="sgd")
    for r in results:
        assert_ddp_exact(r, expected)


#: bf16: a reduced gradient's largest difference from the fp32 single-process gradient at the same (bf16) weights
#: and inputs, over the step's largest element. 8 units of bf16 rounding (u = 2**-8, 8 significant bits). Measured
#: on DeepSpeed 0.19.8 at 2 and 3 ranks, ZeRO-1/2/3 (test_bf16_every_rank_using_every_parameter_...): stock on the
#: models every rank uses fully stays within 3.7e-3 (MoE), 8.8e-3 (tower), 1.42e-2 (shift, 3 ranks) = 3.6 u; safe_zero
#: on the rank-dependent ones within 1.7e-2 = 4.4 u (the same shift model, other batches). Half of the tolerance is
#: headroom over that band; a rank's expert gradient added to another expert's (stock ZeRO-1/2, or safe_zero with its
#: zero fill dropped) is 0.24-0.27, 8x over it.
BF16_TOLERANCE = 2**-5


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_every_rank_using_every_parameter_trains_as_stock_to_the_bit_within_the_bf16_band(ranks, stage,
                                                                                                world_size):
    """The calibration: where stock is right (every rank uses every parameter) its bf16 gradients are within
    ``BF16_TOLERANCE`` of the fp32 ones, and safe_zero trains exactly as stock: the same bits in every loss,
    reduced gradient and fp32 master weight."""
    zero = dict(stage=stage, overlap_comm=True) if stage == 2 else dict(stage=stage)
    if stage < 3 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-1/2 stops on gloo on this DeepSpeed (flat_buffer_autograd)")
    stock = ranks.run(world_size, _train, model="moe-dense", safe=False, world_size=world_size, dtype="bf16",
                      grads=True, **zero)
    safe = ranks.run(world_size, _train, model="moe-dense", safe=True, world_size=world_size, dtype="bf16",
                     grads=True, **zero)
    for a, b in zip(stock, safe):
        assert a["losses"] == b["losses"]
        assert len(a["grads"]) == len(b["grads"]) == len(a["weights"]) == len(b["weights"]) == STEPS
        for got, want in [(b["params"], a["params"]), *zip(b["grads"], a["grads"]), *zip(b["weights"], a["weights"])]:
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        assert relative_grad_error(a) < BF16_TOLERANCE


#: Rank-dependent bf16 cells: ``(model, zero config)`` per stage.
BF16_CELLS = {
    "stage1": ("moe", dict(stage=1)),
    "stage2-overlap": ("moe", dict(stage=2, overlap_comm=True)),
    "stage3": ("moe", dict(stage=3)),
    "stage3-walk": ("shift", dict(stage=3, **GATHERING)),
    "stage3-optional": ("tower", dict(stage=3, options={"optional_modules": ["tower"]})),
    "stage3-found": ("tower", dict(stage=3)),
    "stage3-shadowed": ("tower-rotating", dict(stage=3, **PREFETCHING)),
    "stage3-root-experts": ("moe-root", dict(stage=3)),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("cell", list(BF16_CELLS))
def test_safe_bf16_rank_dependent_gradients_are_within_the_bf16_band_of_the_fp32_reference(ranks, cell, world_size):
    """What real jobs run: bf16, with DeepSpeed's bf16 reduction. Every step's reduced gradient against the fp32
    single-process gradient on the global batch at the same weights (the optimizer is the suite's AdamW, whose
    bf16 trajectory drifts from fp32's by up to 2 LR a step where a gradient element is near zero, so the weights
    after the steps are no measure here; the gradients are)."""
    model, zero = BF16_CELLS[cell]
    results = ranks.run(world_size, _train, model=model, safe=True, world_size=world_size, dtype="bf16",
                        grads=True, timeout=90, **zero)
    for r in results:
        error = relative_grad_error(r)
        assert error < BF16_TOLERANCE, f"bf16 reduced gradients {error:.2e} off the fp32 reference"
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.parametrize("world_size,route", [(2, "stage2-overlap"), (3, "stage1")])
def test_stock_bf16_rank_dependent_experts_leave_the_bf16_band(ranks, world_size, route):
    """The band discriminates: stock ZeRO-1/2 (no zero fill, no agreed order) adds one rank's expert gradients to
    another's, far outside ``BF16_TOLERANCE``."""
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-1/2 stops on gloo on this DeepSpeed (flat_buffer_autograd)")
    results = ranks.run(world_size, _train, model="moe", safe=False, world_size=world_size, dtype="bf16",
                        grads=True, **ZERO12_ROUTES[route])
    assert relative_grad_error(results[0]) > 4 * BF16_TOLERANCE


def _optional_tower_round_trip(directory: str) -> dict:
    """2 steps, save, ``empty_partition_cache``, a 3rd step; a fresh engine loads the checkpoint and takes the same
    3rd step."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()

    def engine(seed: int):
        net = build(OptionalTower, seed=seed)
        # A config per engine: DeepSpeed 0.18 pops "torch_adam" from the dict it is given.
        return safe_zero.initialize(model=net, model_parameters=list(net.parameters()),
                                    config=config(3, 2, 1, {"optional_modules": ["tower"]}))[0]

    def step(e, micro: int) -> float:
        loss = e(*micro_batch("tower", rank, 2, micro))
        e.backward(loss)
        e.step()
        return loss.item()

    def params(e) -> dict:
        with deepspeed.zero.GatheredParameters(list(e.module.parameters())):
            return {n: p.detach().clone() for n, p in e.module.named_parameters()}

    first = engine(0)
    step(first, 0)
    step(first, 1)
    first.save_checkpoint(directory, tag="t")
    first.empty_partition_cache()  # releases the kept tower too: the next forward gathers it again
    losses = [step(first, 2), step(first, 3)]
    resumed = engine(1)
    resumed.load_checkpoint(directory, tag="t")
    resumed_losses = [step(resumed, 2), step(resumed, 3)]
    return {"losses": losses, "resumed": resumed_losses, "params": params(first), "resumed_params": params(resumed)}


def test_optional_modules_survive_a_checkpoint_round_trip_and_an_emptied_cache(ranks, tmp_path):
    try:
        results = ranks.run(2, _optional_tower_round_trip, directory=str(tmp_path / "first"))
    except RuntimeError as error:
        # Once, in a fresh-clone CI run, a worker of the shared 2-rank pool died here without output (not
        # reproduced alone or with this file). One retry on a fresh pool; a real failure fails both times.
        if "pool died" not in str(error):
            raise
        results = ranks.run(2, _optional_tower_round_trip, directory=str(tmp_path / "second"))
    for r in results:
        assert r["resumed"] == r["losses"]
        assert all(torch.equal(r["params"][n], r["resumed_params"][n]) for n in r["params"])


CHUNKS = 2


def _train_coalesced(model: str, stage: int, safe: bool = True, options: dict | None = None, world_size: int = 2,
                     **zero) -> dict:
    """``_train``'s steps inside DeepSpeed's ``coalesce_grad_reduction``: ``CHUNKS`` backwards per block (each
    loss divided by ``CHUNKS``, so a step is the reference's accumulated step), one flush at the block's exit that
    calls the reduce hooks outside any graph task, then one optimizer step."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    net = build(MODELS[model])
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                      config=config(stage, world_size, safe_zero=options, **zero))
    losses = []
    for step in range(STEPS):
        with engine.coalesce_grad_reduction():
            for chunk in range(CHUNKS):
                loss = engine(*micro_batch(model, rank, world_size, step * CHUNKS + chunk))
                engine.set_gradient_accumulation_boundary(chunk == CHUNKS - 1)
                engine.backward(loss / CHUNKS)
                losses.append(loss.item())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return {"params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                "losses": losses}


needs_coalesce = pytest.mark.skipif(not hasattr(__import__("deepspeed").DeepSpeedEngine, "coalesce_grad_reduction"),
                                    reason="this DeepSpeed has no coalesce_grad_reduction")


@needs_coalesce
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_coalesced_grad_reduction_flush_is_ddp_exact(ranks, stage, world_size):
    # Before the fix the ZeRO-3 flush asked autograd for reachability outside a backward and raised
    # "_get_should_execute_nodes should only be called during the backward pass" (DeepSpeed's own coalesce tests).
    results = ranks.run(world_size, _train_coalesced, model="moe-dense", stage=stage, world_size=world_size)
    expected = reference("moe-dense", world_size, accumulation=CHUNKS)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@needs_coalesce
@pytest.mark.parametrize("route", ["stage1", "stage2", "stage2-overlap"])
def test_stock_coalesced_flush_trains_rank_dependent_experts_silently_wrong(ranks, route):
    # The flush reduces only the parameters with a gradient on each rank, in parameter order: rank 0's experts
    # 0-1 meet rank 1's experts 2-3 at the same bucket offsets.
    results = ranks.run(2, _train_coalesced, model="moe", safe=False, **ZERO12_ROUTES[route])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results), "stock runs without an error"
    assert max_error(results[0], reference("moe", 2, accumulation=CHUNKS)) > 1e-3


@needs_coalesce
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model,route", [("moe", "stage1"), ("moe", "stage1-overlap"), ("moe", "stage2"),
                                         ("moe", "stage2-overlap"), ("tower", "stage2"), ("moe", "stage3"),
                                         ("tower", "stage3")])
def test_safe_coalesced_flush_is_ddp_exact_on_rank_dependent_parameters(ranks, model, route, world_size):
    zero = ZERO12_ROUTES[route] if route != "stage3" else {"stage": 3}
    options = {"optional_modules": ["tower"]} if model == "tower" and route == "stage3" else None
    results = ranks.run(world_size, _train_coalesced, model=model, options=options, world_size=world_size, **zero)
    expected = reference(model, world_size, accumulation=CHUNKS)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


def _parameter_dict_classes(safe: bool) -> list[str]:
    """The class of a module's parameter dictionary in each forward of ``tower-reads`` at ZeRO-3, seen right after
    DeepSpeed's start-of-forward hook."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    net = build(ReadingTower)
    seen: list[str] = []
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=list(net.parameters()), config=config(3, dist.get_world_size()))
    net.register_forward_pre_hook(lambda module, args: seen.append(type(net.inp._parameters).__name__))
    for step in range(4):
        engine.backward(engine(*micro_batch("tower-reads", dist.get_rank(), dist.get_world_size(), step)))
        engine.step()
    return seen


def test_parameter_reads_are_watched_in_recording_forwards_only(ranks):
    """safe_zero's parameter dictionary while DeepSpeed records its module order (the first forward, and the next,
    since the tower found there changes the order), DeepSpeed's own once the order is recorded; stock's always (at
    one rank: stock aborts on this model at two)."""
    for seen in ranks.run(2, _parameter_dict_classes, safe=True):
        assert seen[0] == "SafeZeROOrderedDict" and seen[-2:] == ["ZeROOrderedDict"] * 2, seen
    stock, = ranks.run(1, _parameter_dict_classes, safe=False)
    assert stock == ["ZeROOrderedDict"] * 4, stock
