"""Tiny, randomly initialised models for every vision-language and MoE causal LM the installed transformers ships.

``discover()`` lists them from transformers' auto mappings, ``build()`` shrinks each one's default config (a generic
shrink, sized after transformers' own ``*ModelTester`` configs, plus per-family overrides) and ``batch()`` makes
deterministic micro-batches with or without images, so the zoo can train each one and compare.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto import modeling_auto
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

#: The multimodal-LM mapping (audio, speech and omni models too); transformers before it (the floor, 4.50) has none.
MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES = getattr(modeling_auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {})
#: Why the zoo's tests skip on such a transformers: the architectures they name, the ``dtype=`` they build with and the
#: mapping they discover from are a newer transformers' (CI's).
NO_ZOO = "the zoo's tests name the architectures of a transformers with the multimodal-LM mapping; this one has none"

KINDS = ("vlm", "moe_vlm", "moe_lm", "alm")
#: The kinds whose batches carry a modality (an image, or an audio clip for "alm") on some ranks and not others.
MULTIMODAL = ("vlm", "moe_vlm", "alm")


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers' model_type, e.g. "qwen2_vl"
    kind: str  # "vlm" (dense vision-language), "moe_vlm", "moe_lm" (MoE causal LM), "alm" (audio/speech LM)


#: Architectures whose training forward draws random numbers the reference cannot draw alike: their rows compare
#: stock and safe_zero with each other rather than with the reference.
SAMPLES_IN_TRAINING = {
    "phimoe": "PhiMoE's sparsemixer samples its routing in training mode (`exponential_()` noise): the ranks and the "
              "single-process reference draw different numbers, so stock and safe_zero are \"WRONG\" alike",
}


class Unbuildable(Exception):
    """The architecture cannot be built tiny here; str(e) is the reason shown in the zoo's table (one line)."""


# An expert count (num_experts, num_local_experts, n_routed_experts, moe_num_experts, ...), not the shared ones.
_EXPERTS = re.compile(r"(?:^|_)(?:num|n)_(?!shared)\w*experts$")


def _expert_count(config: dict[str, Any]) -> int:
    counts = [0]
    for key, value in config.items():
        if isinstance(value, dict) and key not in _NOT_SIZES:  # DBRX's ffn_config
            counts.append(_expert_count(value))
        elif _EXPERTS.search(key):
            if isinstance(value, int) and not isinstance(value, bool):
                counts.append(value)
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                counts.extend(value)
    return max(counts)


def _default_config(model_type: str) -> transformers.PretrainedConfig:
    return CONFIG_MAPPING[model_type]()


def _text_config(config: transformers.PretrainedConfig) -> dict[str, Any]:
    try:
        return config.get_text_config().to_dict()
    except ValueError:  # several text configs: the one named so
        return config.to_dict().get("text_config") or config.to_dict()


