"""Tiny random models for every MoE family, built generically from each family's config class.

Sizes are shrunk by one table of common config keys (applied to the config and, recursively, to
every sub-config); per-layer fields (``layer_types``-like lists, ``per_layer_config`` dicts, lists
of layer indices, layer periods) are cut down to the tiny layer count generically, choosing the
kept layers so that every kind of layer of the full model (MoE/dense MLP, full/linear attention,
...) is still present. A family gets its own overrides only where that is not enough (each with
the reason).
"""

from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.core_model_loading import build_glob_alternation
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.utils import logging as hf_logging

from hi_na_moe.integrate.families import EXPERT_COUNT_KEYS

# Applied to every config (and to every sub-config, and to every per-layer override) where the key
# exists, also under an `attribute_map` alias of the config class.
COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "ffn_hidden_size": 32,
    "d_ff": 64,
    "d_kv": 16,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "kv_n_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "max_position_embeddings": 256,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,  # DeepSeek-style: one dense layer, then MoE
    "num_dense_layers": 1,
    "num_sparse_encoder_layers": 1,  # switch_transformers: sparse step = layers // sparse layers
    "num_sparse_decoder_layers": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 64,
    "attention_chunk_size": 64,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    # linear attention / state-space mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_dt_rank": 8,
    # gemma4-style: the MoE block is switched on by a flag (off in the default config)
    "enable_moe_block": True,
    "top_k_experts": 2,
    "moe_k": 2,
    "moe_hidden_size": 32,
    "shared_intermediate_size": 48,
    "router_hidden_size": 32,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    "unpadded_vocab_size": 250,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "index_kpool": 4,
    "is_moe": True,  # doge: MoE switched on by a flag (off in the default config)
    "moe_topk": 2,
    "zero_expert_num": 2,  # longcat_flash: identity "zero" experts next to the routed ones
    "moe_shared_expert_intermediate_size": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "hc_lowrank": 16,
}

# Per-family overrides, only where the generic shrink is not enough. A nested dict applies to the
# sub-config of that name.
OVERRIDES: dict[str, dict] = {
    # transformers' DbrxAttention reads attn_config.rope_theta (not a DbrxAttentionConfig field) and clamps with clip_qkv (None by default)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the default config leaves layer_types None, but the model indexes it per layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # the default text config leaves mlp_layer_types None, but the model indexes it per layer
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    # the default config is all-Mamba: transformers' hybrid cache then cannot report a sequence length
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # the model code defaults mrope_section to [8, 12, 12] (for head_dim 128); scaled to the tiny head_dim
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [8, 12, 12]}}},
    # the model code defaults mrope_section to [22, 22, 20] (for head_dim 128); scaled to the tiny head_dim
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [22, 22, 20]}}},
    # the default layer_types use QSA indexed attention, but the default config leaves its sizes None
    "qwen4_exp": {"text_config": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4}},
    # the vision tower plans a stage per prime factor of its patch (widths growing with the patch's
    # area), assigning them to fewer layers with scipy (not a dependency here): a 2x2x2 patch's
    # three stages on three layers
    "inkling_mm_model": {"vision_config": {"n_layers": 3, "patch_size": 2}},
    # the whole model (thinker and talker) does not build from transformers' default config: the
    # talker reads spatial_merge_size and its MoE blocks shared_expert_intermediate_size, which
    # its default configs lack (checkpoints set them)
    # (spatial_merge_size, shared_expert_intermediate_size), nor does its thinker generate
    # (vision_start_token_id); the widths of its audio and vision
    # towers, the talker's input and the code-to-wave decoder are keys of their own
    "qwen3_omni_moe": {
        "thinker_config": {"vision_start_token_id": 240, "audio_config": {"output_dim": 64, "downsample_hidden_size": 32},
                           "vision_config": {"out_hidden_size": 64}},
        "talker_config": {"spatial_merge_size": 2, "thinker_hidden_size": 64,
                          "text_config": {"shared_expert_intermediate_size": 48}},
        "code2wav_config": {"decoder_dim": 32, "codebook_size": 64}},
    # the vision merger's widths are keys of their own (its output is the text width)
    "glm5_next": {"vision_config": {"out_hidden_size": 64, "projection_intermediate_size": 64}},
    # the vision adapter's and the audio tower's widths are keys of their own (the adapter's input is
    # the merged vision patches: 4 x the vision width)
    "muse_spark": {"out_hidden_size": 256, "projector_hidden_size": 64,
                   "audio_config": {"hidden_sizes": [16, 16, 32, 32]}},
}

