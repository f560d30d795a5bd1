"""A smaller MoE from a larger one: fewer experts a layer (and optionally a lower top-k), chosen on
calibration text, written as a plain transformers checkpoint.

`distill(model, experts=N, ...)` routes calibration tokens through the model, scores every
expert of every MoE block, and returns a new model of the same class whose config says N experts
(and the new top-k): the N best-scored experts of each block are kept, the rest dropped
(method="prune") or folded into their most similar kept expert (method="merge"). Scores:

- "frequency": how many (token, slot) routings chose the expert;
- "saliency": REAP-style, the router weight times the norm of the expert's output, averaged over
  the tokens routed to it (an expert chosen often but with small weight or small output scores
  low);
- "random": a seeded random order, the baseline the other two must beat.

Blocks are found with `adapters.discover` (as enable does) and routers with the profile's
`_router` (the one [experts, hidden] weight in the block outside its experts). The layouts are
the ones hi_na_moe's adapters describe: fused [experts, ...] tensors (OLMoE, Qwen-MoE, Mixtral,
...), flat [experts x intermediate, hidden] rows (DBRX), and one module an expert (Switch
Transformers, NLLB-MoE: the spec's members; the routing their experts compute is the adapter's).
The experts' tensors (or modules, renumbered) and the router's per-expert rows, bias and
correction bias are sliced; shared experts are not per-expert tensors of either module and stay
as they are. Other blocks are refused with the block's class named and why.

What it buys: fewer expert bytes in memory. The bytes a token reads fall only when top-k falls
too (a token still runs k experts of the same size).

`save_distilled(model, out)` writes the checkpoint atomically (built in a temp directory beside
`out`, renamed at the end) with a model card (README.md) saying what was done and measured.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from ..integrate import patching
from ..integrate.adapters import _nllb_checked_routing, _switch_routing, discover
from ..integrate.families import EXPERT_COUNT_KEYS
from .profile_router import ProfileError, _block_module, _experts_call, _router, _token_ids, _windows
from .quality import logits_agreement

METHODS = ("prune", "merge")
SCORES = ("frequency", "saliency", "random")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "top_k", "num_selected_experts")
# tokens of each block's input kept for merge's output similarity (outputs of every expert on them)
SIMILARITY_TOKENS = 512
# calibration tokens the card's in-sample agreement (KL, top-1 vs the original) is measured on
CARD_TOKENS = 2048


class DistillError(ValueError):
    """Input distill cannot work with (bad N, a layout it cannot slice, an unwritable output):
    the message names it."""


@dataclass
class _Block:
    name: str  # the experts module
    block_name: str
    experts: nn.Module
    router_name: str
    router: nn.Module
    num_experts: int
    freq: torch.Tensor  # [E] routings (token, slot) per expert
    sal_sum: torch.Tensor  # [E] sum over routed tokens of weight * |output|
    sample: list = field(default_factory=list)  # block inputs for merge's similarity
    # "fused": [E, ...] tensors of the experts module; "flat": [E * inter, ...] tensors (DBRX);
    # "members": one module an expert (`keys`: expert e's child name in the experts module)
    layout: str = "fused"
    keys: list = field(default_factory=list)
    inter: int = 0
    # the experts module's call (args, kwargs) -> (hidden [T, H], top_k_index [T, k], top_k_weights)
    decode: Any = None
    top_k: int = 0  # the widest top_k_index seen in calibration


@dataclass
class DistillReport:
    source: str
    model_class: str
    method: str
    score: str
    experts_before: int
    experts_after: int
    top_k_before: int
    top_k_after: int
    calibration_tokens: int
    seed: int
    layers: list[dict]  # per block: name, kept, scores, merged_into (merge)
    param_bytes_before: int = 0
    param_bytes_after: int = 0
    expert_bytes_before: int = 0
    expert_bytes_after: int = 0
    agreement: dict[str, Any] | None = None  # in-sample KL / top-1 vs the original
    repair: dict[str, Any] | None = None  # repair(): steps, seconds, KL before and after

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _config_key(cfg, keys) -> tuple[str, str] | None:
    """(path, key): the first of `keys` the config, or a sub-config of it (DBRX's ffn_config), stores
    itself (not an attribute_map alias); path is the sub-config's attribute ('' for cfg)."""
    subs = [""] + [k for k in (getattr(cfg, "sub_configs", None) or {}) if getattr(cfg, k, None) is not None]
    for path in subs:
        holder = getattr(cfg, path) if path else cfg
        own = holder.to_dict() if hasattr(holder, "to_dict") else {}
        key = next((k for k in keys if isinstance(own.get(k), int) and not isinstance(own.get(k), bool)), None)
        if key is not None:
            return path, key
    return None


def _holder(cfg, path: str):
    return getattr(cfg, path) if path else cfg


# Block classes distill refuses although hi_na_moe runs them, and why (_blocks names the other
# refusals: blocks hi_na_moe does not recognise, quoting the enable report's reason, and
# identity experts).
_REFUSED = {
    "Llama4TextMoe": "its experts scale their input by the router score, not their output (the adapter's "
                     "weight_on_input): distill's saliency and merge assume output weighting, and its calibration "
                     "does not read this block's routing",
    "JetMoeMoE": "JetMoE's attention experts (JetMoeMoA) share num_local_experts with these, and distill does "
                 "not slice attention experts",
    "DogeCDMoE": "product-key experts: its router scores num_keys x num_keys key pairs, not experts one by one, "
                 "so single experts cannot be dropped",
}


def _member_keys(experts: nn.Module, spec) -> list[str] | None:
    """Expert e's child name in a per-expert module layout (ModuleDict 'expert_{e}', ModuleList
    '{e}'), found from the spec's member weights (the adapter's knowledge of the layout)."""
    owner = {id(p): name for name, child in experts.named_children() for p in child.parameters()}
    keys = [owner.get(id(w)) for w in spec.members.get("up", ())]
    ok = len(keys) == spec.num_experts and all(
        k is not None and (m := re.fullmatch(r"(\D*)(\d+)", k)) and int(m.group(2)) == e for e, k in enumerate(keys))
    return keys if ok else None


def _members_decode(block: nn.Module):
    """(args, kwargs) of a per-expert module layout's experts call -> (hidden, top_k_index,
    top_k_weights): the routing hi_na_moe's adapter found the experts module computes."""
    cls = type(block).__name__
    if cls == "SwitchTransformersSparseMLP":
        return lambda args, kwargs: (args[0], *_switch_routing(args[1], args[2]))
    if cls == "NllbMoeSparseMLP":
        routing = _nllb_checked_routing(block)
        if routing is not None:
            return lambda args, kwargs: (args[0], *routing(args[1], args[2]))
    return None


def _refuse(m, cls: str, why: str) -> DistillError:
    return DistillError(f"{m.name} ({cls}, {m.adapter}): distill cannot shrink this block: {why}")


def _blocks(model: nn.Module) -> list[_Block]:
    matches = discover(model)
    if not matches:
        raise DistillError(f"no MoE block found in {type(model).__name__}: nothing routes tokens to experts")
    cfg = _text_config(model.config)
    H = getattr(cfg, "hidden_size", None)
    out = []
    for m in matches:
        cls = type(m.module).__name__
        spec = m.spec
        if spec is None:
            raise _refuse(m, cls, f"hi_na_moe does not recognise its experts ({m.reason})")
        if cls in _REFUSED:
            raise _refuse(m, cls, _REFUSED[cls])
        if spec.n_identity:
            raise _refuse(m, cls, f"{spec.n_identity} identity ('zero') experts beside the routed ones share its "
                                  "router, and distill does not slice them")
        E = int(spec.num_experts)
        experts, layout, keys, inter, decode = m.module, "fused", [], 0, _experts_call
        if spec.members:  # one module an expert, in a block the adapter mirrors (Switch, NLLB-MoE)
            experts, layout = getattr(m.module, "experts", None), "members"
            keys = _member_keys(experts, spec) if isinstance(experts, nn.Module) else None
            decode = _members_decode(m.module)
            if keys is None or decode is None:
                raise _refuse(m, cls, "its per-expert modules or their routing are not the ones distill knows "
                                      "(Switch Transformers' and NLLB-MoE's in transformers 5.23)")
        elif not m.adapter.startswith("experts"):
            raise _refuse(m, cls, "its block mixes routing and experts in one forward, in a way distill does not "
                                  "know")
        else:
            gu = getattr(m.module, "gate_up_proj", None)
            if gu is None:
                gu = getattr(m.module, "up_proj", None)
            down = getattr(m.module, "down_proj", None)
            if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == E for t in (gu, down)):
                # DBRX: per-expert rows stacked flat, [E * intermediate, hidden] (the adapter views them so)
                flat = [p for p in m.module.parameters() if p.dim() >= 1 and p.shape[0] == E * int(spec.intermediate)]
                if not flat or spec.intermediate < 2:
                    raise _refuse(m, cls, "its experts module holds neither [experts, ...] tensors nor flat "
                                          "[experts x intermediate, ...] ones")
                layout, inter = "flat", int(spec.intermediate)
        bname, bmod = _block_module(model, m)
        found = _router(bname, bmod, experts, E, int(spec.hidden if spec.hidden else H))
        if found is None:
            raise DistillError(f"{bname} ({type(bmod).__name__}): no router with one [{E}, hidden] weight beside "
                               "its experts; distill cannot tell which rows to slice")
        rname = found[0]
        ename = m.name if layout != "members" else f"{m.name}.experts"
        out.append(_Block(ename, bname, experts, rname, model.get_submodule(rname), E,
                          torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64),
                          layout=layout, keys=keys, inter=inter, decode=decode))
    counts = {b.num_experts for b in out}
    if len(counts) > 1:
        raise DistillError(f"the MoE blocks of {type(model).__name__} have different expert counts "
                           f"({sorted(counts)}); distill keeps one count for all")
    return out