def _model_class(model_type: str) -> type[torch.nn.Module]:
    """The class the auto mappings name, the image-text-to-text one where both do (Gemma3ForConditionalGeneration)."""
    names = {**MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, **MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             **MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    return getattr(transformers, names[model_type])


def _takes_images(model_class: type[torch.nn.Module]) -> bool:
    return any("pixel" in name or "patches" in name for name in inspect.signature(model_class.forward).parameters)


def discover() -> list[Architecture]:
    """Every image-text-to-text model, every other multimodal LM (audio, speech, omni: ``"alm"``) and every MoE
    causal LM of the installed transformers, sorted by model_type."""
    found: dict[str, Architecture] = {}
    for model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            found[model_type] = Architecture(model_type, "alm")
    for model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        try:
            moe = _expert_count(_text_config(_default_config(model_type))) > 1
        except Exception:  # listed all the same: build() says why it cannot build it
            moe = False
        if moe and not _takes_images(_model_class(model_type)):  # Mistral4ForCausalLM: listed, but text-only
            found[model_type] = Architecture(model_type, "moe_lm")
        else:
            found[model_type] = Architecture(model_type, "moe_vlm" if moe else "vlm")
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type in found:
            continue
        try:
            config = _default_config(model_type).to_dict()
        except Exception:  # no default config (gemma4_assistant): nothing says whether it has experts
            continue
        if _expert_count(config) > 1:
            found[model_type] = Architecture(model_type, "moe_lm")
    return sorted(found.values(), key=lambda arch: arch.model_type)


# ---------------------------------------------------------------------------------------------------------------------
# Shrinking a default config

VOCAB = 1024
WIDTH = 64
HEAD_DIM = 16
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
EXPERTS = 4
TOP_K = 2
PATCHES_PER_SIDE = 4  # image_size = 4 patches a side: 16 patches, a few tokens after merging

_TOP_K = re.compile(r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|num_selected_experts|moe_top_k)$")
# First match wins; a size is only ever lowered (value -> min(value, size)).
_SIZES: list[tuple[re.Pattern[str], int]] = [
    (re.compile(p), size)
    for p, size in [
        (r"(?:^|_)(?:num|n)_shared\w*experts$", 1),
        (_EXPERTS.pattern, EXPERTS),
        (_TOP_K.pattern, TOP_K),
        (r"^(n_group|num_expert_group|topk_group)$", 1),
        (r"^(first_k_dense_replace|num_dense_layers)$", 1),
        (r"(moe|expert|experts)_(intermediate_size|ffn_hidden_size|hidden_dim)$", EXPERT_INTERMEDIATE),
        (r"^(share_expert_dim|shared_intermediate_size)$", EXPERT_INTERMEDIATE),
        (r"^qk_rope_head_dim$", HEAD_DIM // 2),
        (r"^qk_head_dim$", HEAD_DIM + HEAD_DIM // 2),
        (r"^(qk_nope_head_dim|v_head_dim)$", HEAD_DIM),
        (r"^(kv_lora_rank|q_lora_rank|o_lora_rank)$", 2 * HEAD_DIM),
        (r"(?:^|_)(head_dim|d_head)$|^(d_kv|dim_head|attention_head_dim|attention_head_size)$", HEAD_DIM),
        (r"(key_value_heads|kv_heads)$", KV_HEADS),
        (r"(?:^|_)n_groups$", 1),  # Mamba's groups share B and C across heads: at most the heads
        (r"(?:^|_)expand$", 1),  # Mamba's inner width, expand * hidden, must be heads * head_dim
        (r"(?:^|_)(num_attention_heads|num_heads|n_head|n_heads|attention_heads)$", HEADS),
        (r"(?:^|_)(num_hidden_layers|num_layers|n_layer|n_layers|depth|encoder_layers|decoder_layers)$", LAYERS),
        (r"^(num_global_layers|resampler_depth)$", LAYERS),
        (
            r"intermediate_size|(?:^|_)(ffn_dim|mlp_dim)$|^(d_ff|dff|dim_ff|d_inner|n_inner|ffn_hidden_size)$",
            INTERMEDIATE,
        ),
        (
            r"(?:^|_)(hidden_size|d_model|n_embd|embed_dim|hidden_dim|output_dim|projection_dim|projector_input_dim"
            r"|projector_output_dim|word_embed_proj_dim|embedding_size|emb_dim|embedding_dim|output_channels"
            r"|downsample_channels|output_proj_dims|adapter_in_dim|adapter_out_dim|adapter_input_size)$",
            WIDTH,
        ),
        (r"(?:^|_)vocab_size(_per_layer_input)?$", VOCAB),
        (r"(?:^|_)hidden_sizes$", WIDTH),  # one a stage (Muse Spark's audio tower)
        (r"^codebook_dim$", WIDTH),  # WavTokenizer's quantizer works at the hidden width (Apertus 1.5's audio)
        (r"^num_filters$", 4),  # WavTokenizer's first conv, doubled at each of its 4 downsamplings
        (r"(?:^|_)depths$", 1),
        # Image VQ autoencoders (Janus, Chameleon): channels, blocks and codebook.
        (r"^base_channels$", 32),  # GroupNorm's 32 groups
        (r"^channel_multiplier$", 1),
        (r"^latent_channels$", 16),
        (r"^num_res_blocks$", 1),
        (r"^(num_embeddings|codebook_size)$", 256),
        # Whisper-like audio encoders take a fixed 2 * max_source_positions mel frames (3000): 64 here.
        (r"^max_source_positions$", 32),
    ]
]
_LAYER_COUNT = ("num_hidden_layers", "depth", "num_layers", "n_layer", "n_layers")
# Lists of layer indices (deepstack_visual_indexes, fullatt_block_indexes, intermediate_layers_indices, ...).
_LAYER_INDICES = re.compile(r"(indexes|indices|_layers|layer_ids|idxs)$")
_DROPOUT = re.compile(r"drop")
_NOT_SIZES = {"id2label", "label2id"}
_TOKEN_ID = re.compile(r"token_(id|ids|index|idx)$|^(im_start_id|im_end_id|im_newline_id|image_patch_id)$")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _head_dim(config: dict[str, Any]) -> int | None:
    if _int(config.get("head_dim")):
        return config["head_dim"]
    heads = config.get("num_attention_heads", config.get("num_heads"))
    if _int(config.get("hidden_size")) and _int(heads) and heads:
        return config["hidden_size"] // heads
    return None


def _spread(values: list[Any], n: int) -> list[Any]:
    """n of values, first and last kept: a layer_types list keeps both of its kinds of layer."""
    if n <= 1:
        return values[:n]
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def _shrunk(key: str, value: Any) -> Any:
    """The value of one config entry in the tiny config: sizes lowered, dropout probabilities 0."""
    if not isinstance(key, str):  # a table keyed by number (Aria's projector_patch_to_query_dict)
        return value
    if value is None and _TOP_K.search(key):
        return TOP_K  # left to the checkpoint in some defaults (DeepSeek-V2)
    if isinstance(value, float) and _DROPOUT.search(key):
        return 0.0
    if _int(value) and _TOP_K.search(key) and value > 0:
        return TOP_K  # routing that depends on the tokens, the same k everywhere
    size = next((size for pattern, size in _SIZES if pattern.search(key)), None)
    if size is None:
        return value
    if _int(value):
        return min(value, size)
    if isinstance(value, list) and value and all(_int(v) for v in value):  # one size per modality (Ernie)
        return [min(v, size) for v in value]
    return value


def _shrink(config: dict[str, Any]) -> None:
    """Lower every size in a config dict and its sub-config dicts, in place."""
    old = dict(config)
    for key, value in config.items():
        if isinstance(value, dict) and key not in _NOT_SIZES and key != "rope_parameters" and isinstance(key, str):
            _shrink(value)
        elif key not in _NOT_SIZES:
            config[key] = _shrunk(key, value)
    # Multi-head attention stays so; grouped-query attention keeps groups.
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("num_heads", "num_key_value_heads")):
        if _int(old.get(kv)) and old.get(kv) == old.get(heads):
            config[kv] = config[heads]
    if _int(old.get("qk_rope_head_dim")) and old.get("head_dim") == old["qk_rope_head_dim"]:
        config["head_dim"] = config["qk_rope_head_dim"]  # MLA: the rotary embedding's dim is the rope part's
    elif "head_dim" in config and config["head_dim"] is None and _head_dim(config):
        config["head_dim"] = _head_dim(config)  # derived, and read before it is (HunYuan-VL's RoPE)
    _shrink_layer_lists(config, old)
    _shrink_image(config)


def _kept_layers(per_layer: list[list[Any]], n_old: int, n_new: int) -> list[int]:
    """Which n_new of the n_old layers to keep: every kind the per-layer lists name if n_new allows (a hybrid keeps an
    attention and a linear-attention layer, an MoE a dense and a sparse one; greedy cover), the rest spread out."""
    seen: set[tuple[int, str]] = set()
    keep: list[int] = []
    while len(keep) < n_new:
        kinds = {i: {(j, repr(values[i])) for j, values in enumerate(per_layer)} - seen for i in range(n_old)}
        gain, best = max((len(kinds[i]), -i) for i in range(n_old) if i not in keep)
        if gain == 0:
            break
        keep.append(-best)
        seen |= kinds[-best]
    keep += [i for i in _spread(list(range(n_old)), n_new) if i not in keep][: n_new - len(keep)]
    return sorted(keep)


def _is_index_list(name: str, value: Any) -> bool:
    """A list of layer indices (moe_layers, deepstack_visual_indexes, mlp_only_layers, ...), strictly increasing."""
    ints = isinstance(value, list) and all(_int(v) for v in value)
    return ints and bool(_LAYER_INDICES.search(name)) and all(a < b for a, b in zip(value, value[1:]))


def _shrink_layer_lists(config: dict[str, Any], old: dict[str, Any]) -> None:
    """Per-layer lists keep the kept layers' entries; layer indices and per-layer dicts point at the kept layers."""
    key = next((k for k in _LAYER_COUNT if _int(old.get(k))), None)
    if key is None or config[key] == old[key]:
        return
    n_old, n_new = old[key], config[key]
    per_layer = [k for k, v in config.items() if isinstance(v, list) and len(v) == n_old and not _is_index_list(k, v)]
    keep = _kept_layers([config[k] for k in per_layer], n_old, n_new)

    def index(layer: int) -> int:  # the kept layer at or before this one
        return layer if layer < 0 else max(0, sum(k <= layer for k in keep) - 1)

    for name, value in config.items():
        if name in per_layer:
            config[name] = [value[i] for i in keep]
        elif value and _is_index_list(name, value):
            config[name] = list(dict.fromkeys(index(v) for v in value))
        elif isinstance(value, dict) and value and "per_layer" in name and all(str(k).isdigit() for k in value):
            remapped: dict[Any, Any] = {}
            for layer, entry in value.items():  # Gemma4's per_layer_config: the first entry of a kept layer wins
                remapped.setdefault(type(layer)(index(int(layer))), entry)
            config[name] = remapped


def _shrink_image(config: dict[str, Any]) -> None:
    patch = config.get("patch_size")
    if isinstance(patch, list) and patch and _int(patch[0]):
        patch = patch[0]
    if not _int(patch) or patch <= 0:
        return
    size = config.get("image_size")
    if _int(size):
        config["image_size"] = min(size, patch * PATCHES_PER_SIDE)
    elif isinstance(size, list) and len(size) == 2:
        config["image_size"] = [min(s, patch * PATCHES_PER_SIDE) for s in size]


def _shrink_image_layout(config: dict[str, Any]) -> None:
    """Image-token layouts a config fixes beside its vision sub-config, shrunk with the image."""
    if isinstance(config.get("encoder"), dict):  # T5Gemma 2's sits in its encoder's
        _shrink_image_layout(config["encoder"])
    vision = config.get("vision_config")
    size = vision.get("image_size") if isinstance(vision, dict) else None
    if "mm_tokens_per_image" in config:  # Gemma3 pools the 4x4 patches to 2x2 tokens
        config["mm_tokens_per_image"] = (PATCHES_PER_SIDE // 2) ** 2
    if config.get("image_grid_pinpoints") and _int(size):  # anyres: one crop, as large as the base image
        config["image_grid_pinpoints"] = [[size, size]]


_MROPE_DEFAULT = re.compile(r'"mrope_section",\s*\[([\d,\s]+)\]')


def _set_mrope_section(text: dict[str, Any], model_class: type[torch.nn.Module]) -> None:
    """Multimodal RoPE splits the rotary half-dim into (t, h, w) sections, most families' in a default in the modeling
    code ([16, 24, 24] for head dim 128): scaled to the shrunk head dim, the odd one out taking the rounding; in each
    layer type's parameters where they are per layer type (Cohere Compass)."""
    rope = text.get("rope_parameters")
    if not isinstance(rope, dict) or not rope:
        return
    per_type = [v for v in rope.values() if isinstance(v, dict)]
    for params in per_type or [rope]:
        sections = params.get("mrope_section") or _default_mrope_section(text, model_class)
        if sections is None:
            return
        factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        half = int(_head_dim(text) * factor) // 2
        scaled = [s * half // sum(sections) for s in sections]
        odd = next((i for i, s in enumerate(sections) if sections.count(s) == 1), 0)
        scaled[odd] += half - sum(scaled)
        params["mrope_section"] = scaled


def _default_mrope_section(text: dict[str, Any], model_class: type[torch.nn.Module]) -> list[int] | None:
    # The text model may live in another family's module (GLM-4.6V's is GLM-4V's).
    text_class = MODEL_MAPPING_NAMES.get(text.get("model_type", ""))
    classes = [model_class, *([getattr(transformers, text_class)] if text_class else [])]
    default = _MROPE_DEFAULT.search("".join(inspect.getsource(sys.modules[c.__module__]) for c in classes))
    return None if default is None else [int(s) for s in default.group(1).split(",") if s.strip()]


def _remap_token_ids(config: dict[str, Any], ids: dict[int, int]) -> None:
    """Special token ids past the shrunk vocab move to its top, the same old id to the same new one everywhere."""
    for key, value in config.items():
        if not isinstance(key, str) or key in _NOT_SIZES:
            continue
        if isinstance(value, dict):
            _remap_token_ids(value, ids)
        elif _TOKEN_ID.search(key) and _int(value) and value >= VOCAB:
            config[key] = ids.setdefault(value, VOCAB - 1 - len(ids))
        elif _TOKEN_ID.search(key) and isinstance(value, list) and all(_int(v) for v in value):
            config[key] = [ids.setdefault(v, VOCAB - 1 - len(ids)) if v >= VOCAB else v for v in value]


# Per-family fixes after the generic shrink: sizes that must agree with each other (the testers' values).
def _llama4(config: dict[str, Any]) -> None:
    vision = config["vision_config"]
    # The pixel shuffle folds 1/ratio**2 patches into one vector, which the projector MLP's fc1 reads.
    vision["intermediate_size"] = int(vision["hidden_size"] / vision["pixel_shuffle_ratio"] ** 2)
    vision["vision_output_dim"] = vision["projector_output_dim"]


def _mllama(config: dict[str, Any]) -> None:
    vision = config["vision_config"]
    # The projector reads the last hidden state concatenated with each intermediate layer's.
    vision["vision_output_dim"] = vision["hidden_size"] * (len(vision["intermediate_layers_indices"]) + 1)
    config["text_config"]["cross_attention_layers"] = [1]  # one self-attention layer, one cross-attention layer


def _dbrx(config: dict[str, Any]) -> None:
    # DbrxAttention reads rope_theta from attn_config, where DbrxConfig no longer puts it.
    config["attn_config"]["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["attn_config"]["clip_qkv"] = 8.0  # None reaches torch.clamp(min=None, max=None), which raises; 8 is DBRX's


def _omni_thinker(config: dict[str, Any]) -> None:
    # get_rope_index reads vision_start_token_id, which only the full Omni config (not the thinker's) defines.
    config["vision_start_token_id"] = 151652


def _aria(config: dict[str, Any]) -> None:
    # The projector's query count is looked up by the image's patch count.
    config["projector_patch_to_query_dict"] = {PATCHES_PER_SIDE**2: 4}


def _muse(config: dict[str, Any]) -> None:
    # The vision adapter reads merge_size**2 patches concatenated: out_hidden_size is that width, not the text's.
    vision = config["vision_config"]
    config["out_hidden_size"] = vision["hidden_size"] * vision["merge_size"] ** 2


def _jamba(config: dict[str, Any]) -> None:
    # Attention every 8th layer from the 4th and experts every 2nd from the 1st: of 2 layers, the 2nd has both.
    config.update(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)


def _granitemoehybrid(config: dict[str, Any]) -> None:
    config["layer_types"] = ["mamba", "attention"]  # the default is Mamba only, which has no attention mask to make


def _lfm2_moe(config: dict[str, Any]) -> None:
    config["layer_types"] = ["conv", "full_attention"]  # None in the default, read per layer


def _zaya(config: dict[str, Any]) -> None:
    config["num_experts_per_tok"] = 1  # "ZAYA currently supports num_experts_per_tok=1 only"


def _vipllava(config: dict[str, Any]) -> None:
    config["vision_feature_layers"] = [-2, -1]  # the default's [-2, -5, -8, -11, 6] of the 24 layers


def _molmo2(config: dict[str, Any]) -> None:
    config["adapter_config"]["vision_feature_layer"] = [-1, -2]  # the default's [24, 18]
    config["vision_config"]["num_position_embeddings"] = PATCHES_PER_SIDE**2  # one a patch, not interpolated


def _kosmos(config: dict[str, Any]) -> None:
    config["latent_query_num"] = 4  # image tokens the resampler makes (2048)


def _granite4_vision(config: dict[str, Any]) -> None:
    # The tester's: a window Q-Former downsampler fed from vision layer 1 into text layer 0; the spatial groups
    # into the last text layer.
    config.update(deepstack_layer_map=[[1, 0]], downsample_rate="1/2")
    config["spatial_target_layers"] = [1] * len(config["spatial_target_layers"])


def _vq_vocabulary(config: dict[str, Any], name: Callable[[int], str], extra: dict[str, int]) -> None:
    """Chameleon and Emu3 read an image as VQ codes, which the checkpoint's vocabulary_map turns into token ids: one
    made up, the image placeholder and the codebook above the ids batch() draws text from."""
    codebook = config["vq_config"].get("num_embeddings", config["vq_config"].get("codebook_size"))
    config["image_token_id"] = VOCAB // 2
    first = VOCAB // 2 + 8  # above the text tokens batch() draws: image codes' logits are masked out
    config["vocabulary_map"] = {name(i): first + i for i in range(codebook)} | extra | {"<image>": VOCAB // 2}


def _chameleon(config: dict[str, Any]) -> None:
    # Code i is named IMGIMG, its digits as letters (0 -> A), and a closing letter.
    _vq_vocabulary(config, lambda i: "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z", {})
    config["vq_config"]["resolution"] = 64  # the image's side: 4 x 4 codes after the 4 downsamplings


def _emu3(config: dict[str, Any]) -> None:
    _vq_vocabulary(config, lambda i: f"<|visual token{i:06d}|>", {"<|extra_200|>": VOCAB // 2 + 1})
    vq = config["vq_config"]
    vq["hidden_size"] = vq["base_channels"] * vq["channel_multiplier"][-1]  # its attention runs on the last stage


def _kolibri1_1(config: dict[str, Any]) -> None:
    config["kv_source_layers"] = list(range(config["num_hidden_layers"]))  # each kept layer makes its own K/V
    config["index_num_heads"] = HEADS // KV_HEADS  # at most the query heads a key head serves


def _qwen4_exp(config: dict[str, Any]) -> None:
    # The indexed-attention layers' indexer, unsized (None) in the default.
    text = config.get("text_config", config)
    text.update(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
                indexer_compress_ratio=2)  # fmt: skip


def _apertus1p5(config: dict[str, Any]) -> None:
    # Image codes then audio codes fill the vocab after the text ids: at a quarter of it, back to back.
    config["image_token_offset"] = VOCAB // 4
    config["audio_token_offset"] = VOCAB // 4 + config["vision_config"]["codebook_size"]


def _inkling(config: dict[str, Any]) -> None:
    # The audio embedding has one row per (mel bin, level): 80 x 256 by default.
    config["audio_config"].update(n_mel_bins=8, mel_vocab_size=16)


def _cohere_compass(config: dict[str, Any]) -> None:
    # RoPE parameters per layer type, which the default leaves empty ({}) and the rotary embedding indexes.
    text = config["text_config"]
    default = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"] = {kind: dict(default) for kind in set(text["layer_types"])}


def _hunyuan_vl(config: dict[str, Any]) -> None:
    # The tester's: four axes (position, width, height, image) of head_dim // 8 each.
    config["text_config"]["rope_parameters"]["mrope_section"] = [HEAD_DIM // 8] * 4


def _deepseek_ocr2(config: dict[str, Any]) -> None:
    config["text_config"]["mlp_layer_types"] = ["dense", "sparse"]  # None in the default, read per layer


def _step3p7(config: dict[str, Any]) -> None:
    config["text_config"]["sliding_window"] = 8  # None in the default, which its sliding layers cannot take


def _dots3_note(config: dict[str, Any]) -> None:
    # Sliding-window layers' MLA sizes differ from the main ones (per_layer_config): their head_dim must stay the sum.
    text = config.get("text_config", config)
    for layer in text["per_layer_config"].values():
        nope = layer.get("qk_nope_head_dim", text["qk_nope_head_dim"])
        layer["head_dim"] = nope + layer.get("qk_rope_head_dim", text["qk_rope_head_dim"])


def _phi4_multimodal(config: dict[str, Any]) -> None:
    # The conformer's channel widths and block count, outside the generic names.
    config["audio_config"].update(nemo_conv_channels=WIDTH, ext_pw_out_channel=WIDTH,
                                  depthwise_separable_out_channel=WIDTH, num_blocks=LAYERS)


_OVERRIDES: dict[str, Callable[[dict[str, Any]], None]] = {
    "apertus1p5": _apertus1p5,
    "aria": _aria,
    "chameleon": _chameleon,
    "cohere_compass": _cohere_compass,
    "dbrx": _dbrx,
    "deepseek_ocr2": _deepseek_ocr2,
    "dots3_note": _dots3_note,
    "dots3_note_text": _dots3_note,
    "emu3": _emu3,
    "granite4_vision": _granite4_vision,
    "granitemoehybrid": _granitemoehybrid,
    "hunyuan_vl": _hunyuan_vl,
    "inkling_mm_model": _inkling,
    "jamba": _jamba,
    "kolibri1_1": _kolibri1_1,
    "kosmos-2.5": _kosmos,
    "lfm2_moe": _lfm2_moe,
    "llama4": _llama4,
    "mllama": _mllama,
    "molmo2": _molmo2,
    "phi4_multimodal": _phi4_multimodal,
    "muse_glimmer": _muse,
    "muse_spark": _muse,
    "qwen2_5_omni_thinker": _omni_thinker,
    "qwen3_omni_moe_thinker": _omni_thinker,
    "qwen4_exp": _qwen4_exp,
    "qwen4_exp_text": _qwen4_exp,
    "step3p7": _step3p7,
    "vipllava": _vipllava,
    "zaya": _zaya,
}

# Families that cannot be built tiny here, with the reason.
_NO_TEXT_ONLY = "no text-only batch: "
_TIMM = "its vision tower is a timm model (TimmWrapperModel), and timm and pillow are not installed here"
_UNBUILDABLE: dict[str, str] = {
    "blip": _NO_TEXT_ONLY + "BLIP's captioner requires pixel_values in every forward",
    "blip-2": _NO_TEXT_ONLY + "BLIP-2's forward requires pixel_values",
    "git": _NO_TEXT_ONLY + "GIT's loss drops an image's worth of positions from the logits, image or not",
    "idefics": _NO_TEXT_ONLY + "IDEFICS's forward requires pixel_values or image embeddings",
    "kosmos-2": _NO_TEXT_ONLY + "Kosmos-2's forward requires pixel_values or image_embeds",
    "instructblip": _NO_TEXT_ONLY + "InstructBLIP's forward requires pixel_values and qformer_input_ids",
    "instructblipvideo": _NO_TEXT_ONLY + "InstructBLIP-Video's forward requires pixel_values and qformer_input_ids",
    "pix2struct": _NO_TEXT_ONLY + "an encoder-decoder whose encoder reads only the image (flattened_patches)",
    "pp_formulanet": _NO_TEXT_ONLY + "an encoder-decoder whose encoder reads only the image",
    "vision-encoder-decoder": _NO_TEXT_ONLY + "an encoder-decoder whose encoder reads only the image",
    "udop": "a layout model: its relative position bias requires a bounding box (bbox) for every token",
    "diffusion_gemma": "a block-diffusion model: it denoises a canvas of tokens, no labels and no next-token loss",
    "evolla": "a protein-text model: its encoder reads protein sequences, not images",
    "pi0": "a robot policy: trained on states and actions (flow matching), not a next-token loss",
    "pi05": "a robot policy: trained on states and actions (flow matching), not a next-token loss",
    "qwen2_5_omni": "the Omni wrapper (thinker + talker) only generates: forward(input) has no loss; its thinker is "
                    "the zoo's qwen2_5_omni_thinker",
    "qwen3_omni_moe": "the Omni wrapper (thinker + talker) only generates; its thinker is the zoo's "
                      "qwen3_omni_moe_thinker",
    "voxtral_realtime": "its text model class (VoxtralRealtimeTextModel) is not exported by this transformers",
    "nemo_speechlm": "its audio encoder's subsampling widths are fixed outside the config names shrunk here "
                     "(640 vs 1024 after subsampling)",
    "fast_vlm": _TIMM,
    "gemma3n": _TIMM,
    "perception_lm": _TIMM,
}


def tiny_config(arch: Architecture) -> transformers.PretrainedConfig:
    if arch.model_type in _UNBUILDABLE:
        raise Unbuildable(_UNBUILDABLE[arch.model_type])
    config_class = CONFIG_MAPPING[arch.model_type]
    try:
        config = config_class().to_dict()
    except Exception as e:
        raise Unbuildable(f"no default config: {_line(e)}") from e
    vision_class = config_class.sub_configs.get("vision_config")
    if "vision_config" in config and config["vision_config"] is None and vision_class is not None:
        config["vision_config"] = vision_class().to_dict()  # Gemma 4's default has none: text-only
    for key in ("image_token_id", "image_token_index", "audio_token_id", "audio_token_index"):
        if key in config and config[key] is None:  # left to the checkpoint (MiniCPM-V, BLIP-2): the image is unread
            config[key] = 151655  # Qwen's, moved into the shrunk vocab with the other special ids
    _shrink(config)
    _shrink_image_layout(config)
    if arch.model_type in _OVERRIDES:
        _OVERRIDES[arch.model_type](config)
    _set_mrope_section(config.get("text_config", config), _model_class(arch.model_type))
    _remap_token_ids(config, {})
    try:
        return config_class.from_dict(config)
    except Exception as e:
        raise Unbuildable(f"shrunk config rejected: {_line(e)}") from e


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def build(arch: Architecture, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 model of the class the auto mapping names, seeded, in train() mode, every dropout at 0."""
    config = tiny_config(arch)
    torch.manual_seed(seed)
    try:
        model = _model_class(arch.model_type)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    except Exception as e:
        raise Unbuildable(f"construction fails: {_line(e)}") from e
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.float().train()


# ---------------------------------------------------------------------------------------------------------------------
# Batches

TEXT_BATCH = 2
TEXT_LEN = 16


def _params(function: Callable[..., Any], required: bool = False) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if not required or p.default is inspect.Parameter.empty}


def _forward_params(model: torch.nn.Module) -> set[str]:
    return _params(model.forward)


def _special_ids(config: transformers.PretrainedConfig) -> set[int]:
    found: set[int] = set()

    def walk(d: dict[str, Any]) -> None:
        for key, value in d.items():
            if not isinstance(key, str) or key in _NOT_SIZES:
                continue
            if isinstance(value, dict):
                walk(value)
            elif _TOKEN_ID.search(key) and _int(value):
                found.add(value)
            elif _TOKEN_ID.search(key) and isinstance(value, list):
                found.update(v for v in value if _int(v))

    walk(config.to_dict())
    return found


def _text_tokens(model: torch.nn.Module, generator: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random ids below every special token id, so no text token is read as an image or a separator."""
    vocab = model.get_input_embeddings().num_embeddings
    specials = [i for i in _special_ids(model.config) if 0 <= i < vocab]
    high = min([vocab, *[i for i in specials if i >= vocab // 2]])
    return torch.randint(4, high, shape, generator=generator)


def _generator(rank: int, step: int, seed: int = 0) -> torch.Generator:
    """Data seed 0 is the zoo's first; another ``seed`` draws other token ids, images and clips."""
    return torch.Generator().manual_seed(1_000_003 * rank + step + 7_919 * seed)


def _vision_config(config: transformers.PretrainedConfig) -> Any:
    """The vision sub-config, the encoder's for an encoder-decoder (T5Gemma 2), the config itself for Fuyu."""
    encoder = getattr(config, "encoder", None)
    vision = getattr(config, "vision_config", None) or getattr(encoder, "vision_config", None)
    return vision if vision is not None else config


def _image_size(config: transformers.PretrainedConfig) -> tuple[int, int]:
    resolution = getattr(getattr(config, "vq_config", None), "resolution", None)
    if _int(resolution):  # Chameleon's VQ autoencoder
        return resolution, resolution
    vision = _vision_config(config)
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)):
        return int(size[0]), int(size[1])
    if _int(size):
        return size, size
    patch = _patch_size(vision)
    return patch * PATCHES_PER_SIDE, patch * PATCHES_PER_SIDE


def _channels(config: transformers.PretrainedConfig) -> int:
    vision = _vision_config(config)
    return int(getattr(vision, "num_channels", getattr(vision, "in_channels", 3)))


def _pixels(model: torch.nn.Module, generator: torch.Generator) -> tuple[dict[str, Any], int | None]:
    """The pixel inputs of one image, in the layout the family's forward takes, and its number of image tokens where
    the layout fixes it (None: count them with get_image_features)."""
    inputs, n_image = _pixel_layout(model, generator)
    height, width = _image_size(model.config)
    patch = _patch_size(_vision_config(model.config))
    grid = torch.tensor([[height // patch, width // patch]])
    owners = [model, getattr(model, "model", None)]  # the top model's may take only **kwargs (MiniCPM-V)
    names = {n for o in owners if hasattr(o, "get_image_features") for n in _params(o.get_image_features)}
    flat = int(grid.prod()), _channels(model.config) * patch**2
    if "image_grid_hw" in names:  # Nemotron-H Omni: rows of channels * patch**2, one a patch
        inputs["pixel_values"] = torch.randn(*flat, generator=generator)
    if "spatial_shapes" in names:  # SigLIP2's patches (LFM2-VL): a batch of rows of them, and which are real
        inputs["pixel_values"] = torch.randn(1, *flat, generator=generator)
        inputs["pixel_attention_mask"] = torch.ones(1, flat[0], dtype=torch.bool)
    if "image_position_ids" in names:  # Gemma 4: patches and their (x, y), pooled kernel x kernel to a token
        vision = _vision_config(model.config)
        merged = getattr(vision, "model_patch_size", None)  # Gemma 4 unified: patches come merged, one a token
        side = 2 if merged else 2 * getattr(vision, "pooling_kernel_size", 1)
        xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), dim=-1)
        dim = _channels(model.config) * merged**2 if merged else flat[1]
        inputs["pixel_values"] = torch.randn(1, side * side, dim, generator=generator)
        inputs["image_position_ids"] = xy.reshape(1, -1, 2)
    if "image_token_pooling" in names:  # Molmo2: one crop's patches, each token pooling a 2 x 2 block of them
        side = PATCHES_PER_SIDE // 2
        block = torch.tensor([0, 1, PATCHES_PER_SIDE, PATCHES_PER_SIDE + 1])
        corners = torch.tensor([2 * (t // side) * PATCHES_PER_SIDE + 2 * (t % side) for t in range(side * side)])
        inputs["pixel_values"] = torch.randn(1, *flat, generator=generator)
        inputs["image_token_pooling"] = corners[:, None] + block
        inputs["image_grids"] = torch.tensor([[side, side, 0, 0]])
    if "high_res_pixel_values" in names:  # DeepSeek-VL hybrid: the image again for its high-resolution SAM tower
        size = model.config.high_res_vision_config.image_size
        inputs["high_res_pixel_values"] = torch.randn(1, _channels(model.config), size, size, generator=generator)
    required = {n for o in owners if hasattr(o, "get_image_features") for n in _params(o.get_image_features, True)}
    if "image_sizes" in required and "image_sizes" not in inputs:  # Emu3's VQ encoder
        inputs["image_sizes"] = torch.tensor([[height, width]])
    for name in names:
        if name in ("target_sizes", "spatial_shapes", "image_grid_hw"):  # the patch grid, as MiniCPM-V and LFM2-VL
            inputs[name] = grid
        elif name == "image_merge_sizes":  # VideoLLaMA3: one merge size per image
            inputs[name] = torch.tensor([getattr(_vision_config(model.config), "spatial_merge_size", 1)])
    return inputs, n_image


def _patch_size(vision: Any) -> int:
    patch = getattr(vision, "patch_size", 14)
    return patch[0] if isinstance(patch, (list, tuple)) else patch


def _pixel_layout(model: torch.nn.Module, generator: torch.Generator) -> tuple[dict[str, Any], int | None]:
    config = model.config
    params = _forward_params(model)
    height, width = _image_size(config)
    channels = _channels(config)
    vision = _vision_config(config)
    if "image_grid_thw" in params:  # Qwen2-VL's flattened patches of a (1, h, w) grid
        return _patches(model.config.model_type, vision, channels, generator), None
    if "aspect_ratio_ids" in params:  # Mllama: tiles of images, cross-attended from one <|image|> token
        tiles = vision.max_num_tiles
        pixel_values = torch.randn(1, 1, tiles, channels, height, width, generator=generator)
        one_tile = torch.zeros(1, 1, tiles, dtype=torch.long)
        one_tile[..., 0] = 1
        ids = torch.ones(1, 1, dtype=torch.long)
        return {"pixel_values": pixel_values, "aspect_ratio_ids": ids, "aspect_ratio_mask": one_tile}, 1
    pixel_values = torch.randn(1, channels, height, width, generator=generator)
    if config.model_type in _CHANNELS_LAST_CLIPS:  # Inkling: (batch, frames, height, width, channels)
        frames = getattr(vision, "temporal_patch_size", 1)
        pixel_values = torch.randn(1, frames, height, width, channels, generator=generator)
    if config.model_type in _FLAT_PATCHES:
        patch = _patch_size(vision)
        pixel_values = torch.randn(1, PATCHES_PER_SIDE**2, channels * patch**2, generator=generator)
    inputs: dict[str, Any] = {"pixel_values": pixel_values}
    if getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT's anyres: the base image and its one crop
        inputs["pixel_values"] = torch.randn(1, 2, channels, height, width, generator=generator)
        inputs["image_sizes"] = torch.tensor([[height, width]])
    elif "image_sizes" in params and "image_sizes" in inspect.signature(vision_tower(model).forward).parameters:
        inputs["image_sizes"] = torch.tensor([[height, width]])  # Pixtral's variable-size patches
    if "pixel_attention_mask" in params:  # Idefics3: a list of images per sample, a mask of their real pixels
        inputs["pixel_values"] = pixel_values[:, None]
        tiles_only = config.model_type in _TILE_MASKS
        inputs["pixel_attention_mask"] = torch.ones((1, 1) if tiles_only else (1, 1, height, width), dtype=torch.bool)
    if "flattened_patches" in params:  # Kosmos-2.5 (Pix2Struct's): each patch's row and column, then its pixels
        n = PATCHES_PER_SIDE**2
        pixels = torch.randn(1, n, vision.patch_embed_hidden_size, generator=generator)
        rows, columns = torch.arange(n) // PATCHES_PER_SIDE + 1, torch.arange(n) % PATCHES_PER_SIDE + 1
        position = torch.stack([rows, columns], dim=-1).float()[None]
        inputs = {"flattened_patches": torch.cat([position, pixels], dim=-1)}
        return inputs, config.latent_query_num
    return inputs, None


# Families that take an image as its patches' pixels, a row a patch: Fuyu's linear patch embedding.
_FLAT_PATCHES = {"fuyu"}
_CHANNELS_LAST_CLIPS = {"inkling_mm_model"}
# Families that want mm_token_type_ids in every training batch, text-only ones too.
_TOKEN_TYPES_ALWAYS = {"molmo2"}
# Families whose pixel_attention_mask marks real tiles, not real pixels.
_TILE_MASKS = {"granite_docling"}

# How families that take an image_grid_thw want its patches: Qwen2-VL's rows of channels * temporal * patch**2 values
# unless named here.
_PATCH_LAYOUTS = {
    "kimi_k25": "conv",  # (patches, channels, patch, patch)
    "paddleocr_vl": "conv",
    "inkling2": "tokens",  # (tokens, merge * patch, merge * patch, channels)
    "inkling2_loop": "tokens",
}


def _patches(model_type: str, vision: Any, channels: int, generator: torch.Generator) -> dict[str, Any]:
    patch = vision.patch_size
    temporal = getattr(vision, "temporal_patch_size", getattr(vision, "patch_temporal", 1))
    merge = getattr(vision, "spatial_merge_size", 1)
    grid = torch.tensor([[1, 2 * merge, 2 * merge]])  # 4 tokens once merged
    n = int(grid.prod())
    layout = _PATCH_LAYOUTS.get(model_type)
    if layout == "tokens":  # Inkling 2: each token's merged patch as pixels, channels last; the grid in tokens
        shape: tuple[int, ...] = (4, merge * patch, merge * patch, channels)
        grid = torch.tensor([[1, 2, 2]])
    else:
        shape = (n, channels, patch, patch) if layout == "conv" else (n, channels * temporal * patch * patch)
    return {"pixel_values": torch.randn(*shape, generator=generator), "image_grid_thw": grid}


def _image_features_owner(model: torch.nn.Module) -> Any:
    return model if hasattr(model, "get_image_features") else model.model


def _count_image_tokens(model: torch.nn.Module, pixels: dict[str, Any]) -> int:
    """How many image tokens the family's get_image_features makes of these pixels."""
    with torch.no_grad():
        features = _image_features_owner(model).get_image_features(**pixels)
    if getattr(features, "pooler_output", None) is not None:
        features = features.pooler_output
    elif getattr(features, "deepstack_features", None):  # Granite 4 Vision: (text layer, features) per projector
        features = features.deepstack_features[0][1]
    elif hasattr(features, "last_hidden_state"):  # Fuyu's patch embeddings
        features = features.last_hidden_state
    if isinstance(features, torch.Tensor):
        features = [features]
    width = model.get_input_embeddings().embedding_dim
    return sum(f.numel() for f in features) // width


def _first_int(config: transformers.PretrainedConfig, *keys: str) -> int | None:
    return next((getattr(config, k) for k in keys if _int(getattr(config, k, None))), None)


def _audio_config(config: transformers.PretrainedConfig) -> Any:
    for name in ("audio_config", "encoder_config", "audio_encoder_config", "speech_config"):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    return config


#: A log-mel clip's frames where the encoder does not fix them (Whisper-like ones take 2 * max_source_positions).
AUDIO_FRAMES = 64


def _audio(model: torch.nn.Module, generator: torch.Generator) -> tuple[dict[str, Any], int]:
    """One audio clip's inputs in the layout the family's forward takes (log-mel features of the encoder's bins and
    the frames it expects, all real), and how many audio tokens they make: the processor's conventions, without it."""
    config, params = model.config, _forward_params(model)
    audio = _audio_config(config)
    bins = _first_int(audio, "num_mel_bins", "n_mels", "n_mel_bins", "feature_size", "input_size", "input_dim",
                      "num_mel_filters")
    positions, window = _first_int(audio, "max_source_positions"), _first_int(audio, "n_window")
    # Whisper-like: 2 * max_source_positions; Qwen3-ASR: chunks of 2 * n_window.
    frames = 2 * window if window else 2 * positions if positions else AUDIO_FRAMES
    features = torch.randn(1, bins or 80, frames, generator=generator)
    ones = torch.ones(1, frames, dtype=torch.long)
    if "input_features" in params:
        inputs: dict[str, Any] = {"input_features": features}
        if "input_features_mask" in params:
            inputs["input_features_mask"] = ones
        if "feature_attention_mask" in params:
            inputs["feature_attention_mask"] = ones
        if "padding_mask" in params:
            inputs["padding_mask"] = ones
    elif "audio_input_features" in params:  # Phi-4-multimodal: (batch, frames, bins), one embed size per clip
        inputs = {"audio_input_features": features.transpose(1, 2).contiguous(),
                  "audio_attention_mask": ones.bool()}
        reduction = _first_int(audio, "time_reduction") or 1
        return inputs, -(-frames // reduction)
    else:
        raise Unbuildable(f"no audio batch: its forward takes no log-mel input_features ({', '.join(sorted(params))})")
    try:
        n_audio = _count_audio_tokens(model, inputs)
    except (RuntimeError, ValueError):  # frames first: (batch, frames, bins), as Granite Speech's encoder reads them
        inputs["input_features"] = features.transpose(1, 2).contiguous()
        n_audio = _count_audio_tokens(model, inputs)
    if config.model_type in _AUDIO_TOKEN_MASKS:
        inputs["input_features_mask"] = torch.ones(1, n_audio, dtype=torch.bool)
    return inputs, n_audio


#: Families whose input_features_mask marks the projected audio tokens that are real, not the mel frames.
_AUDIO_TOKEN_MASKS = {"granite_speech", "granite_speech_plus"}


def _count_audio_tokens(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """How many audio tokens the family's audio path makes of these inputs."""
    owner = next((o for o in (model, getattr(model, "model", None)) if hasattr(o, "get_audio_features")), None)
    width = model.get_input_embeddings().embedding_dim
    with torch.no_grad():
        if owner is not None:
            names = _params(owner.get_audio_features)
            takes = inputs if "kwargs" in names else {k: v for k, v in inputs.items() if k in names}
            features = owner.get_audio_features(**takes)
            if getattr(features, "pooler_output", None) is not None:
                features = features.pooler_output
            elif hasattr(features, "last_hidden_state"):
                features = features.last_hidden_state
            if isinstance(features, torch.Tensor):
                features = [features]
            return sum(f.numel() for f in features) // width
        # Qwen2-Audio: its tower's output lengths, as its processor counts them
        tower = next((m for m in model.modules() if hasattr(m, "_get_feat_extract_output_lengths")), None)
        if tower is not None and "feature_attention_mask" in inputs:
            lengths = tower._get_feat_extract_output_lengths(inputs["feature_attention_mask"].sum(-1))
            return int((lengths[-1] if isinstance(lengths, tuple) else lengths).sum())
    raise Unbuildable("no audio batch: no get_audio_features to count a clip's audio tokens with")


#: Families with Qwen-VL's video inputs whose tiny video batch is not made here yet (the error it gives).
_NO_VIDEO = {
    "ernie4_5_vl_moe": "its video grid is split per frame pair (split_with_sizes)",
    "glm5_next": "its video tokens are placed by the processor's frame layout (0 tokens found)",
    "qwen2_5_omni_thinker": "its video positions need the processor's seconds per grid",
    "qwen3_omni_moe_thinker": "its video positions need the processor's timestamps",
    "video_llama_3": "its get_video_features takes video_merge_sizes",
}


def takes_video(arch: Architecture) -> bool:
    """Whether ``batch(..., video=True)`` adds a video: Qwen-VL's layout (flattened patches and a t, h, w grid)."""
    if arch.kind not in ("vlm", "moe_vlm") or arch.model_type in _NO_VIDEO or arch.model_type in _UNBUILDABLE:
        return False
    names = set(inspect.signature(_model_class(arch.model_type).forward).parameters)
    return {"pixel_values_videos", "video_grid_thw"} <= names


def _video(model: torch.nn.Module, generator: torch.Generator) -> tuple[dict[str, Any], list[int]]:
    """One short video (a grid of one temporal patch, Qwen-VL's layout) and its token ids: the vision tower runs once
    more in the forward, for the video."""
    config = model.config
    patches = _patches(config.model_type, _vision_config(config), _channels(config), generator)
    pixels = {"pixel_values_videos": patches["pixel_values"], "video_grid_thw": patches["image_grid_thw"]}
    owner = _image_features_owner(model)
    with torch.no_grad():
        features = owner.get_video_features(**pixels)
    if getattr(features, "pooler_output", None) is not None:
        features = features.pooler_output
    features = [features] if isinstance(features, torch.Tensor) else features
    n_video = sum(f.numel() for f in features) // model.get_input_embeddings().embedding_dim
    video_id = _first_int(config, "video_token_id", "video_token_index")
    if video_id is None:
        raise Unbuildable("no video batch: its config names no video token id")
    start = _first_int(config, "vision_start_token_id", "video_start_token_id")
    end = _first_int(config, "vision_end_token_id", "video_end_token_id")
    return pixels, [*([start] if start is not None else []), *[video_id] * n_video, *([end] if end is not None else [])]


def batch(arch: Architecture, model: torch.nn.Module, rank: int, step: int, image: bool, seed: int = 0,
          video: bool = False) -> dict[str, torch.Tensor]:
    """One deterministic micro-batch (seeded from rank, step and the data ``seed``); labels = input_ids, so
    model(**batch).loss is the LM loss. image=True: one image and its tokens (an audio LM: one audio clip and its
    tokens), and with video=True a video after it (``takes_video``); image=False (or an MoE LM): text only, no pixel
    or audio keys at all."""
    generator = _generator(rank, step, seed)
    if image and arch.kind == "alm":
        return _audio_batch(model, generator)
    if not image or arch.kind == "moe_lm":
        input_ids = _text_tokens(model, generator, (TEXT_BATCH, TEXT_LEN))
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
        if arch.model_type in _TOKEN_TYPES_ALWAYS:
            inputs["mm_token_type_ids"] = torch.zeros_like(input_ids)
        return inputs
    config = model.config
    pixels, n_image = _pixels(model, generator)
    image_id = _first_int(config, "image_token_id", "image_token_index")
    image_ids: list[int] = []
    if "image_embeds_position_mask" in _forward_params(model):  # Kosmos-2.5: any ids, the mask places the image
        image_ids = _text_tokens(model, generator, (n_image,)).tolist()
    elif image_id is not None:  # else the model prepends or cross-attends the image itself (BLIP-2, GIT)
        image_ids = [image_id] * (_count_image_tokens(model, pixels) if n_image is None else n_image)
        start = _first_int(config, "vision_start_token_id", "image_start_token_id")
        end = _first_int(config, "vision_end_token_id", "image_end_token_id")
        image_ids = [*([start] if start is not None else []), *image_ids, *([end] if end is not None else [])]
    before = _text_tokens(model, generator, (1, 4))
    after = _text_tokens(model, generator, (1, TEXT_LEN - 4))
    videos, video_ids = _video(model, generator) if video else ({}, [])
    input_ids = torch.cat([before, torch.tensor([image_ids + video_ids], dtype=torch.long), after], dim=1)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **pixels, **videos}
    params = _forward_params(model)
    if "image_embeds_position_mask" in params:
        inputs["image_embeds_position_mask"] = torch.zeros_like(input_ids)
        inputs["image_embeds_position_mask"][0, 4 : 4 + n_image] = 1
    if "mm_token_type_ids" in params:  # M-RoPE's positions: text 0, image 1, video 2
        inputs["mm_token_type_ids"] = (input_ids == image_id).int()
        if video:
            inputs["mm_token_type_ids"][input_ids == _first_int(config, "video_token_id", "video_token_index")] = 2
    if "cross_attention_mask" in params:  # Mllama: every token sees the image's first tile
        inputs["cross_attention_mask"] = pixels["aspect_ratio_mask"][:, None].expand(1, input_ids.shape[1], -1, -1)
    inputs["labels"] = input_ids.clone()
    return inputs


def _audio_batch(model: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    config = model.config
    audio, n_audio = _audio(model, generator)
    audio_id = _first_int(config, "audio_token_id", "audio_token_index", "speech_token_id")
    if audio_id is None:  # Phi-4-multimodal's is in its audio config
        audio_id = _first_int(_audio_config(config), "audio_token_id", "audio_token_index")
    if audio_id is None:
        raise Unbuildable("no audio batch: its config names no audio token id")
    start = _first_int(config, "audio_start_token_id", "audio_bos_token_id", "begin_audio_token_id")
    end = _first_int(config, "audio_end_token_id", "audio_eos_token_id", "end_audio_token_id")
    audio_ids = [*([start] if start is not None else []), *[audio_id] * n_audio, *([end] if end is not None else [])]
    before = _text_tokens(model, generator, (1, 4))
    after = _text_tokens(model, generator, (1, TEXT_LEN - 4))
    input_ids = torch.cat([before, torch.tensor([audio_ids], dtype=torch.long), after], dim=1)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **audio}
    if "audio_embed_sizes" in _forward_params(model):  # Phi-4-multimodal
        inputs["audio_embed_sizes"] = torch.tensor([n_audio])
    inputs["labels"] = input_ids.clone()
    return inputs


# ---------------------------------------------------------------------------------------------------------------------

# Families whose images reach the language model as VQ codes: their tower gets no gradient, image or not.
DISCRETE_IMAGE_TOKENS = frozenset({"apertus1p5", "chameleon", "emu3"})

# Fuyu and Gemma 4 unified have no tower: their patches go through an embedding (vision_embed_tokens, embed_vision);
# Chameleon, Emu3, Janus and Apertus 1.5 tokenize images with a VQ autoencoder (vqmodel, vision_tokenizer).
_TOWER_NAMES = (
    "visual", "vision_tower", "vision_model", "vision_encoder", "vision", "image_tower", "vision_embed_tokens",
    "embed_vision", "vqmodel", "vision_tokenizer",
)  # fmt: skip


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder of a VLM: the first submodule named like one (visual, vision_tower, vision_model, ...)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _TOWER_NAMES:
            return module
    raise LookupError(f"{type(model).__name__} has no module named like a vision tower")


_AUDIO_TOWER_NAMES = ("audio_tower", "audio_encoder", "speech_encoder", "audio_embed", "encoder")


def audio_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The audio encoder of an audio LM: the first submodule named like one, in the order of ``_AUDIO_TOWER_NAMES``
    (Phi-4-multimodal's image embedding has an ``encoder`` too)."""
    named = [(name.rsplit(".", 1)[-1], module) for name, module in model.named_modules()]
    for wanted in _AUDIO_TOWER_NAMES:
        for last, module in named:
            if last == wanted:
                return module
    raise LookupError(f"{type(model).__name__} has no module named like an audio tower")


def modality_tower(arch: Architecture, model: torch.nn.Module) -> torch.nn.Module:
    """The tower that a batch with ``image=True`` runs: the audio tower of an audio LM, else the vision tower."""
    return audio_tower(model) if arch.kind == "alm" else vision_tower(model)


def _report(arch: Architecture) -> str:
    start = time.perf_counter()
    try:
        model = build(arch)
    except Unbuildable as e:
        return str(e)
    for image in (True, False) if arch.kind != "moe_lm" else (False,):
        model.zero_grad(set_to_none=True)
        try:
            inputs = batch(arch, model, rank=0, step=0, image=image)
        except Unbuildable as e:
            return str(e)
        model(**inputs).loss.backward()
    params = sum(p.numel() for p in model.parameters())
    return f"built ({params} params, {time.perf_counter() - start:.2f} s)"


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    for arch in discover():
        print(f"{arch.model_type:28} {arch.kind:8} {_report(arch)}", flush=True)