# Families that cannot be built tiny (model_type -> reason). Empty: every family builds.
UNBUILDABLE: dict[str, str] = {}

MAX_PARAMS = 20_000_000  # a tiny model; anything bigger means a sub-config was not shrunk


@dataclass
class Tiny:
    model_type: str
    model: nn.Module
    config: object
    vocab_size: int
    causal_lm: bool = False  # a *ForCausalLM: the tests also greedy-generate with it
    generates: bool = False  # has generate() (a causal LM, a *ForConditionalGeneration, ...)


_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers")
_NOT_PER_LAYER = {"rope_parameters", "rope_scaling", "id2label", "label2id", "architectures"}


def _is_config_dict(v) -> bool:
    return isinstance(v, dict) and ("model_type" in v or "architectures" in v or "transformers_version" in v)


def _is_index_set(key: str, v, n_layers: int) -> bool:
    """A list of layer indices (e.g. `moe_layers`, `mlp_only_layers`), not one entry per layer."""
    return (
        isinstance(v, list)
        and ("layers" in key or "indexes" in key or "indices" in key)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        and all(0 <= x < n_layers for x in v)
        and all(a < b for a, b in zip(v, v[1:]))
        and "source" not in key
    )


def _select_layers(per_layer: dict[str, list], index_sets: dict[str, list], n_old: int, n_new: int) -> list[int]:
    """Indices of the layers to keep: every value of every per-layer field (and membership of every
    layer-index list) is represented, greedily with as few layers as possible, padded to n_new."""
    features = {i: set() for i in range(n_old)}
    for key, vals in per_layer.items():
        if "source" in key or len({repr(v) for v in vals}) > 8:
            continue  # layer indices or per-layer values (rope thetas...), not a kind of layer
        for i, v in enumerate(vals):
            features[i].add((key, repr(v)))
    for key, idx in index_sets.items():
        members = set(idx)
        for i in range(n_old):
            features[i].add((key, i in members))
    uncovered = set().union(*features.values()) if features else set()
    chosen: list[int] = []
    while uncovered:
        best = max(range(n_old), key=lambda i: (len(features[i] & uncovered), -i))
        chosen.append(best)
        uncovered -= features[best]
    for i in range(n_old):
        if len(chosen) >= n_new:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _key_like(old_key, new_idx: int):
    if isinstance(old_key, str):
        return str(new_idx).zfill(len(old_key))
    return new_idx


def _sub_config_class(cls, key: str):
    for attr in ("sub_configs", "sub_configs_defaults"):
        sub = (getattr(cls, attr, None) or {}).get(key) if cls is not None else None
        if isinstance(sub, type):
            return sub
    return None


def _shrink_values(orig: dict, d: dict, attribute_map: dict) -> None:
    """Apply COMMON to the keys of one (flat) config dict, in place."""
    for k, v in COMMON.items():
        key = k if k in d else attribute_map.get(k)
        if key not in d or _is_config_dict(d[key]):
            continue
        cur = d[key]
        if isinstance(cur, list) and cur and all(isinstance(x, int) for x in cur):
            d[key] = [min(x, v) for x in cur]  # one value per kind of expert/modality
        elif isinstance(cur, int) and not isinstance(cur, bool) and isinstance(v, int):
            d[key] = min(cur, v)  # shrink, never grow (a top-k of 1 stays 1, no dense layer stays none)
        else:
            d[key] = v
    # widths that were the hidden size (an adapter's input, a projection's width) stay the hidden size
    h_old = orig.get("hidden_size")
    if isinstance(h_old, int) and "hidden_size" in d:
        for k, v in orig.items():
            if (k not in COMMON and k != "hidden_size" and isinstance(k, str) and v == h_old and type(v) is int
                    and ("dim" in k or "hidden" in k or "size" in k)):
                d[k] = d["hidden_size"]
    # head counts that were equal stay equal (MLA and some validators need num_key_value_heads == heads)
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("swa_num_attention_heads", "swa_num_key_value_heads")):
        if isinstance(orig.get(kv), int) and orig.get(kv) == orig.get(heads) and heads in d:
            d[kv] = d[heads]