def _expert_output(b: _Block, x: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e's output on rows x (weight 1), by the experts module's own code: [rows, hidden]."""
    n = x.shape[0]
    if b.layout == "members":
        return b.experts[b.keys[e]](x)
    idx = torch.full((n, 1), e, dtype=torch.long)
    w = torch.ones(n, 1, dtype=x.dtype)
    return b.experts(x, idx, w).reshape(n, -1)


def _forward(model: nn.Module, ids: torch.Tensor):
    """The model on token ids [B, L]; an encoder-decoder gets them as the decoder's input too
    (both stacks' experts see the text)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return model(input_ids=ids, decoder_input_ids=ids, use_cache=False)
    return model(input_ids=ids, use_cache=False)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = _forward(model, ids)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise DistillError(f"{type(model).__name__} gives no logits (a base model without its language-model "
                           "head): load it with its *ForCausalLM / *ForConditionalGeneration class")
    return logits


def _calibrate(model, blocks: list[_Block], windows: list[torch.Tensor], batch_size: int, saliency: bool,
               similarity: bool, progress: bool) -> int:
    busy = {"on": False}

    def hook_for(b: _Block):
        def hook(_mod, args, kwargs):
            if busy["on"]:
                return
            h, idx, w = b.decode(args, kwargs)
            if h is None or idx is None:
                raise DistillError(f"{b.name}: its experts were not called as (hidden_states, top_k_index, "
                                   "top_k_weights)")
            h = h.reshape(-1, h.shape[-1]).detach()
            idx = idx.reshape(h.shape[0], -1)
            b.top_k = max(b.top_k, idx.shape[1])
            valid = idx[(idx >= 0) & (idx < b.num_experts)]
            b.freq += torch.bincount(valid, minlength=b.num_experts).double()
            if similarity:
                have = sum(s.shape[0] for s in b.sample)
                if have < SIMILARITY_TOKENS:
                    b.sample.append(h[:SIMILARITY_TOKENS - have].clone())
            if saliency and w is not None:
                w = w.reshape(h.shape[0], -1).detach()
                busy["on"] = True
                try:
                    for e in valid.unique().tolist():
                        tok, pos = torch.where(idx == e)
                        norms = _expert_output(b, h[tok], e).float().norm(dim=-1)
                        b.sal_sum[e] += float((w[tok, pos].float() * norms).sum())
                finally:
                    busy["on"] = False
        return hook

    handles = [b.experts.register_forward_pre_hook(hook_for(b), with_kwargs=True) for b in blocks]
    n = 0
    try:
        batches = [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]
        for batch in tqdm(batches, desc="calibration", unit="batch", disable=not progress, leave=False):
            L = max(w.numel() for w in batch)
            same = [w for w in batch if w.numel() == L]  # a short last window runs alone
            rest = [w for w in batch if w.numel() != L]
            for group in ([torch.stack(same)] if same else []) + [w.view(1, -1) for w in rest]:
                with torch.no_grad():
                    _forward(model, group)
                n += group.numel()
    finally:
        for hd in handles:
            hd.remove()
    return n


def _scores(b: _Block, score: str, seed: int, layer: int) -> torch.Tensor:
    if score == "frequency":
        return b.freq.clone()
    if score == "saliency":
        return torch.where(b.freq > 0, b.sal_sum / b.freq.clamp(min=1), torch.zeros_like(b.freq))
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return torch.rand(b.num_experts, generator=g, dtype=torch.float64)


def _per_expert(mod: nn.Module, E: int, router: bool, H: int | None):
    """(name, tensor) of `mod`'s own per-expert parameters and persistent buffers: [E, ...] in an
    experts module; [E, H] and [E] in a router."""
    out = []
    for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
        if t is None or t.dim() == 0 or t.shape[0] != E:
            continue
        if router and not (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == H)):
            continue
        out.append((name, t))
    return out


def _similar(b: _Block, kept: list[int], dropped: list[int]) -> dict[int, int]:
    """Each dropped expert's most similar kept one: cosine of their outputs on the sampled block
    inputs (all experts run on the same tokens)."""
    x = torch.cat(b.sample) if b.sample else None
    if x is None or x.shape[0] == 0:
        raise DistillError(f"{b.name}: no calibration tokens reached the block; merge needs its inputs")
    with torch.no_grad():
        outs = {e: _expert_output(b, x, e).float().reshape(-1) for e in kept + dropped}
    into = {}
    for d in dropped:
        sims = [float(torch.nn.functional.cosine_similarity(outs[d], outs[k], dim=0)) for k in kept]
        into[d] = kept[max(range(len(kept)), key=lambda i: sims[i])]
    return into


def distill(model: nn.Module, experts: int, *, top_k: int | None = None, method: str = "prune",
            score: str = "frequency", data=None, tokens: int | None = 8192, seed: int = 0, tokenizer=None,
            seq_len: int = 256, batch_size: int = 8, add_special_tokens: bool = False,
            progress: bool = False) -> nn.Module:
    """A new model of `model`'s class with `experts` experts a MoE block and top-k `top_k`
    (default: the model's, or `experts` if that is smaller); `model` is left as it was.
    `data`: calibration text (a string, a list of strings; `tokenizer` needed) or a tensor of
    token ids, its first `tokens` tokens in windows of `seq_len`. The result's `distill_report`
    (DistillReport) says what was kept, merged and measured."""
    if method not in METHODS:
        raise DistillError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if score not in SCORES:
        raise DistillError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise DistillError(f"experts must be a whole number >= 1, got {experts!r}")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise DistillError(f"tokens must be a whole number >= 1, got {tokens!r}")
    if seq_len < 1 or batch_size < 1:
        raise DistillError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if patching.is_enabled(model):
        raise DistillError("the model is enabled for hi_na_moe; distill reads its own weights: call "
                           "hi_na_moe.disable_for_model(model) first")
    if getattr(model, "config", None) is None:
        raise DistillError(f"{type(model).__name__} has no transformers config to write the new expert count to")
    blocks = _blocks(model)
    E = blocks[0].num_experts
    cfg = _text_config(model.config)
    e_slot = _config_key(cfg, EXPERT_COUNT_KEYS)
    if e_slot is None:
        raise DistillError(f"{type(cfg).__name__} has no expert count key distill knows "
                           f"({', '.join(EXPERT_COUNT_KEYS)})")
    e_holder = _holder(cfg, e_slot[0])
    e_key = e_slot[1]
    # the top-k beside the expert count; none: the router's code fixes it (Switch top-1, NLLB-MoE top-2)
    k_slot = _config_key(e_holder, TOP_K_KEYS)
    k_key = k_slot[1] if k_slot is not None and not k_slot[0] else None
    e_name = f"{type(e_holder).__name__}.{e_key}"
    if getattr(e_holder, e_key) != E:
        raise DistillError(f"{e_name} is {getattr(e_holder, e_key)} but the MoE blocks hold {E} experts")
    if experts >= E:
        raise DistillError(f"experts must be fewer than the model's {E} (got {experts})")
    if k_key is None:
        if top_k is not None:
            raise DistillError(f"top_k cannot change: {type(e_holder).__name__} has no top-k key, its router's "
                               "code fixes it; leave top_k unset")
        K = k_new = 0  # known after calibration: the width of the routing the experts get
    else:
        K = int(getattr(e_holder, k_key))
        k_new = min(K, experts) if top_k is None else top_k
        if not isinstance(k_new, int) or isinstance(k_new, bool) or k_new < 1:
            raise DistillError(f"top_k must be a whole number >= 1, got {top_k!r}")
        if k_new > experts:
            raise DistillError(f"top_k {k_new} is more than the {experts} experts kept")
    n_group = getattr(cfg, "n_group", None)
    if isinstance(n_group, int) and n_group > 1 and experts % n_group:
        # grouped routing (DeepSeek V3, ...) splits a block's experts into n_group equal groups
        raise DistillError(f"experts must be a multiple of {type(cfg).__name__}.n_group ({n_group}) for its "
                           f"grouped routing, got {experts}")
    if data is None:
        raise DistillError("data is needed: calibration text (with tokenizer=) or a tensor of token ids")
    try:
        ids = _token_ids(tokenizer, data, add_special_tokens)
    except ProfileError as exc:
        raise DistillError(str(exc)) from None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise DistillError(f"token id {int(ids.max())} is past the model's {vocab} input embeddings: the "
                           "tokenizer does not belong to this model")
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if isinstance(max_pos, int) and 0 < max_pos < seq_len:
        seq_len = max_pos
    windows = _windows(ids, seq_len, tokens)

    was_training = model.training
    model.eval()
    try:
        n_tokens = _calibrate(model, blocks, windows, batch_size, saliency=score == "saliency",
                              similarity=method == "merge", progress=progress)
    finally:
        model.train(was_training)

    if k_key is None:
        K = k_new = max(b.top_k for b in blocks)
        if experts < K:
            raise DistillError(f"experts must be at least the router's fixed top-k {K} (got {experts})")
    silent = [b.name for b in blocks if score == "saliency" and float(b.freq.sum()) > 0 and float(b.sal_sum.sum()) == 0]
    if silent:  # no routing weights reached the experts: every score would be 0 and the kept set arbitrary
        raise DistillError(f"{silent[0]}: no routing weights were seen (or every expert output was zero), so "
                           "saliency cannot rank its experts; use score='frequency'")
    sd = model.state_dict()
    H = int(getattr(cfg, "hidden_size", 0) or 0)
    layers = []
    expert_bytes_before = expert_bytes_after = 0
    for j, b in enumerate(blocks):
        s = _scores(b, score, seed, j)
        order = torch.argsort(-s, stable=True)
        kept = sorted(order[:experts].tolist())
        dropped = sorted(order[experts:].tolist())
        info = dict(block=b.block_name, router=b.router_name, experts=b.name, kept=kept, dropped=dropped,
                    scores=[round(float(v), 6) for v in s], routings=[int(v) for v in b.freq])
        groups = {k: [k] for k in kept}
        if method == "merge":
            into = _similar(b, kept, dropped)
            for d, k in into.items():
                groups[k].append(d)
            info["merged_into"] = {str(d): k for d, k in into.items()}

        def combine(per, merge: bool) -> list[torch.Tensor]:
            """The kept experts' tensors from `per` (expert e's tensor at [e]): each kept one's own,
            or with merge its group's average weighted by routing frequency."""
            if not merge:
                return [per[k].clone() for k in kept]
            rows = []
            for k in kept:
                members = groups[k]
                f = b.freq[members]
                wts = f / f.sum() if float(f.sum()) > 0 else torch.full((len(members),), 1 / len(members),
                                                                         dtype=torch.float64)
                rows.append(sum(float(wt) * per[m].double() for wt, m in zip(wts, members)).to(per[k].dtype))
            return rows

        units = [(f"{b.router_name}.{n}", t, True) for n, t in _per_expert(b.router, E, True, H)]
        if b.layout == "fused":
            units += [(f"{b.name}.{n}", t, False) for n, t in _per_expert(b.experts, E, False, H)]
        elif b.layout == "flat":
            units += [(f"{b.name}.{n}", t, False) for n, t in b.experts.named_parameters()
                      if t.dim() >= 1 and t.shape[0] == E * b.inter]
        for key, _t, is_router in units:
            if key not in sd:  # a non-persistent buffer: the new model computes its own
                continue
            src = sd[key].detach()
            per = src.view(E, b.inter, *src.shape[1:]) if b.layout == "flat" and not is_router else src
            # the router's rows of a kept expert stay as they were, merged or not
            new = torch.stack(combine(per, method == "merge" and not is_router))
            sd[key] = new.reshape(-1, *src.shape[1:]) if per is not src else new
            if not is_router:
                expert_bytes_before += src.numel() * src.element_size()
                expert_bytes_after += new.numel() * new.element_size()
        if b.layout == "members":  # expert e's module -> its tensors; the kept ones renumbered 0..N-1
            heads = [f"{b.name}.{k}." for k in b.keys]
            suffixes = [key[len(heads[0]):] for key in sd if key.startswith(heads[0])]
            olds = {sfx: [sd[h + sfx].detach() for h in heads] for sfx in suffixes}
            for h in heads:
                for key in [key for key in sd if key.startswith(h)]:
                    expert_bytes_before += sd[key].numel() * sd[key].element_size()
                    del sd[key]
            stem = re.fullmatch(r"(\D*)\d+", b.keys[0]).group(1)
            for sfx, per in olds.items():
                for i, t in enumerate(combine(per, method == "merge")):
                    sd[f"{b.name}.{stem}{i}.{sfx}"] = t
                    expert_bytes_after += t.numel() * t.element_size()
        layers.append(info)

    new_config = copy.deepcopy(model.config)
    new_cfg = _text_config(new_config)
    setattr(_holder(new_cfg, e_slot[0]), e_key, experts)
    if k_key is not None:
        setattr(_holder(new_cfg, e_slot[0]), k_key, k_new)
    try:
        new = type(model)._from_config(new_config, dtype=model.dtype)
    except Exception as exc:
        raise DistillError(f"{type(model).__name__} cannot be built with {e_key}={experts}, top-k {k_new}: "
                           f"{exc}") from None
    missing, unexpected = [], []
    try:
        res = new.load_state_dict(sd, strict=False)
        missing, unexpected = list(res.missing_keys), list(res.unexpected_keys)
    except RuntimeError as exc:  # a shape mismatch: some per-expert tensor distill did not slice
        first = str(exc).strip().splitlines()
        raise DistillError(f"{type(model).__name__}: the sliced weights do not fit the {experts}-expert model "
                           f"({first[1].strip() if len(first) > 1 else first[0]}); distill does not know this "
                           "family's per-expert tensors") from None
    if missing or unexpected:
        raise DistillError(f"{type(model).__name__}: the {experts}-expert model's weights differ from the "
                           f"original's (missing {missing[:3]}, unexpected {unexpected[:3]})")
    new.eval()
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)

    def nbytes(m):
        return sum(p.numel() * p.element_size() for p in m.state_dict().values())

    report = DistillReport(
        source=str(getattr(model.config, "_name_or_path", "") or type(model).__name__), model_class=type(model).__name__,
        method=method, score=score, experts_before=E, experts_after=experts, top_k_before=K, top_k_after=k_new,
        calibration_tokens=n_tokens, seed=seed, layers=layers, param_bytes_before=nbytes(model),
        param_bytes_after=nbytes(new), expert_bytes_before=expert_bytes_before, expert_bytes_after=expert_bytes_after)
    try:
        report.agreement = _agreement(model, new, windows)
    except Exception as exc:  # the written config would not run: refuse it rather than write it
        raise DistillError(f"the {experts}-expert {type(model).__name__} does not run ({type(exc).__name__}: "
                           f"{exc}); distill does not know this family's constraints on the expert count") from None
    new.distill_report = report
    return new


