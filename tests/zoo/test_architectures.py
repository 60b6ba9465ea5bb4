"""The zoo's models: discovered from the installed transformers, built tiny and deterministic, and trained a step on a
batch with an image (the vision tower gets gradients) and one without (it gets none), the mixed-data fine-tune."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.zoo.architectures import (
    DISCRETE_IMAGE_TOKENS,
    KINDS,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    NO_ZOO,
    Architecture,
    Unbuildable,
    batch,
    build,
    discover,
    modality_tower,
    takes_video,
    vision_tower,
)

pytestmark = pytest.mark.skipif(not MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, reason=NO_ZOO)

# The families the zoo must build: the VLMs people fine-tune under ZeRO.
PRIORITY = (
    "aya_vision", "ernie4_5_vl_moe", "gemma3", "glm4v", "glm4v_moe", "idefics3", "internvl", "llama4", "llava",
    "llava_onevision", "mistral3", "mllama", "paligemma", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe",
    "smolvlm",
)  # fmt: skip
# Audio LMs of transformers' multimodal-LM mapping whose audio towers the zoo exercises.
AUDIO_LMS = ("glmasr", "granite_speech", "phi4_multimodal", "qwen2_audio", "qwen3_asr", "voxtral")
MOE_LMS = ("dbrx", "deepseek_v3", "gpt_oss", "granitemoe", "jetmoe", "llama4_text", "mixtral", "olmoe", "qwen2_moe",
           "qwen3_moe")  # fmt: skip
PIXEL_KEYS = {"pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "aspect_ratio_ids",
              "aspect_ratio_mask", "cross_attention_mask", "input_features", "input_features_mask",
              "feature_attention_mask", "audio_input_features", "pixel_values_videos"}  # fmt: skip


@pytest.fixture(scope="module")
def archs() -> dict[str, Architecture]:
    return {arch.model_type: arch for arch in discover()}


def test_discover_lists_vlms_and_moe_lms(archs: dict[str, Architecture]) -> None:
    assert set(PRIORITY) <= set(archs)
    assert set(MOE_LMS) <= {t for t, a in archs.items() if a.kind == "moe_lm"}
    assert sum(a.kind == "moe_lm" for a in archs.values()) >= 50
    assert {a.kind for a in archs.values()} == set(KINDS)
    assert archs["qwen3_vl_moe"].kind == "moe_vlm" and archs["qwen2_vl"].kind == "vlm"
    assert {t for t, a in archs.items() if a.kind == "alm"} >= set(AUDIO_LMS)
    assert list(archs) == sorted(archs)


def _step(arch: Architecture, model: torch.nn.Module, image: bool, rank: int = 0) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    inputs = batch(arch, model, rank=rank, step=0, image=image)
    assert image or not PIXEL_KEYS & set(inputs)
    assert torch.equal(inputs["labels"], inputs["input_ids"])
    loss = model(**inputs).loss
    assert torch.isfinite(loss), loss
    loss.backward()
    return loss.detach()


def _tower_grads(model: torch.nn.Module, arch: Architecture | None = None) -> list[bool]:
    tower = vision_tower(model) if arch is None else modality_tower(arch, model)
    return [p.grad is not None for p in tower.parameters()]


@pytest.mark.parametrize("model_type", PRIORITY)
def test_priority_vlm_trains_with_and_without_images(archs: dict[str, Architecture], model_type: str) -> None:
    arch = archs[model_type]
    model = build(arch)
    again = build(arch).state_dict()
    assert all(torch.equal(value, again[key]) for key, value in model.state_dict().items())
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 2_000_000

    _step(arch, model, image=True)
    assert any(_tower_grads(model))
    _step(arch, model, image=False)
    assert not any(_tower_grads(model))


@pytest.mark.parametrize("model_type", AUDIO_LMS)
def test_audio_lm_trains_with_and_without_audio(archs: dict[str, Architecture], model_type: str) -> None:
    """An audio clip of the encoder's mel bins and frames, and as many audio tokens as its tower makes of it: the audio
    tower gets gradients from a batch with audio and none from a text-only one."""
    arch = archs[model_type]
    model = build(arch)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    _step(arch, model, image=True)
    assert any(_tower_grads(model, arch))
    _step(arch, model, image=False)
    assert not any(_tower_grads(model, arch))


def test_a_video_runs_the_vision_tower_once_more(archs: dict[str, Architecture]) -> None:
    """``image+video``: the tower runs once per modality, so ranks with and without a video run it different times."""
    arch = archs["qwen2_5_vl"]
    assert takes_video(arch) and not takes_video(archs["gemma3"])
    model = build(arch)
    runs: list[int] = []
    vision_tower(model).register_forward_hook(lambda *_: runs.append(1))
    for video, expected in ((False, 1), (True, 2)):
        inputs = batch(arch, model, 0, 0, True, video=video)  # counts the image tokens with the tower
        runs.clear()
        model(**inputs).loss.backward()
        assert len(runs) == expected


@pytest.mark.parametrize("model_type", MOE_LMS)
def test_moe_lm_trains(archs: dict[str, Architecture], model_type: str) -> None:
    arch = archs[model_type]
    model = build(arch)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    _step(arch, model, image=False)
    assert all(p.grad is not None for n, p in model.named_parameters() if "embed" in n)


def test_batches_are_deterministic_and_differ_across_ranks(archs: dict[str, Architecture]) -> None:
    arch = archs["qwen2_vl"]
    model = build(arch)
    for image in (True, False):
        first, again, other = (batch(arch, model, rank=r, step=3, image=image) for r in (0, 0, 1))
        assert first.keys() == again.keys() == other.keys()
        assert all(torch.equal(first[k], again[k]) for k in first)
        assert not torch.equal(first["input_ids"], other["input_ids"])
    assert not torch.equal(batch(arch, model, 0, 0, False)["input_ids"], batch(arch, model, 0, 1, False)["input_ids"])
    # another data seed: other token ids and other pixels
    seeded = batch(arch, model, 0, 0, True, seed=1)
    assert not torch.equal(batch(arch, model, 0, 0, True)["pixel_values"], seeded["pixel_values"])
    assert torch.equal(seeded["input_ids"], batch(arch, model, 0, 0, True, seed=1)["input_ids"])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Discovering (constructing every default config) only where the full zoo runs: `-m zoo`.
    if "zoo_model_type" in metafunc.fixturenames:
        markexpr = metafunc.config.getoption("markexpr") or ""
        full = "zoo" in markexpr and "not zoo" not in markexpr
        metafunc.parametrize("zoo_model_type", [a.model_type for a in discover()] if full else [])


@pytest.mark.zoo
def test_every_architecture_builds_and_trains_or_says_why_not(
    archs: dict[str, Architecture], zoo_model_type: str
) -> None:
    arch = archs[zoo_model_type]
    try:
        model = build(arch)
        if arch.kind == "alm":  # the audio layout is found from the model
            batch(arch, model, 0, 0, True)
    except Unbuildable as e:
        assert str(e) and "\n" not in str(e)
        pytest.skip(f"unbuildable: {e}")
    again = build(arch).state_dict()
    assert all(torch.equal(value, again[key]) for key, value in model.state_dict().items())
    if arch.kind == "moe_lm":
        _step(arch, model, image=False)
        return
    _step(arch, model, image=True)
    assert any(_tower_grads(model, arch)) != (zoo_model_type in DISCRETE_IMAGE_TOKENS)
    _step(arch, model, image=False)
    assert not any(_tower_grads(model, arch))