def _shrink(d: dict, overrides: dict, cls) -> dict:
    """Shrunk copy of one config dict (recursing into sub-config dicts)."""
    orig = d
    d = copy.deepcopy(d)
    _shrink_values(orig, d, getattr(cls, "attribute_map", None) or {})
    for k, v in overrides.items():  # set even where the default config lacks the key
        if _is_config_dict(d.get(k)):
            continue
        if isinstance(v, dict) and isinstance(d.get(k), dict):  # e.g. rope_parameters: merged
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    for k, v in list(d.items()):
        if _is_config_dict(v):
            d[k] = _shrink(v, overrides.get(k, {}), _sub_config_class(cls, k))
    # per-layer overrides are shrunk like the config itself (head_dim 512 -> 16, ...)
    if isinstance(d.get("per_layer_config"), dict):
        for c_orig, c in zip(orig["per_layer_config"].values(), d["per_layer_config"].values()):
            if isinstance(c, dict):
                _shrink_values({**orig, **c_orig}, c, {})
    _shrink_layers(orig, d, overrides)
    # every-n-th-layer sparsity (e.g. nllb-moe's encoder_sparse_step=4) must still hit a tiny stack
    for k in list(d):
        if k.endswith("sparse_step") and isinstance(d[k], int):
            side = k[: -len("_sparse_step")]
            n = next((d[c] for c in (f"{side}_layers", "num_hidden_layers", "num_layers") if isinstance(d.get(c), int)), None)
            if n is not None and d[k] > n:
                d[k] = n
    _fix_derived(orig, d)
    return d


def _shrink_layers(orig: dict, d: dict, overrides: dict) -> None:
    count_key = next((k for k in _LAYER_COUNT_KEYS if isinstance(orig.get(k), int)), None)
    if count_key is None:
        return
    n_old, n_new = orig[count_key], d[count_key]
    if n_new >= n_old:
        return
    per_layer, index_sets, strings = {}, {}, {}
    for k, v in orig.items():
        if k in _NOT_PER_LAYER or k in overrides:
            continue
        if _is_index_set(k, v, n_old):
            index_sets[k] = v
        elif isinstance(v, list) and len(v) == n_old:
            per_layer[k] = v
        elif isinstance(v, str) and len(v) == n_old and k.endswith("pattern"):
            strings[k] = v
    layer_dicts = {
        k: v for k, v in orig.items()
        if k not in overrides and isinstance(v, dict) and v and k not in _NOT_PER_LAYER and not _is_config_dict(v)
        and all(str(i).isdigit() and int(i) < n_old for i in v)
    }
    for k, v in layer_dicts.items():  # a sparse per-layer mapping: its keys are a layer kind too
        index_sets[k] = sorted(int(i) for i in v)
    sel = _select_layers({**per_layer, **{k: list(s) for k, s in strings.items()}}, index_sets, n_old, n_new)
    new_of = {old: new for new, old in enumerate(sel)}
    d[count_key] = len(sel)
    for k, v in per_layer.items():
        vals = [v[i] for i in sel]
        if "source" in k:  # per-layer layer indices (e.g. kv_source_layers): renumber
            vals = [new_of.get(x, j) for j, x in enumerate(vals)]
        elif "heads" in k and isinstance(d.get("num_attention_heads"), int):  # per-layer head counts
            vals = [d["num_attention_heads"]] * len(sel)
        d[k] = vals
    for k, s in strings.items():
        d[k] = "".join(s[i] for i in sel)
    for k, v in index_sets.items():
        if k in layer_dicts:
            src = d[k]
            d[k] = {_key_like(i, new_of[int(i)]): c for i, c in src.items() if int(i) in new_of}
        else:
            d[k] = [new_of[i] for i in v if i in new_of]
    # layer patterns given as a period and an offset (e.g. jamba's attn_layer_period/offset)
    for k in list(d):
        if k.endswith("_period") and isinstance(d[k], int) and d[k] > len(sel):
            off = k[: -len("_period")] + "_offset"
            d[k] = len(sel)
            if isinstance(d.get(off), int):
                d[off] = d[off] % len(sel)