def _agreement(ref: nn.Module, new: nn.Module, windows: list[torch.Tensor]) -> dict | None:
    """KL and top-1 of `new` against `ref` on the first calibration tokens (in-sample: the tokens
    the experts were scored on)."""
    take, n = [], 0
    for w in windows:
        if n >= CARD_TOKENS:
            break
        take.append(w)
        n += w.numel()
    if not take:
        return None
    kls, tops, count = 0.0, 0.0, 0
    with torch.no_grad():
        if getattr(_forward(ref, take[0][:2].view(1, -1)), "logits", None) is None:
            return None  # a base model without its head: nothing to compare
        for w in take:
            a = _logits(ref, w.view(1, -1))[0].float()
            b = _logits(new, w.view(1, -1))[0].float()
            kl, top1 = logits_agreement(a, b)
            kls += kl * w.numel()
            tops += top1 * w.numel()
            count += w.numel()
    return dict(tokens=count, kl=kls / count, top1=tops / count)


# ---------------------------------------------------------------------------------------------
# Repair: the routers fine-tuned with the original model as teacher
# ---------------------------------------------------------------------------------------------

# Repair state: a file in the directory the caller names, replaced whole at every save
STATE_FILE = "repair_state.pt"
STATE_FORMAT = "hi_na_moe.distill_repair_state"
# steps between saves of the repair state (a save of the shipped model's routers and experts and
# their Adam moments writes about 40 MB)
SAVE_EVERY = 25