def _fix_derived(orig: dict, d: dict) -> None:
    # MLA (DeepSeek-style): qk_head_dim = nope + rope; head_dim is the rope part (or the full qk dim)
    if isinstance(d.get("qk_rope_head_dim"), int) and isinstance(d.get("qk_nope_head_dim"), int):
        rope, nope = d["qk_rope_head_dim"], d["qk_nope_head_dim"]
        if "qk_head_dim" in d:
            d["qk_head_dim"] = rope + nope
        if isinstance(orig.get("head_dim"), int):
            if orig["head_dim"] == orig.get("qk_rope_head_dim"):
                d["head_dim"] = rope
            elif orig["head_dim"] == orig.get("qk_rope_head_dim", 0) + orig.get("qk_nope_head_dim", 0):
                d["head_dim"] = rope + nope
    # multimodal rope sections must sum to the rotary half-dim of the shrunk head
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("mrope_section"), list):
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        half = int(head_dim * rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0) or 1.0)) // 2
        old = rp["mrope_section"]
        exact = [x * half / sum(old) for x in old]  # largest-remainder rounding keeps equal sections equal
        new = [int(x) for x in exact]
        for i in sorted(range(len(old)), key=lambda i: int(exact[i]) - exact[i])[: half - sum(new)]:
            new[i] += 1
        rp["mrope_section"] = new
    # special token ids must be inside the shrunk vocabulary: put them at its top, above the
    # ids the tests draw input tokens from
    vocab = d.get("vocab_size") or (d.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        nxt = vocab - 4
        for k in list(d):
            if not k.endswith("token_id") and not k.endswith("token_ids"):
                continue
            v = d[k]
            fixed = {"pad_token_id": vocab - 1, "eos_token_id": vocab - 2, "bos_token_id": vocab - 3}
            if isinstance(v, int) and not isinstance(v, bool):
                if k in fixed:
                    d[k] = fixed[k]
                elif v >= vocab:
                    d[k], nxt = nxt, nxt - 1
            elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                d[k] = [fixed.get(k, vocab - 2)] if k in fixed else [min(x, vocab - 4) for x in v]


def _match_text_width(base: dict, d: dict) -> None:
    """Widths in other sub-configs that must equal the text model's hidden size (a vision/audio
    projector output scattered onto the text embeddings, an adapter input) follow the shrunk text
    hidden size."""
    text_old, text_new = base.get("text_config"), d.get("text_config")
    if not (isinstance(text_old, dict) and isinstance(text_old.get("hidden_size"), int)):
        return
    h_old, h_new = text_old["hidden_size"], text_new["hidden_size"]

    def walk(o: dict, n: dict) -> None:
        for k, v in o.items():
            if k == "text_config":
                continue
            if isinstance(v, dict) and isinstance(n.get(k), dict):
                walk(v, n[k])
            elif isinstance(k, str) and k != "hidden_size" and ("hidden" in k or "dim" in k) and v == h_old:
                n[k] = h_new

    walk(base, d)


class _Direct:
    """A model class transformers does not register with an Auto class, used like one."""

    def __init__(self, model_cls):
        self.model_cls = model_cls

    def from_config(self, cfg, **kw):
        return self.model_cls._from_config(cfg, **kw)


def _has_experts(cfg) -> bool:
    return any(isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > 1 for k in EXPERT_COUNT_KEYS)


def _sub_configs(cfg):
    """Sub-configs, breadth-first (a multimodal model's text config before its nested ones)."""
    todo, out = [cfg], []
    while todo:
        c = todo.pop(0)
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if sub is not None and hasattr(sub, "model_type"):
                out.append(sub)
                todo.append(sub)
    return out


def _text_model_class(model_type: str, cfg):
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM, cfg
    # multimodal: the sub-config holding the experts, alone, when transformers registers a model for it
    subs = [s for s in _sub_configs(cfg) if _has_experts(s)]
    for sub in subs:
        mt = sub.model_type
        if mt in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return AutoModelForCausalLM, sub
        if mt in modeling_auto.MODEL_MAPPING_NAMES:
            return AutoModel, sub
    # ... or else the family's own model class for that sub-config (e.g. a thinker's text model)
    if subs:
        pkg = model_type_to_module_name(model_type)
        module = importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")
        classes = [
            obj for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, PreTrainedModel) and obj.__module__ == module.__name__
            and not obj.__name__.endswith("PreTrainedModel")
        ]
        for sub in subs:
            found = [c for c in classes if getattr(c, "config_class", None) is type(sub)]
            for suffix in ("ForCausalLM", "TextModel", "Model"):
                for c in found:
                    if c.__name__.endswith(suffix):
                        return _Direct(c), sub
    return AutoModel, cfg


# The Auto mappings a checkpoint's class is found in, in the order a user's class is chosen: a
# multimodal family's checkpoints name its image-text-to-text class (the vision tower with the
# language model), a text family's its causal LM; then encoder-decoder LMs, token classifiers, the
# base model.
USER_MAPPINGS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
                 "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                 "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


def user_model_class(model_type: str) -> type:
    """The class a user loads a checkpoint of `model_type` with (USER_MAPPINGS), for the whole
    config: e.g. DiffusionGemmaForBlockDiffusion, Qwen3VLMoeForConditionalGeneration,
    MixtralForCausalLM."""
    import transformers

    for mapping in USER_MAPPINGS:
        name = getattr(modeling_auto, mapping).get(model_type)
        if name is not None:
            return getattr(transformers, name)
    raise LookupError(f"{model_type}: no model class in transformers' Auto mappings")


@functools.lru_cache(maxsize=None)
def tiny_config(model_type: str):
    cls = CONFIG_MAPPING[model_type]
    base = cls().to_dict()
    d = _shrink(base, OVERRIDES.get(model_type, {}), cls)
    _match_text_width(base, d)
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    return cls(**d)


def build_tiny(model_type: str, dtype=torch.float32, seed: int = 0, user_class: bool = False, **overrides) -> Tiny:
    """A tiny model of the family with random weights; `overrides`: config attributes to set.
    By default the model holding its experts alone (a multimodal family's text model); with
    `user_class`, the whole model as a user loads a checkpoint of it (user_model_class)."""
    if model_type in UNBUILDABLE:
        raise RuntimeError(f"{model_type}: cannot be built tiny: {UNBUILDABLE[model_type]}")
    cfg = copy.deepcopy(tiny_config(model_type))  # each model its own config (attn implementation, dtype...)
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise AttributeError(f"{model_type}'s config has no {key!r} to override")
        setattr(cfg, key, value)
    auto, use_cfg = (_Direct(user_model_class(model_type)), cfg) if user_class else _text_model_class(model_type, cfg)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in auto.from_config(use_cfg).parameters())
    if n_params > MAX_PARAMS:
        raise RuntimeError(f"{model_type}: tiny config still has {n_params:,} parameters; add an override")
    torch.manual_seed(seed)
    model = auto.from_config(use_cfg, dtype=dtype).eval()
    _keep_in_fp32(model, dtype)
    # random init of 3-D expert weights is often zeros/empty in _init_weights: give every
    # parameter finite random values so the experts actually compute something
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
    vocab = getattr(use_cfg, "vocab_size", None) or getattr(getattr(use_cfg, "text_config", None), "vocab_size", 256)
    return Tiny(model_type, model, use_cfg, int(vocab), causal_lm=_is_causal_lm(model), generates=_generates(model))