def _run_identity(report: DistillReport, ids: torch.Tensor, **options) -> dict:
    """What makes two repair runs the same run: the distilled model (its report's choices), the
    data and the options a step depends on. `steps` and `max_seconds` are not in it: a longer run
    continues a shorter one's steps."""
    return dict(source=report.source, model_class=report.model_class, method=report.method, score=report.score,
                experts=report.experts_after, top_k=report.top_k_after, distill_seed=report.seed,
                calibration_tokens=report.calibration_tokens, kept=[L["kept"] for L in report.layers],
                merged_into=[L.get("merged_into") for L in report.layers],
                data_sha256=hashlib.sha256(ids.numpy().tobytes()).hexdigest(), **options)


def _save_state(path: Path, state: dict) -> None:
    """Written beside, then renamed over the last one: a kill mid-write leaves the previous state."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DistillError(f"repair state {str(path)!r}: writing failed ({exc.strerror or exc})") from None


def _load_state(path: Path, identity: dict) -> dict | None:
    if not path.is_file():
        return None
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # not one torch.save wrote whole: os.replace never leaves a partial file
        raise DistillError(f"repair state {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); remove it "
                           "to start the repair over") from None
    if not isinstance(st, dict) or st.get("format") != STATE_FORMAT:
        raise DistillError(f"repair state {str(path)!r} is not a distill repair state; remove it")
    was = st.get("identity", {})
    differs = [k for k in identity if was.get(k) != identity[k]]
    if differs:
        raise DistillError(f"repair state {str(path)!r} belongs to another run ({', '.join(differs[:3])} "
                           "differ); remove it to start over, or repeat that run's options")
    return st


def repair(model: nn.Module, teacher: nn.Module, data: torch.Tensor, *, steps: int = 200, lr: float = 1e-3,
           seq_len: int = 256, batch_size: int = 4, seed: int = 0, max_seconds: float | None = None,
           train_experts: bool = False, progress: bool = False, state: str | Path | None = None,
           save_every: int | None = None) -> nn.Module:
    """Fine-tune the routers of `model` (a distill() result) in place for at most `steps` Adam
    steps (and `max_seconds`): each step a seeded batch of `seq_len`-token windows of `data`
    (token ids), loss the mean KL(teacher || model) of the next-token distributions. Only the
    router weights and biases distill sliced learn (and the routed experts' weights with
    `train_experts`); attention, norms, embeddings and shared experts stay as written. The
    report's `repair` gets the steps run, the seconds, and the KL on the first batch before and
    after.

    `state` (a directory): the run is resumable. Every `save_every` steps (default SAVE_EVERY) and at the end, the
    trainable weights, Adam's state, the step, the batch generator's (the data position) and
    torch's RNG state are saved there (repair_state.pt, replaced whole). A call finding a state
    there continues from its step and ends as the uninterrupted run would; a state of another
    run (other model, data or options) is an error. The caller removes the directory when the
    result is written."""
    report = getattr(model, "distill_report", None)
    if not isinstance(report, DistillReport):
        raise DistillError("repair takes a distill() result (the model has no distill_report)")
    if not isinstance(steps, int) or steps < 1:
        raise DistillError(f"repair steps must be a whole number >= 1, got {steps!r}")
    save_every = SAVE_EVERY if save_every is None else save_every
    if not isinstance(save_every, int) or save_every < 1:
        raise DistillError(f"save_every must be a whole number >= 1, got {save_every!r}")
    if not isinstance(data, torch.Tensor) or data.dtype not in (torch.int32, torch.int64):
        raise DistillError("repair data must be a tensor of token ids")
    ids = data.reshape(-1).long()
    n = ids.numel() // seq_len
    if n < 1:
        raise DistillError(f"repair data has {ids.numel()} tokens, fewer than one window of {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    train = [p for L in report.layers for p in model.get_submodule(L["router"]).parameters(recurse=False)]
    if train_experts:  # every weight of the experts module: one submodule an expert, or DBRX's mlp
        train += [p for L in report.layers for p in model.get_submodule(L["experts"]).parameters()]
    train = list({id(p): p for p in train}.values())
    names = {id(p): name for name, p in model.named_parameters()}
    trained = "routers and experts" if train_experts else "routers"
    identity = _run_identity(report, ids, lr=lr, batch=batch_size, seq_len=seq_len, seed=seed, trained=trained,
                             params=[names[id(p)] for p in train])
    path = None
    if state is not None:
        sdir = Path(state).expanduser()
        try:
            sdir.mkdir(exist_ok=True)
        except OSError as exc:
            raise DistillError(f"repair state directory {str(sdir)!r} cannot be made ({exc.strerror or exc})") from None
        path = sdir / STATE_FILE
    opt = torch.optim.Adam(train, lr=lr)
    g = torch.Generator().manual_seed(seed)
    fixed = windows[torch.randperm(n, generator=g)[:batch_size]]
    done, spent, before = 0, 0.0, None
    saved = _load_state(path, identity) if path is not None else None
    if saved is not None:
        if saved["step"] > steps:
            raise DistillError(f"repair state {str(path)!r} is at step {saved['step']}, past steps={steps}; ask "
                               "for at least that many, or remove it to start over")
        with torch.no_grad():
            for p in train:
                p.copy_(saved["params"][names[id(p)]])
        opt.load_state_dict(saved["optimizer"])
        g.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        done, spent, before = int(saved["step"]), float(saved["seconds"]), float(saved["kl_before"])

    def kl(batch):
        with torch.no_grad():
            t = _logits(teacher, batch).float().log_softmax(-1)
        s_ = _logits(model, batch).float().log_softmax(-1)
        return (t.exp() * (t - s_)).sum(-1).mean()

    def save():
        _save_state(path, dict(format=STATE_FORMAT, identity=identity, step=done, kl_before=before,
                               seconds=spent + time.perf_counter() - start,
                               params={names[id(p)]: p.detach().clone() for p in train},
                               optimizer=opt.state_dict(), generator=g.get_state(), torch_rng=torch.get_rng_state()))

    was = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in train:
        p.requires_grad_(True)
    start = time.perf_counter()
    try:
        if before is None:
            with torch.no_grad():
                before = float(kl(fixed))
        last_saved = done if saved is not None else -1
        with tqdm(total=steps, initial=done, desc="repair", unit="step", disable=not progress, leave=False) as bar:
            while done < steps:
                if max_seconds is not None and spent + time.perf_counter() - start > max_seconds:
                    break
                batch = windows[torch.randint(0, n, (batch_size,), generator=g)]
                loss = kl(batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                done += 1
                bar.update(1)
                bar.set_postfix(kl=f"{loss.item():.4f}")
                if path is not None and done % save_every == 0:
                    save()
                    last_saved = done
        if path is not None and last_saved != done:
            save()
        with torch.no_grad():
            after = float(kl(fixed))
    finally:
        for p, r in was.items():
            p.requires_grad_(r)
        for p in train:
            p.grad = None
    report.agreement = _agreement(teacher, model, list(windows))  # the card's figures: after the repair
    report.repair = dict(steps=done, trained=trained, lr=lr, batch=batch_size, seq_len=seq_len, tokens=int(n * seq_len),
                         seconds=round(spent + time.perf_counter() - start, 1), kl_before=before, kl_after=after)
    return model


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def check_out(out: str | Path, force: bool = False) -> Path:
    """`out` as a directory distill may write: refused when it is a file, or a non-empty
    directory without `force`, or when nothing can be created beside it. Leaves nothing behind."""
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise DistillError(f"--out {str(out)!r} is a file, not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise DistillError(f"--out {str(out)!r} is not empty (--force, or force=True, replaces it)")
    parent = p.resolve().parent
    if not parent.is_dir():  # not created here: a failure later would leave it behind
        raise DistillError(f"--out {str(out)!r}: its parent directory {str(parent)!r} does not exist (create it first)")
    try:
        probe = tempfile.mkdtemp(prefix=f".{p.name}.distill-", dir=parent)
    except OSError as exc:
        raise DistillError(f"--out {str(out)!r}: cannot write in {str(parent)!r} ({exc.strerror or exc})") from None
    os.rmdir(probe)
    return p


def _gib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def model_card(report: DistillReport) -> str:
    r = report
    how = ("each block's lowest-scored experts dropped, the router's rows (and per-expert bias) of the kept ones "
           "sliced out" if r.method == "prune" else
           "each dropped expert folded into the kept expert whose outputs on calibration tokens are most similar "
           "(cosine), weight matrices averaged by routing frequency; the kept experts' router rows unchanged, the "
           "dropped experts' rows removed")
    score = {"frequency": "routing frequency (token-slot routings per expert)",
             "saliency": "REAP-style saliency (router weight x expert output norm, averaged over the tokens routed "
                         "to the expert)",
             "random": f"random (seed {r.seed}), a baseline"}[r.score]
    lines = [
        "# Distilled MoE (hi-na-moe distill)", "",
        f"Made from `{r.source}` ({r.model_class}) by `hi_na_moe.tools.distill`: {r.experts_before} -> "
        f"{r.experts_after} experts a MoE block, top-k {r.top_k_before} -> {r.top_k_after}. "
        "A plain transformers checkpoint: `AutoModelForCausalLM.from_pretrained` loads it without hi_na_moe.", "",
        "## What was done", "",
        f"- method: {r.method} ({how})",
        f"- expert score: {score}",
        f"- calibration: {r.calibration_tokens} tokens", "",
        "| block | kept experts | dropped | merged into |", "|---|---|---|---|"]
    for L in r.layers:
        merged = ", ".join(f"{d}->{k}" for d, k in L.get("merged_into", {}).items()) or "-"
        lines.append(f"| {L['block']} | {L['kept']} | {L['dropped']} | {merged} |")
    lines += ["", "## What was measured", "",
              f"- parameters: {_gib(r.param_bytes_before)} -> {_gib(r.param_bytes_after)}; routed-expert weights "
              f"{_gib(r.expert_bytes_before)} -> {_gib(r.expert_bytes_after)}",
              f"- expert bytes a token reads: x{r.top_k_after / r.top_k_before:.2f} (top-k {r.top_k_before} -> "
              f"{r.top_k_after}; fewer experts at the same top-k read the same bytes a token)"]
    if r.agreement:
        a = r.agreement
        lines.append(f"- against the original on {a['tokens']} calibration tokens (in-sample, not held-out): mean "
                     f"KL {a['kl']:.4f} nats/token, top-1 agreement {a['top1']:.1%}")
    if r.repair:
        rp = r.repair
        at = next(i for i, ln in enumerate(lines) if ln.startswith("- calibration:")) + 1
        lines.insert(at,
                     f"- repair: the {rp['trained']} fine-tuned for {rp['steps']} steps (Adam, lr {rp['lr']:g}, "
                     f"{rp['batch']} x {rp['seq_len']} tokens a step, {rp['seconds']:.0f} s) with the original as "
                     f"teacher (KL on the logits); KL on a fixed calibration batch {rp['kl_before']:.4f} -> "
                     f"{rp['kl_after']:.4f}")
    lines += ["- held-out quality was not measured by this command; benchmarks/quality_distill.py measures it",
              "", "Per-block scores and routing counts: distill.json."]
    return "\n".join(lines) + "\n"


def save_distilled(model: nn.Module, out: str | Path, *, force: bool = False, tokenizer=None) -> Path:
    """Write `model` (a distill() result) to `out`: safetensors and config by save_pretrained, the
    tokenizer if given, README.md (the model card) and distill.json. Built in a temp directory
    beside `out` and renamed into place; on any failure nothing is left behind and an existing
    `out` (replaced only with `force`) is untouched."""
    report = getattr(model, "distill_report", None)
    if not isinstance(report, DistillReport):
        raise DistillError("save_distilled writes a distill() result (the model has no distill_report)")
    p = check_out(out, force)
    parent = p.resolve().parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.distill-", dir=parent))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 is for a temp dir, not for a model others read
    except OSError as exc:
        raise DistillError(f"--out {str(out)!r}: cannot write in {str(parent)!r} ({exc.strerror or exc})") from None
    old = None
    try:
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        (tmp / "README.md").write_text(model_card(report), encoding="utf-8")
        (tmp / "distill.json").write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
        if p.exists():
            old = parent / f".{p.name}.replaced-{os.getpid()}"
            p.rename(old)
        tmp.rename(p)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not p.exists():
            old.rename(p)
        if isinstance(exc, OSError):
            raise DistillError(f"--out {str(out)!r}: writing failed ({exc.strerror or exc}); nothing was left "
                               "behind") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return p


__all__ = ["DistillError", "DistillReport", "METHODS", "SCORES", "check_out", "distill", "model_card", "repair",
           "save_distilled"]