def _is_causal_lm(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM") and hasattr(model, "generate")


def _generates(model: nn.Module) -> bool:
    return callable(getattr(model, "can_generate", None)) and model.can_generate()


def save_tiny(tiny: Tiny, path) -> None:
    """save_pretrained, quietly."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tiny.model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def load_tiny(model_type: str, model_cls: type, path, dtype, vocab_size: int) -> Tiny:
    """A saved tiny model loaded with from_pretrained in `dtype`, as a user loads a checkpoint:
    weights go through transformers' loading and conversion path, and sit where loading puts them
    (at the safetensors file's offsets: data pointers not 64-byte aligned)."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = model_cls.from_pretrained(path, dtype=dtype).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Tiny(model_type, model, model.config, vocab_size, causal_lm=_is_causal_lm(model), generates=_generates(model))


def reload(tiny: Tiny, path, dtype=None) -> Tiny:
    """The tiny model saved with save_pretrained and loaded back with from_pretrained (in `dtype`,
    by default its own): load_tiny."""
    save_tiny(tiny, path)
    return load_tiny(tiny.model_type, type(tiny.model), path, dtype or tiny.model.dtype, tiny.vocab_size)


def misalign(model: nn.Module, shift: int = 16) -> None:
    """Move every parameter and buffer that sits on a 64-byte boundary `shift` bytes past one (its
    storage copied whole: offsets, strides and sharing kept), as a checkpoint's tensors sit at the
    file's offsets. Where a file happens to put a tensor on a boundary, a restore that loses the
    alignment would go unseen; this makes every family's tensors show it."""
    groups: dict[int, list] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    with torch.no_grad():
        for ptr, tensors in groups.items():
            if ptr % 64:
                continue
            old = tensors[0].untyped_storage()
            buf = bytearray(old.nbytes() + 64)
            base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
            new = torch.frombuffer(buf, dtype=torch.uint8, count=old.nbytes(), offset=(shift - base) % 64).untyped_storage()
            new.copy_(old)
            for t in {id(t): t for t in tensors}.values():
                t.data = torch.empty(0, dtype=t.dtype).set_(new, t.storage_offset(), t.shape, t.stride())


def layout(model: nn.Module) -> dict:
    """Per parameter and buffer (every name, tied ones too): what a restore must give back besides
    the values: class, shape, strides, storage offset, contiguity, dtype, which storage it is in
    (numbered in order of first use, so that sharing compares across restores), the storage's
    size, and the data pointer modulo 64 (PyTorch's kernels may round otherwise on memory
    aligned otherwise)."""
    storages: dict[int, int] = {}
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        st = t.untyped_storage()
        out[name] = dict(type=type(t).__name__, shape=tuple(t.shape), stride=t.stride(), offset=t.storage_offset(),
                         contiguous=t.is_contiguous(), dtype=t.dtype,
                         storage=storages.setdefault(st.data_ptr(), len(storages)), storage_bytes=st.nbytes(),
                         align64=t.data_ptr() % 64)
    return out


def layout_diff(before: dict, after: dict) -> str:
    """The first few tensors whose layout differs between two layout() results ("" when none)."""
    diff = [f"{k}: {before[k]} -> {after.get(k)}" for k in before if before[k] != after.get(k)]
    return "\n".join(diff[:4] + ([f"... {len(diff) - 4} more"] if len(diff) > 4 else []))


def _keep_in_fp32(model: nn.Module, dtype) -> None:
    """What from_pretrained does and from_config does not: keep the model's `_keep_in_fp32_modules(_strict)`
    weights (e.g. fp32 routers) in fp32 for a half-precision model."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    pattern, group_to_glob, _ = build_glob_alternation(list(plan))
    with torch.no_grad():
        for name, t in chain(model.named_parameters(), model.named_buffers()):
            m = pattern.search(name)
            if m and t.is_floating_point():
                t.data = t.data.to(plan[group_to_glob[m.lastgroup]])


def forward_inputs(tiny: Tiny, input_ids: torch.Tensor) -> dict:
    """The kwargs to call ``tiny.model`` with: encoder-decoder models also get decoder_input_ids."""
    kw = {"input_ids": input_ids}
    if getattr(tiny.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = input_ids
    return kw


def olmoe(layers: int = 2, kv_heads: int = 4, experts: int = 8, top_k: int = 2, tied: bool = False,
          dtype=torch.bfloat16, hidden: int = 256, heads: int = 4):
    """A small OLMoE (hidden 256, 4 heads of 64) in eval mode, seeded: the scope="all" tests' model."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=512, num_experts=experts, num_experts_per_tok=top_k,
                      tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg).eval().to(dtype)


def greedy_decode(model, ids, steps: int, attention_mask=None):
    """Greedy decode with a DynamicCache, one forward per step (a mask grown by one each step
    when given): (the logits of every step after the prompt's, the cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    with torch.inference_mode():
        out = model(ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
            out = model(nxt, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return logits, cache
