"""Where a model's tokens go: every routing decision of every MoE block on real text, and what it
means for keeping experts in memory.

`profile_router(model, tokenizer, data)` runs the text through the model as it is (hi_na_moe
enabled or not) in windows of `seq_len` tokens and records, through forward hooks, the experts
each MoE block routes every token to, their routing weights and the hidden state entering the
block (`adapters.discover` finds the blocks, as enable does). Interface experts are hooked where
their block hands them `top_k_index` (as `hi-na-moe bench --batch-size` watches them); blocks
that mix routing and experts in one forward are read at their router module (`_BLOCK_RECORDERS`).

From the records (`RouterProfile.figures`):
- per block: expert load, imbalance (max/mean, coefficient of variation), load entropy, routing
  entropy (of the softmax over the router's logits, where the router can be applied), the share
  of a token's routing weight in its top 1..k experts, the most frequent pairs of experts
  chosen together;
- over time (tokens in text order, blocks in model order within a token): the reuse distance of
  every expert, and the hit rate of a cache of expert slots against its size (fractions of all
  experts) for each policy of `cache_policy`, Belady's offline optimum included;
- across layers: how well the router of the block of decoder layer j, applied to the residual
  stream after decoder layer j-1 (through layer j's own norm before the block), predicts the
  experts that block then chooses: available before layer j's attention runs, which is when a
  memory tier would start loading. Recall and precision of its top-m for m = k and 2k, beside the
  m most loaded experts as a static guess. Also from the previous block's own input.
  A router is applied standalone as top-k of its logits (a Linear, or a module with one
  [experts, hidden] weight): this is checked on every block's own input, and a block whose
  router chooses otherwise (score-correction bias, expert groups, capacity limits) is marked so;
- advice: the cache size reaching 80/90/95 % hit rate under the best online policy (slots, and
  bytes in the model's dtype, int8 and int4), and the experts worth pinning.

`RouterProfile.save(dir)` writes profile.json (every figure), expert_prior.json (per block and
expert the routing counts and frequencies: a memory tier's prior), routing.safetensors (the raw
trace) and, with matplotlib installed, three PNG plots.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from ..core import cache_policy as cp
from ..integrate.adapters import BlockMatch, discover
from ..integrate.patching import inspect_model
from .debug import _decoder_layers as layers
from . import top_k_advice
from .plan import packed_expert_bytes

FORMAT = "hi_na_moe.router_profile"
PRIOR_FORMAT = "hi_na_moe.expert_prior"
VERSION = 1
# cache sizes of the hit-rate curves, as fractions of all experts of the model (denser at the
# small end, where memory is short and the policies part)
SIZE_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TARGETS = (0.8, 0.9, 0.95)
# the router of a block counts as applicable standalone when the top-k of its logits gives the
# block's own recorded choice on at least this share of tokens (float32 logits of a bfloat16
# router can swap near ties)
STANDALONE_AGREEMENT = 0.99
# an expert is worth pinning when its block routes at least this many times its uniform share to it
PIN_FACTOR = 2.0
# FreqDecay's half-life in tokens for the report: on the shipped model's held-out text (8192 tokens)
# half-lives of 16-128 tokens came within 0.5 points of each other at 19-81 % of the experts cached,
# 32 at or next to the top; 4 tokens was 1-2 points lower, 1024 up to 1 (2026-12-07)
HALF_LIFE = 32.0


class ProfileError(ValueError):
    """Input the profile cannot be made from (no MoE block, no tokens, ...): the message names it."""


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------

@dataclass
class _Recorder:
    """How one block's routing is read: a hook on `module` ("pre": its inputs; "post": inputs
    and output) and `decode(args, kwargs, output)` -> (hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k] or None)."""

    module: nn.Module
    kind: str
    decode: Callable
    where: str  # for the report: what is read


def _experts_call(args, kwargs, _out=None):
    """What transformers' experts contract passes: (hidden_states, top_k_index, top_k_weights)."""
    h = args[0] if args else kwargs.get("hidden_states")
    idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    w = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
    return h, idx, w


def _llama4(block):
    """Mirrors transformers 5.23 Llama4TextMoe (as adapters._llama4_forward): the top-k of the
    router's logits."""
    def decode(args, kwargs, out):
        scores, logits = out
        idx = torch.topk(logits, block.router.top_k, dim=1).indices
        return args[0], idx, scores.gather(1, idx)
    return _Recorder(block.router, "post", decode, "router output (top-k of its logits)")


def _jetmoe(block):
    """JetMoE's top-k gating (MoE and MoA blocks): the top-k of its float logits, as it takes
    them, with its softmax over those k."""
    def decode(args, kwargs, out):
        logits = out[4]
        top, idx = logits.topk(block.router.top_k, dim=1)
        return args[0], idx, torch.softmax(top, dim=1)
    return _Recorder(block.router, "post", decode, "router output (top-k of its logits)")


def _doge(block):
    """Mirrors transformers 5.23 DogeCDMoE's product-key routing (as adapters._doge_forward)."""
    def decode(args, kwargs, out):
        h = args[0]
        bsz, seq_len = h.shape[0], h.shape[1]
        logits = out.view(2, bsz * seq_len, -1)
        (sx, sy), (ix, iy) = logits.topk(block.num_keys, dim=-1)
        scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)
        indices = (ix.unsqueeze(-1) * block.num_keys + iy.unsqueeze(-2)).flatten(-2)
        top, pos = scores.topk(block.top_k, dim=-1)
        w = F.softmax(top, dim=-1)
        if block.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return h.reshape(-1, h.shape[-1]), indices.gather(-1, pos), w
    return _Recorder(block.router_gate, "post", decode, "router_gate output (product-key top-k)")


def _switch(block):
    """SwitchTransformersSparseMLP: the experts module gets a one-hot row per token ([T, 1, E],
    all zeros where capacity dropped the token: recorded as -1)."""
    def decode(args, kwargs, out):
        h, sel, w = args[0], args[1], args[2]
        idx = torch.where(sel.any(-1), sel.argmax(-1), -1).view(-1, 1)
        return h, idx, w.reshape(-1, 1)
    return _Recorder(block.experts, "pre", decode, "experts input (one-hot top-1)")


def _nllb(block):
    """NllbMoeSparseMLP: the router's choice, the experts of nonzero combine weight (its kept
    top-1 and top-2; -1 where capacity dropped one)."""
    def decode(args, kwargs, out):
        h, probs = args[0], args[2]
        w, idx = probs.float().topk(min(2, probs.shape[-1]), dim=-1)
        return h, torch.where(w != 0, idx, -1), w
    return _Recorder(block.experts, "pre", decode, "experts input (router's top-2 combine weights)")


_BLOCK_RECORDERS: dict[str, Callable[[nn.Module], _Recorder]] = {
    "Llama4TextMoe": _llama4, "JetMoeMoE": _jetmoe, "JetMoeMoA": _jetmoe, "DogeCDMoE": _doge,
    "SwitchTransformersSparseMLP": _switch, "NllbMoeSparseMLP": _nllb,
}


def _recorder(match: BlockMatch) -> _Recorder | None:
    cls = type(match.module).__name__
    if cls in _BLOCK_RECORDERS:
        return _BLOCK_RECORDERS[cls](match.module)
    if match.adapter.startswith("experts"):
        return _Recorder(match.module, "pre", _experts_call, "experts input (top_k_index)")
    return None


def _block_module(model: nn.Module, match: BlockMatch) -> tuple[str, nn.Module]:
    """The MoE block around a match: the experts module's parent for experts-level matches."""
    if match.adapter.startswith("experts") and "." in match.name:
        parent = match.name.rpartition(".")[0]
        return parent, model.get_submodule(parent)
    return match.name, match.module


def _router(block_name: str, block: nn.Module, experts: nn.Module | None, E: int, H: int):
    """(name, weight [E, H], bias [E] or None) of the block's router: the one module in the block,
    outside its experts, holding a 2-D [E, H] parameter; None when there is not exactly one."""
    skip = set() if experts is None or experts is block else {id(m) for m in experts.modules()}
    found = []
    for name, m in block.named_modules():
        if id(m) in skip:
            continue
        w = m._parameters.get("weight")
        if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (E, H):
            b = m._parameters.get("bias")
            found.append((f"{block_name}.{name}" if name else block_name, w,
                          b if isinstance(b, torch.Tensor) and tuple(b.shape) == (E,) else None))
    return found[0] if len(found) == 1 else None


def _num_experts(match: BlockMatch, block: nn.Module) -> int:
    """The block's expert count (0: unknown until its routing is seen)."""
    if match.spec is not None:
        return int(match.spec.num_experts)
    for m in (block, getattr(block, "router", None), getattr(block, "experts", None)):
        for key in ("num_experts", "num_local_experts"):
            v = getattr(m, key, None) if m is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return 0


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return layers(model)


@dataclass
class _Block:
    index: int
    name: str  # the discovered block (experts module for experts-level matches)
    block_name: str
    recorder: _Recorder | None
    layer: int | None = None  # decoder layer index
    num_experts: int = 0
    top_k: int = 0
    router: str | None = None
    router_w: torch.Tensor | None = None
    router_b: torch.Tensor | None = None
    router_note: str = ""
    norm: nn.Module | None = None  # the module whose output enters the block (found on the first batch)
    norm_name: str | None = None
    # per-batch records: [hidden, idx, weights]
    calls: list = field(default_factory=list)
    idx: list = field(default_factory=list)
    w: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    # router self-check and figures from its logits
    agree: int = 0
    rows: int = 0
    entropy_sum: float = 0.0
    mass_sum: np.ndarray | None = None
    # predictions: variant -> m -> [hits, rows]
    pred: dict = field(default_factory=dict)
    error: str | None = None
    first_call: int | None = None  # order of the first call in the first forward (execution order)


def _logits(b: _Block, h: torch.Tensor) -> torch.Tensor:
    w = b.router_w.detach().float()
    return F.linear(h.detach().float(), w, None if b.router_b is None else b.router_b.detach().float())


def _overlap(pred: torch.Tensor, actual: torch.Tensor) -> int:
    """Sum over rows of |pred ∩ actual| (actual's -1 slots match nothing)."""
    return int((pred.unsqueeze(-1) == actual.unsqueeze(-2)).any(-2).logical_and(actual >= 0).sum())


# ---------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------

@dataclass
class RouterProfile:
    """Every routing decision of a run and the figures made from them (see the module docstring).
    `indices[b]` / `weights[b]`: block b's [tokens, k] experts and routing weights (-1: a slot
    that routed nowhere), `hidden[b]` the [tokens, hidden] states entering it (keep_hidden)."""

    model: str
    model_type: str
    dtype: str
    tokens: int
    seq_len: int
    blocks: list[dict]
    indices: list[torch.Tensor]
    weights: list[torch.Tensor | None]
    hidden: list[torch.Tensor] | None
    figures: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "model_type": self.model_type,
                "dtype": self.dtype, "tokens": self.tokens, "seq_len": self.seq_len, "blocks": self.blocks,
                "notes": self.notes, **self.figures}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(_jsonable(self.to_dict()), indent=indent)

    def prior(self) -> dict:
        """Per block and expert: how often tokens routed there (a memory tier's prior)."""
        out = []
        for b, f in zip(self.blocks, self.figures["per_block"]):
            out.append({"block": b["name"], "layer": b["layer"], "num_experts": b["num_experts"],
                        "top_k": b["top_k"], "counts": f["load"]["counts"], "frequency": f["load"]["share"]})
        return {"format": PRIOR_FORMAT, "version": VERSION, "model": self.model, "tokens": self.tokens,
                "key": "(block index, expert): frequency = the expert's share of its block's routed slots",
                "blocks": out}

    def save(self, out_dir: str | Path, plots: bool = True) -> dict[str, Any]:
        """Write profile.json, expert_prior.json, routing.safetensors and (plots, matplotlib
        installed) the PNG plots to out_dir; returns {"files": [...], "plots_skipped": reason or None}."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = []
        skipped = None
        if plots:
            try:
                made = write_plots(self, out)
            except ImportError:
                made = {}
                skipped = ("matplotlib is not installed: plots skipped (pip install 'hi_na_moe[profile]' "
                           "or pip install matplotlib)")
            self.figures["plots"] = made
            files += [str(out / name) for name in made]
        else:
            self.figures["plots"] = {}
        (out / "profile.json").write_text(self.to_json(), encoding="utf-8")
        (out / "expert_prior.json").write_text(json.dumps(_jsonable(self.prior()), indent=1), encoding="utf-8")
        tensors = {}
        for i, idx in enumerate(self.indices):
            tensors[f"block{i}.top_k_index"] = idx.to(torch.int32).contiguous()
            if self.weights[i] is not None:
                tensors[f"block{i}.top_k_weights"] = self.weights[i].float().contiguous()
            if self.hidden is not None:
                tensors[f"block{i}.hidden"] = self.hidden[i].contiguous()
        save_file(tensors, str(out / "routing.safetensors"),
                  metadata={"format": FORMAT, "blocks": json.dumps([b["name"] for b in self.blocks])})
        files = [str(out / "profile.json"), str(out / "expert_prior.json"), str(out / "routing.safetensors")] + files
        return {"files": files, "plots_skipped": skipped}

    def summary(self) -> str:
        return format_summary(self.to_dict())


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating, float)):
        v = float(o)
        return v if math.isfinite(v) else None
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    return o


def _windows(ids: torch.Tensor, seq_len: int, tokens: int | None) -> list[torch.Tensor]:
    ids = ids.reshape(-1)
    if tokens is not None:
        ids = ids[:tokens]
    return [ids[i:i + seq_len] for i in range(0, ids.numel(), seq_len)]


def _token_ids(tokenizer, data, add_special_tokens: bool) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype not in (torch.int32, torch.int64) or data.numel() == 0:
            raise ProfileError("data: a tensor of token ids must be a non-empty int32/int64 tensor")
        return data.reshape(-1).long()
    texts = [data] if isinstance(data, str) else list(data)
    if not texts or not any(isinstance(t, str) and t.strip() for t in texts):
        raise ProfileError("data has no text (empty)")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ProfileError(f"data[{bad}] is {type(texts[bad]).__name__}, not a string")
    if tokenizer is None:
        raise ProfileError("texts need a tokenizer (pass tokenizer=, or token ids as a tensor)")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "longer than the maximum length": it is cut into windows here
    try:
        ids = [i for t in texts if t for i in tokenizer(t, add_special_tokens=add_special_tokens).input_ids]
    finally:
        hf_logging.set_verbosity(level)
    if not ids:
        raise ProfileError("data gives no tokens")
    return torch.tensor(ids, dtype=torch.long)


def profile_router(model: nn.Module, tokenizer=None, data=None, tokens: int | None = None, *,
                   seq_len: int | None = None, batch_size: int = 8, keep_hidden: bool = False,
                   add_special_tokens: bool = True, policies: Sequence[str] = tuple(cp.POLICIES),
                   fractions: Sequence[float] = SIZE_FRACTIONS, half_life: float = HALF_LIFE,
                   kl_budget: float | None = None, progress: bool = False) -> RouterProfile:
    """Profile the routing of `model` on `data` (a text, a list of texts, or a tensor of token
    ids), its first `tokens` tokens (None: all) in windows of `seq_len` (default: 256, or the
    model's max_position_embeddings if smaller), `batch_size` windows a forward. `keep_hidden`
    keeps every block's input states in the profile (tokens x hidden each). `policies` and
    `fractions`: the hit-rate curves' policies and cache sizes (fractions of all experts);
    `half_life`: FreqDecay's, in tokens. `kl_budget` (nats a token): also measure the adaptive top-k
    threshold that keeps the logits' KL within it (hi_na_moe.tools.top_k_advice: runs the model
    again per threshold; the profile's advice["top_k"]). `progress`: tqdm bars on stderr."""
    if kl_budget is not None and not kl_budget > 0:
        raise ProfileError(f"kl_budget must be > 0 nats a token (or None: not measured), got {kl_budget!r}")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ProfileError(f"tokens must be a positive integer, got {tokens!r}")
    if batch_size < 1:
        raise ProfileError(f"batch_size must be >= 1, got {batch_size}")
    matches = discover(model)
    if not matches:
        raise ProfileError(f"no MoE block found in {type(model).__name__}: nothing routes tokens to experts")
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    max_pos = getattr(text_cfg, "max_position_embeddings", None)
    if seq_len is None:
        seq_len = min(256, max_pos) if isinstance(max_pos, int) and max_pos > 0 else 256
    if seq_len < 1:
        raise ProfileError(f"seq_len must be >= 1, got {seq_len}")
    ids = _token_ids(tokenizer, data, add_special_tokens)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:
        raise ProfileError(f"token id {int(ids.max())} is past the model's {vocab} input embeddings: the tokenizer "
                           "does not belong to this model")
    windows = _windows(ids, seq_len, tokens)
    n_tokens = sum(w.numel() for w in windows)
    notes: list[str] = []
    if tokens is not None and n_tokens < tokens:
        notes.append(f"the data has {n_tokens} tokens, fewer than the {tokens} asked for: all of them profiled")

    layers = _decoder_layers(model)
    layer_of = {}
    for j, (lname, _) in enumerate(layers):
        layer_of[lname] = j

    blocks: list[_Block] = []
    for i, m in enumerate(matches):
        bname, bmod = _block_module(model, m)
        rec = _recorder(m)
        b = _Block(i, m.name, bname, rec)
        b.layer = next((j for lname, j in layer_of.items() if m.name == lname or m.name.startswith(lname + ".")), None)
        if rec is None:
            b.error = f"no way known to read the routing of {type(m.module).__name__} blocks"
        experts = m.module if m.adapter.startswith("experts") else getattr(bmod, "experts", None)
        b.num_experts = _num_experts(m, bmod)
        hidden = m.spec.hidden if m.spec is not None else getattr(text_cfg, "hidden_size", None)
        found = _router(bname, bmod, experts, b.num_experts, hidden) if b.num_experts and hidden else None
        if found is None:
            b.router_note = ("no router module with one [experts, hidden] weight in the block: it cannot be "
                             "applied standalone (no prediction, no router entropy)")
        else:
            b.router, b.router_w, b.router_b = found
        blocks.append(b)
    if all(b.recorder is None for b in blocks):
        raise ProfileError("; ".join(b.error for b in blocks if b.error))

    # -- hooks
    handles = []
    first = {"on": True}
    # data_ptr -> (output, name, module) of this decoder layer's modules, the outputs held so that
    # no other tensor can take their memory while the layer runs
    produced: dict[int, tuple[torch.Tensor, str, nn.Module]] = {}
    resid: dict[int, torch.Tensor] = {}  # decoder layer -> its output, this batch

    calls = [0]

    def on_call(b: _Block):
        def hook(mod, args, kwargs, out=None):
            if b.first_call is None:
                b.first_call = calls[0]
                calls[0] += 1
            try:
                h, idx, w = b.recorder.decode(args, kwargs, out)
            except Exception as exc:  # not the call form the recorder knows
                b.error = f"its {b.recorder.where} could not be read ({type(exc).__name__}: {exc})"
                return
            if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.is_floating_point():
                b.error = f"its {b.recorder.where} is not a [tokens, k] integer tensor"
                return
            if first["on"] and b.norm is None and isinstance(h, torch.Tensor):
                hit = produced.get(h.data_ptr())
                if hit is not None and hit[0].numel() == h.numel():
                    b.norm_name, b.norm = hit[1], hit[2]
            b.calls.append((h.detach().reshape(-1, h.shape[-1]), idx.detach().long(),
                            None if w is None else w.detach().float().reshape(idx.shape)))
        return hook

    for b in blocks:
        if b.recorder is None:
            continue
        if b.recorder.kind == "pre":
            handles.append(b.recorder.module.register_forward_pre_hook(
                lambda mod, args, kwargs, f=on_call(b): f(mod, args, kwargs), with_kwargs=True))
        else:
            handles.append(b.recorder.module.register_forward_hook(
                lambda mod, args, kwargs, out, f=on_call(b): f(mod, args, kwargs, out), with_kwargs=True))

    need_resid = {b.layer - 1 for b in blocks if b.layer}
    for j, (lname, lmod) in enumerate(layers):
        def layer_out(mod, args, out, j=j):
            o = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(o, torch.Tensor) and j in need_resid:
                resid[j] = o.detach().clone()
        handles.append(lmod.register_forward_hook(layer_out))
        handles.append(lmod.register_forward_pre_hook(lambda *a: produced.clear()))
    # the module whose output enters each block (its norm), found by the tensor's storage on the
    # first batch: every module of a decoder layer outside its MoE blocks
    inside = {id(m) for b in blocks for m in model.get_submodule(b.block_name).modules()}
    probe_handles = []
    for lname, lmod in layers:
        for name, m in lmod.named_modules():
            if id(m) in inside or m is lmod:
                continue

            def note(mod, args, out, name=f"{lname}.{name}"):
                if (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)
                        and out.shape == args[0].shape):
                    produced[out.data_ptr()] = (out, name, mod)  # an outer module returning it wins
            probe_handles.append(m.register_forward_hook(note))

    enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    bar = None
    if progress:
        bar = tqdm(total=n_tokens, desc="profile-router: forward", unit="tok", leave=False)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            i = 0
            while i < len(windows):
                # full windows in batches; a shorter last window alone (no padding anywhere)
                n = windows[i].numel()
                j = i + 1
                while j < len(windows) and j - i < batch_size and windows[j].numel() == n:
                    j += 1
                x = torch.stack(windows[i:j])
                kw = {"input_ids": x, "use_cache": False}
                if enc_dec:
                    kw["decoder_input_ids"] = x
                resid.clear()
                model(**kw)
                if first["on"]:
                    first["on"] = False
                    for h in probe_handles:
                        h.remove()
                    probe_handles = []
                    produced.clear()
                    # blocks in the order the forward runs them (module order is not always that:
                    # JetMoE registers its MoE block before its attention experts)
                    blocks.sort(key=lambda b: (b.first_call is None, b.first_call or 0))
                _after_batch(blocks, resid, x.numel(), keep_hidden)
                if bar is not None:
                    bar.update(x.numel())
                i = j
    finally:
        for h in handles + probe_handles:
            h.remove()
        if bar is not None:
            bar.close()
        model.train(was_training)

    kept = [b for b in blocks if b.error is None and b.idx]
    for i, b in enumerate(kept):
        b.index = i  # the trace's layer id: position in execution order
    for b in blocks:
        if b not in kept:
            notes.append(f"block {b.name}: routing not recorded: {b.error or 'it was never called'}")
    if not kept:
        raise ProfileError("no MoE block's routing could be recorded: " + "; ".join(notes))
    profile = _build(model, kept, n_tokens, seq_len, keep_hidden, notes, policies, fractions, half_life, progress)
    if kl_budget is not None:
        profile.figures["advice"]["top_k"] = top_k_advice.advise(model, windows, kl_budget, progress=progress)
    return profile


def _after_batch(blocks: list[_Block], resid: dict, n: int, keep_hidden: bool) -> None:
    """Move this batch's calls into each block's records; the router checks and predictions
    (`blocks` in execution order: a block's previous block is the one before it)."""
    batch = {}
    for b in blocks:
        if b.error is not None or b.recorder is None:
            b.calls.clear()
            continue
        if not b.calls:
            continue
        h = torch.cat([c[0] for c in b.calls])
        idx = torch.cat([c[1] for c in b.calls])
        w = None if any(c[2] is None for c in b.calls) else torch.cat([c[2] for c in b.calls])
        b.calls.clear()
        if idx.shape[0] != n:
            b.error = (f"it saw {idx.shape[0]} token rows for a batch of {n} tokens (called on a subset of "
                       "the tokens, or more than once a forward)")
            continue
        batch[b.index] = (h, idx)
        b.idx.append(idx.to(torch.int32))
        b.w.append(w)
        if keep_hidden:
            b.hidden.append(h.clone())
    for b in blocks:
        if b.index not in batch or b.router_w is None:
            continue
        h, idx = batch[b.index]
        logits = _logits(b, h)
        k = idx.shape[1]
        top = logits.topk(k, dim=-1).indices
        b.agree += int((top.sort(-1).values == idx.sort(-1).values).all(-1).sum())
        b.rows += idx.shape[0]
        p = logits.softmax(-1)
        b.entropy_sum += float(-(p * p.clamp_min(1e-30).log2()).sum(-1).sum())
        mass = p.sort(-1, descending=True).values[:, :k].cumsum(-1).sum(0).double().numpy()
        b.mass_sum = mass if b.mass_sum is None else b.mass_sum + mass
        ms = sorted({m for m in (k, 2 * k) if m <= b.num_experts})
        sources = {}
        if b.layer and (b.layer - 1) in resid:
            r = resid[b.layer - 1]
            with torch.inference_mode():
                x = b.norm(r) if b.norm is not None else r
            sources["residual"] = (x[0] if isinstance(x, (tuple, list)) else x).reshape(-1, h.shape[-1])
        pos = blocks.index(b)
        prev = blocks[pos - 1] if pos > 0 else None
        if prev is not None and prev.index in batch:
            sources["previous_block_input"] = batch[prev.index][0]
        for name, src in sources.items():
            if src.shape[0] != idx.shape[0]:
                continue
            order = _logits(b, src).topk(max(ms), dim=-1).indices
            slot = b.pred.setdefault(name, {m: [0, 0] for m in ms})
            for m in ms:
                slot[m][0] += _overlap(order[:, :m], idx)
                slot[m][1] += idx.shape[0]


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

def _bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _block_figures(idx: np.ndarray, w: np.ndarray | None, E: int) -> dict:
    T, k = idx.shape
    valid = idx >= 0
    counts = np.bincount(idx[valid], minlength=E)[:E]
    total = counts.sum()
    share = counts / total if total else np.zeros(E)
    mean = counts.mean() if E else 0.0
    onehot = np.zeros((T, E), dtype=np.float32)
    rows = np.repeat(np.arange(T), k)[valid.reshape(-1)]
    onehot[rows, idx[valid]] = 1.0
    co = (onehot.T @ onehot).astype(np.int64)
    used = np.diag(co).astype(np.float64)  # tokens using each expert
    pairs = []
    iu = np.triu_indices(E, 1)
    pair_counts = co[iu]
    for n in np.argsort(-pair_counts, kind="stable")[:8]:
        i, j = int(iu[0][n]), int(iu[1][n])
        c = int(pair_counts[n])
        if c == 0:
            break
        expect = used[i] * used[j] / T if T else 0.0
        pairs.append({"experts": [i, j], "tokens": c, "share_of_tokens": c / T,
                      "lift": c / expect if expect else None})
    fig = {
        "load": {"counts": counts.tolist(), "share": share.tolist()},
        "imbalance": {"max_over_mean": float(counts.max() / mean) if mean else None,
                      "cv": float(counts.std() / mean) if mean else None,
                      "min_over_mean": float(counts.min() / mean) if mean else None},
        "load_entropy_bits": _bits(share), "load_entropy_max_bits": math.log2(E) if E else 0.0,
        "co_activation_top_pairs": pairs,
    }
    if w is not None and k > 1:
        ws = np.where(valid, w, 0.0)
        ws = -np.sort(-ws, axis=1)
        tot = ws.sum(1, keepdims=True)
        ok = tot[:, 0] > 0
        cum = (ws.cumsum(1)[ok] / tot[ok]).mean(0) if ok.any() else np.full(k, np.nan)
        fig["weight_share_top"] = {str(i + 1): float(cum[i]) for i in range(k)}
        q = ws[ok] / tot[ok]
        fig["weight_entropy_bits"] = float(np.mean([_bits(r) for r in q])) if ok.any() else None
    elif w is not None:
        fig["weight_share_top"] = {"1": 1.0}
        fig["weight_entropy_bits"] = 0.0
    return fig


def _bytes_per_expert(model: nn.Module, blocks: list[_Block]) -> tuple[dict[str, dict], list[str]]:
    """Per block name: bytes of one expert in the model's own dtype, int8 and int4 (the packed
    layouts, scales included); and notes for what is unknown."""
    notes = []
    out: dict[str, dict] = {}
    try:
        rep = inspect_model(model)
    except Exception as exc:  # the report is extra information; the profile stands without it
        return {}, [f"expert sizes unknown: inspect_model failed ({type(exc).__name__}: {exc})"]
    by_name = {r.name: r for r in rep.blocks}
    for b in blocks:
        r = by_name.get(b.name)
        if r is None or not r.experts or not r.expert_bytes:
            continue
        sizes = {"own": r.expert_bytes / r.experts, "own_dtype": r.weights}
        for fmt in ("int8", "int4"):
            n = packed_expert_bytes(r, fmt)
            sizes[fmt] = None if n is None else n / r.experts
        out[b.name] = sizes
    missing = [b.name for b in blocks if b.name not in out]
    if missing:
        notes.append(f"expert sizes unknown for {len(missing)} block(s) (not accelerable: {', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''}): cache sizes in bytes leave them out")
    if out and any(v.get("int8") is None for v in out.values()):
        notes.append("int8/int4 expert sizes need the native library (not built here)")
    return out, notes


def _build(model, blocks: list[_Block], n_tokens: int, seq_len: int, keep_hidden: bool, notes: list[str],
           policies, fractions, half_life, progress) -> RouterProfile:
    cfg = getattr(model, "config", None)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    indices = [torch.cat(b.idx).long() for b in blocks]
    weights = [None if any(w is None for w in b.w) else torch.cat(b.w) for b in blocks]
    hidden = [torch.cat(b.hidden) for b in blocks] if keep_hidden else None
    sizes, size_notes = _bytes_per_expert(model, blocks)
    notes += size_notes
    info, per_block = [], []
    for i, b in enumerate(blocks):
        idx = indices[i].numpy()
        E = b.num_experts or int(idx.max()) + 1
        k = idx.shape[1]
        standalone = b.router_w is not None and b.rows > 0 and b.agree / b.rows >= STANDALONE_AGREEMENT
        if b.router_w is not None and b.rows and not standalone:
            b.router_note = (f"cannot be applied standalone: the top-{k} of its logits gives the block's own choice "
                             f"on only {100 * b.agree / b.rows:.1f} % of tokens (it chooses otherwise: a score-"
                             "correction bias, expert groups or capacity limits)")
        info.append({
            "index": i, "name": b.name, "block": b.block_name, "layer": b.layer, "num_experts": E, "top_k": k,
            "recorded_from": b.recorder.where,
            "router": b.router, "router_standalone": standalone,
            "router_agreement": b.agree / b.rows if b.rows else None,
            "router_note": b.router_note or ("top-k of its logits, as the block chooses" if standalone else ""),
            "pre_moe_norm": b.norm_name,
            "expert_bytes": sizes.get(b.name),
        })
        fig = _block_figures(idx, None if weights[i] is None else weights[i].numpy(), E)
        fig["index"], fig["name"], fig["layer"] = i, b.name, b.layer
        if standalone:
            fig["router_entropy_bits"] = b.entropy_sum / b.rows
            fig["router_prob_mass_top"] = {str(j + 1): float(v / b.rows) for j, v in enumerate(b.mass_sum)}
        else:
            fig["router_entropy_bits"] = None
            fig["router_prob_mass_top"] = None
        per_block.append(fig)

    figures: dict[str, Any] = {"definitions": DEFINITIONS, "per_block": per_block}
    figures["prediction"] = _prediction(blocks, info, indices, per_block)
    bar = None
    if progress:
        bar = tqdm(desc="profile-router: cache replay", unit="run", leave=False)
    try:
        figures["over_time"] = _over_time(info, indices, policies, fractions, half_life, bar)
        if bar is not None:  # the sizes between the curve's points: a bisection, of no known length
            bar.close()
            bar = tqdm(desc="profile-router: smallest cache per target", unit="run", leave=False)
        figures["advice"] = _advice(info, indices, per_block, figures["over_time"], sizes, half_life, bar)
    finally:
        if bar is not None:
            bar.close()
    return RouterProfile(
        model=str(getattr(cfg, "name_or_path", "") or type(model).__name__),
        model_type=str(getattr(cfg, "model_type", "?")), dtype=dtype, tokens=n_tokens, seq_len=seq_len,
        blocks=info, indices=indices, weights=weights, hidden=hidden, figures=figures, notes=notes)


DEFINITIONS = {
    "load": "counts: routed slots per expert over all tokens; share: counts over their sum",
    "imbalance": "max_over_mean / min_over_mean: largest / smallest count over the mean count; cv: their standard "
                 "deviation over the mean",
    "load_entropy_bits": "entropy of the load shares (load_entropy_max_bits = log2 of the expert count: even load)",
    "router_entropy_bits": "mean over tokens of the entropy of the softmax over the router's logits (null where the "
                           "router cannot be applied standalone)",
    "router_prob_mass_top": "mean over tokens of the softmax probability in the token's 1..k most probable experts",
    "weight_share_top": "mean over tokens of the share of the token's routing weights (as the block passes them) "
                        "in its 1..k largest",
    "weight_entropy_bits": "mean over tokens of the entropy of its routing weights normalised to sum 1",
    "co_activation_top_pairs": "the pairs of experts most often chosen by the same token; lift: that count over "
                               "what independent choices with the same per-expert token counts would give",
}

PREDICTOR = {
    "residual": ("the router of the block in decoder layer j applied to the residual stream after decoder layer "
                 "j-1 (that layer's output: known before layer j's attention runs), through the module whose "
                 "output enters the block (its pre-MoE norm) where one was found, else the raw residual"),
    "previous_block_input": "the router of block b applied to the hidden state entering block b-1",
    "static": "the m experts of block b with the highest load over the whole profile (in-sample)",
}


def _prediction(blocks: list[_Block], info: list[dict], indices: list[torch.Tensor], per_block: list[dict]) -> dict:
    rows = []
    for b, inf, idx, fig in zip(blocks, info, indices, per_block):
        row: dict[str, Any] = {"index": inf["index"], "name": inf["name"], "layer": inf["layer"],
                               "top_k": inf["top_k"], "num_experts": inf["num_experts"]}
        if not inf["router_standalone"]:
            row["unavailable"] = inf["router_note"] or (
                "no router module with one [experts, hidden] weight found in the block: it cannot be applied "
                "standalone")
            rows.append(row)
            continue
        if not b.pred:
            row["unavailable"] = ("no earlier state to predict from (the first decoder layer, or no decoder "
                                  "layers found)")
        row["norm"] = inf["pre_moe_norm"]
        for name, slots in b.pred.items():
            row[name] = {f"m={m}": {"recall": hits / (n * inf["top_k"]) if n else None,
                                    "precision": hits / (n * m) if n else None}
                         for m, (hits, n) in slots.items()}
        counts = np.asarray(fig["load"]["counts"])
        order = np.argsort(-counts, kind="stable")
        a = idx
        static = {}
        for m in sorted({m for m in (inf["top_k"], 2 * inf["top_k"]) if m <= inf["num_experts"]}):
            pred = torch.as_tensor(order[:m].copy()).expand(a.shape[0], m)
            hits = _overlap(pred, a)
            static[f"m={m}"] = {"recall": hits / (a.shape[0] * inf["top_k"]), "precision": hits / (a.shape[0] * m)}
        row["static"] = static
        row["random_recall"] = {f"m={m}": m / inf["num_experts"] for m in (inf["top_k"], 2 * inf["top_k"])
                                if m <= inf["num_experts"]}
        rows.append(row)
    return {"predictors": PREDICTOR, "per_block": rows,
            "metric": ("recall = share of the block's chosen experts among the predictor's top m; precision = "
                       "share of the predictor's top m the block chose")}


def _trace(indices: list[torch.Tensor]) -> cp.Trace:
    return cp.make_trace([i.numpy() for i in indices])


def _over_time(info: list[dict], indices: list[torch.Tensor], policies, fractions, half_life, bar) -> dict:
    trace = _trace(indices)
    total = sum(b["num_experts"] for b in info)
    reuse = cp.reuse_distances(trace)
    block_of = np.fromiter((k[0] for k in reuse.keys), dtype=np.int64, count=len(reuse.keys))
    per_block = []
    for b in info:
        l = b["index"]
        mask = block_of == l
        s, iv = reuse.stack[mask], reuse.interval[mask]
        experts = []
        for e in range(b["num_experts"]):
            es, ei = reuse.of((l, e))
            experts.append({"expert": e, "uses": len(reuse.key_index.get((l, e), [])),
                            "stack_distance": cp.summarize(es), "interval_tokens": cp.summarize(ei)})
        per_block.append({"index": l, "name": b["name"], "stack_distance": cp.summarize(s[s >= 0]),
                          "interval_tokens": cp.summarize(iv[iv >= 0]), "experts": experts})
    lo = cp.min_capacity(trace)
    sizes = sorted({max(lo, int(round(f * total))) for f in fractions if f > 0})
    if bar is not None:
        bar.total = len(sizes) * len(policies)
        bar.refresh()
    options = {"freq-decay": {"half_life": half_life}}
    curve = cp.hit_rate_curve(trace, sizes, policies, options=options,
                              progress=(lambda *_: bar.update()) if bar is not None else None)
    # pinned: the n most used experts kept resident from the start, nothing else cached
    counts = {}
    for k in reuse.keys:
        counts[k] = counts.get(k, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    cum = np.concatenate([[0], np.cumsum(ranked)])
    n = trace.accesses
    return {
        "accesses": n, "steps": len(trace.steps), "total_experts": total, "distinct_experts_used": len(counts),
        "order": "tokens in text order; within a token, blocks in model order; a step = one block's experts of one token",
        "cache": "one pool of slots for every block's experts; every expert of a step resident during the step",
        "freq_decay_half_life_tokens": half_life,
        "reuse": {"definition": ("stack distance = other experts (of any block) used between two uses of an expert; "
                                 "interval = tokens between them"), "per_block": per_block},
        "hit_rate": {
            "sizes": sizes, "fractions": [s / total for s in sizes],
            "policies": {name: [None if r is None else r.hit_rate for r in row] for name, row in curve.items()},
            "pinned_top_by_load": [float(cum[min(s, len(ranked))] / n) for s in sizes],
            "pinned_note": ("the n most used experts resident throughout (in-sample), every other access streamed "
                            "without being cached (so no slot is needed for it, unlike the policies)"),
        },
    }


def _advice(info, indices, per_block, over, sizes_bytes, half_life, bar) -> dict:
    trace = _trace(indices)
    hr = over["hit_rate"]
    sizes = hr["sizes"]
    slot = {}
    for key in ("own", "int8", "int4"):
        vals = [v[key] for v in sizes_bytes.values() if v.get(key) is not None]
        slot[key] = max(vals) if vals and len(vals) == len(info) else None  # a slot holds the largest expert
    own_dtype = next((v["own_dtype"] for v in sizes_bytes.values()), None)
    options = {"freq-decay": {"half_life": half_life}}
    cache = []
    for target in TARGETS:
        found = {}
        for name, rates in hr["policies"].items():
            at = next((i for i, r in enumerate(rates) if r is not None and r >= target), None)
            if at is not None:
                found[name] = at
        online = {n: i for n, i in found.items() if n in cp.ONLINE}
        line: dict[str, Any] = {"target": target}
        if not online:
            best = max((n for n in hr["policies"] if n in cp.ONLINE),
                       key=lambda n: max((r or 0) for r in hr["policies"][n]), default=None)
            line["reached"] = False
            line["text"] = (f"no online policy reaches {100 * target:.0f} % hit rate at any size tried "
                            f"(best: {best}, {100 * max((r or 0) for r in hr['policies'][best]):.1f} % with "
                            "every expert cached: compulsory misses of first uses)") if best else "no online policy run"
            cache.append(line)
            continue
        first = min(online.values())
        results = {}
        for name in [n for n, i in online.items() if i == first] + (["belady"] if "belady" in found else []):
            i = found[name]
            lo = sizes[i - 1] if i > 0 else cp.min_capacity(trace) - 1
            results[name] = _smallest(trace, name, target, lo, sizes[i], options, bar)
        best = min((n for n in results if n != "belady"), key=lambda n: (results[n][0], -results[n][1]))
        c, rate = results[best]
        total = over["total_experts"]
        line.update({"reached": True, "policy": best, "slots": c, "fraction_of_experts": c / total,
                     "hit_rate": rate,
                     "bytes": {k: (None if v is None else v * c) for k, v in slot.items()},
                     "belady_slots": results.get("belady", (None,))[0]})
        by = ", ".join(f"{_size(v * c)} {k if k != 'own' else (own_dtype or 'own dtype')}" for k, v in slot.items()
                       if v is not None)
        line["text"] = (f"{100 * target:.0f} % hit rate: {c} expert slots ({100 * c / total:.0f} % of {total} experts"
                        f"{'; ' + by if by else ''}) under {best} ({100 * rate:.1f} %); Belady's optimum needs "
                        f"{line['belady_slots'] if line['belady_slots'] is not None else '?'}")
        cache.append(line)
    pins = []
    accesses = over["accesses"]
    for b, f in zip(info, per_block):
        E = b["num_experts"]
        for e, (c, s) in enumerate(zip(f["load"]["counts"], f["load"]["share"])):
            if s >= PIN_FACTOR / E:
                pins.append({"block": b["index"], "layer": b["layer"], "expert": e, "load_share": s,
                             "uses": c, "share_of_all_accesses": c / accesses})
    pins.sort(key=lambda p: -p["uses"])
    covered = sum(p["uses"] for p in pins) / accesses if accesses else 0.0
    pin_text = (f"pin {len(pins)} expert(s) routed to at least {PIN_FACTOR:g}x their uniform share: "
                f"together {100 * covered:.1f} % of all accesses from {100 * len(pins) / over['total_experts']:.1f} % "
                "of the experts" if pins else
                f"no expert is routed to {PIN_FACTOR:g}x its uniform share: load is even, nothing stands out to pin")
    return {"cache_size": cache, "pin": {"experts": pins, "share_of_accesses": covered, "text": pin_text,
                                         "rule": f"load share >= {PIN_FACTOR:g} / num_experts of its block"}}


def _smallest(trace: cp.Trace, name: str, target: float, lo: int, hi: int, options: dict, bar) -> tuple[int, float]:
    """The smallest size in (lo, hi] whose hit rate reaches target (hi does), by bisection
    (hit rate taken as growing with size); (size, its hit rate)."""
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = cp.simulate(trace, mid, name, **options.get(name, {}))
        if bar is not None:
            bar.update()
        if r.hit_rate >= target:
            hi, best = mid, r.hit_rate
        else:
            lo = mid
    if best is None:
        r = cp.simulate(trace, hi, name, **options.get(name, {}))
        best = r.hit_rate
    return hi, best


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# Text summary and plots
# ---------------------------------------------------------------------------------------------

def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_summary(d: dict) -> str:
    L = []
    a = L.append
    a(f"router profile: {d['model']} ({d['model_type']}, {d['dtype']}), {d['tokens']} tokens in windows of "
      f"{d['seq_len']}, {len(d['blocks'])} MoE blocks")
    a("")
    a("per block | load max/mean | CV | load entropy (bits) | router entropy | top-1 weight share | top pair (lift)")
    for b, f in zip(d["blocks"], d["per_block"]):
        im = f["imbalance"]
        pair = f["co_activation_top_pairs"][0] if f["co_activation_top_pairs"] else None
        ps = f"{pair['experts'][0]}+{pair['experts'][1]} ({pair['lift']:.2f})" if pair and pair["lift"] else "-"
        ws = (f.get("weight_share_top") or {}).get("1")
        a(f"  {b['index']:>3} L{b['layer'] if b['layer'] is not None else '?'} | {_num(im['max_over_mean'])} | "
          f"{_num(im['cv'])} | {f['load_entropy_bits']:.2f} of {f['load_entropy_max_bits']:.2f} | "
          f"{_num(f['router_entropy_bits'])} | {_pct(ws)} % | {ps}")
    a("")
    hr = d["over_time"]["hit_rate"]
    names = list(hr["policies"])
    a(f"hit rate % against cache size ({d['over_time']['accesses']} accesses, one pool for all "
      f"{d['over_time']['total_experts']} experts)")
    a("  slots (share) | " + " | ".join(names) + " | pinned top")
    for i, s in enumerate(hr["sizes"]):
        a(f"  {s:>5} ({100 * hr['fractions'][i]:>3.0f} %) | " +
          " | ".join(_pct(hr["policies"][n][i]) for n in names) + f" | {_pct(hr['pinned_top_by_load'][i])}")
    a("  (pinned top: the n most used experts kept from the start, every other access streamed uncached)")
    a("")
    pr = d["prediction"]
    a("next-layer prediction (router of block b on the residual after the previous decoder layer), recall %:")
    for r in pr["per_block"]:
        if "unavailable" in r:
            a(f"  {r['index']:>3} L{r['layer']}: unavailable: {r['unavailable']}")
            continue
        parts = []
        for src in ("residual", "previous_block_input", "static"):
            if src in r:
                parts.append(f"{src} " + ", ".join(f"{m} {_pct(v['recall'])}" for m, v in r[src].items()))
        via = f" (through {r['norm']})" if r.get("norm") else (" (raw residual: no pre-MoE norm found)"
                                                                if "residual" in r else "")
        a(f"  {r['index']:>3} L{r['layer']}: " + "; ".join(parts) + via)
    a("")
    a("advice:")
    for line in d["advice"]["cache_size"]:
        a("  " + line["text"])
    a("  " + d["advice"]["pin"]["text"])
    for p in d["advice"]["pin"]["experts"][:8]:
        a(f"    block {p['block']} (L{p['layer']}) expert {p['expert']}: {100 * p['load_share']:.1f} % of its block's "
          f"routing, {100 * p['share_of_all_accesses']:.1f} % of all accesses")
    if "top_k" in d["advice"]:
        tk = d["advice"]["top_k"]
        a("  " + tk["text"])
        if tk["rows"]:
            a("    threshold: experts a token, KL nats a token, top-1 % = " + "; ".join(
                f"{r['threshold']:g}: {r['experts_per_token']:.2f}, {r['kl']:.4f}, {100 * r['top1']:.1f}"
                for r in tk["rows"]))
    for n in d.get("notes", []):
        a("note: " + n)
    for b in d["blocks"]:
        if not b["router_standalone"] and b["router_note"]:
            a(f"note: block {b['index']} router {b['router']}: {b['router_note']}")
        elif b["router"] is None:
            a(f"note: block {b['index']}: no router module with one [experts, hidden] weight: it cannot be applied "
              "standalone (no prediction, no router entropy)")
    return "\n".join(L)


def _model_name(path: str) -> str:
    return Path(path).name or path


def write_plots(profile: RouterProfile, out: Path) -> dict[str, dict]:
    """The PNG plots; {file name: what it plots}. ImportError without matplotlib."""
    import matplotlib  # optional dependency (extra `profile`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (extra `profile`)

    d = profile.to_dict()
    made: dict[str, dict] = {}
    # 1. load heatmap
    blocks = d["blocks"]
    E = max(b["num_experts"] for b in blocks)
    grid = np.full((len(blocks), E), np.nan)
    for i, f in enumerate(d["per_block"]):
        s = f["load"]["share"]
        grid[i, :len(s)] = np.asarray(s) * 100
    fig, ax = plt.subplots(figsize=(min(16, 2.5 + 0.55 * E), min(14, 1.8 + 0.45 * len(blocks))), dpi=110)
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE block (decoder layer)")
    ax.set_yticks(range(len(blocks)))
    ax.set_yticklabels([f"{b['index']} (L{b['layer']})" for b in blocks])
    if E <= 32:
        ax.set_xticks(range(E))
    uniform = 100 / E
    ax.set_title(f"Expert load: share of each block's routed slots, % (uniform = {uniform:.1f} %)\n"
                 f"{_model_name(d['model'])}, {d['tokens']} tokens")
    if E <= 16 and len(blocks) <= 32:
        for i in range(len(blocks)):
            for j in range(E):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}" if E <= 10 else f"{grid[i, j]:.0f}", ha="center",
                            va="center", fontsize=8, color="black" if grid[i, j] > np.nanmax(grid) * 0.6 else "white")
    fig.colorbar(im, ax=ax, label="% of the block's routing")
    fig.tight_layout()
    fig.savefig(out / "load_heatmap.png")
    plt.close(fig)
    made["load_heatmap.png"] = {"what": "per MoE block (rows) and expert (columns): the expert's share of the "
                                        "block's routed slots, %", "json": "per_block[*].load.share"}
    # 2. hit rate vs cache size
    hr = d["over_time"]["hit_rate"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    x = np.asarray(hr["fractions"]) * 100
    styles = {"belady": dict(color="black", linestyle="--", linewidth=2)}
    for name, rates in hr["policies"].items():
        xs = [xi for xi, r in zip(x, rates) if r is not None]
        ys = [100 * r for r in rates if r is not None]
        label = "Belady MIN (offline optimum)" if name == "belady" else name
        if name == "freq-decay":
            label = f"freq-decay (half-life {d['over_time']['freq_decay_half_life_tokens']:g} tokens)"
        ax.plot(xs, ys, marker="o", markersize=3, label=label, **styles.get(name, {}))
    ax.plot(x, [100 * v for v in hr["pinned_top_by_load"]], color="grey", linestyle=":",
            label="pin the n most used, stream the rest (in-sample)")
    for t in TARGETS:
        ax.axhline(100 * t, color="lightgrey", linewidth=0.8, zorder=0)
    ax.set_xlabel(f"cache size, % of all {d['over_time']['total_experts']} experts (one pool for every block)")
    ax.set_ylabel("hit rate, % of expert accesses")
    ax.set_title(f"Expert cache hit rate against size\n{_model_name(d['model'])}, {d['tokens']} tokens replayed in order")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    sec = ax.secondary_xaxis("top", functions=(lambda v: v * d["over_time"]["total_experts"] / 100,
                                               lambda v: v * 100 / d["over_time"]["total_experts"]))
    sec.set_xlabel("slots")
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png")
    plt.close(fig)
    made["hit_rate.png"] = {"what": "hit rate (% of expert accesses) against cache size (% of all experts; slots on "
                                    "top) per policy, Belady's optimum dashed, pinning the most used experts dotted",
                            "json": "over_time.hit_rate"}
    # 3. prediction recall per block
    rows = [r for r in d["prediction"]["per_block"] if "residual" in r or "previous_block_input" in r]
    fig, ax = plt.subplots(figsize=(min(18, max(7, 1.5 + 0.9 * max(1, len(rows)))), 5.5), dpi=110)
    if rows:
        k = rows[0]["top_k"]
        series = [("residual", f"m={k}", "residual after layer j-1, top-k"),
                  ("residual", f"m={2 * k}", "residual after layer j-1, top-2k"),
                  ("previous_block_input", f"m={k}", "previous block's input, top-k"),
                  ("static", f"m={k}", "static: k most loaded (in-sample)")]
        series = [s for s in series if any(s[1] in r.get(s[0], {}) for r in rows)]
        width = 0.8 / max(1, len(series))
        pos = np.arange(len(rows))
        for si, (src, m, label) in enumerate(series):
            vals = [100 * r[src][m]["recall"] if src in r and m in r[src] else np.nan for r in rows]
            bars = ax.bar(pos + (si - (len(series) - 1) / 2) * width, vals, width, label=label)
            if len(rows) * len(series) <= 32:
                ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        rnd = rows[0]["random_recall"].get(f"m={k}")
        if rnd is not None:
            ax.axhline(100 * rnd, color="black", linestyle=":", linewidth=1, label=f"random top-k ({100 * rnd:.0f} %)")
        ax.set_xticks(pos)
        ax.set_xticklabels([f"{r['index']} (L{r['layer']})" for r in rows])
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "no block's router could be applied standalone", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylim(0, 105)
    ax.set_xlabel("predicted MoE block (decoder layer)")
    ax.set_ylabel("recall, % of the block's chosen experts")
    ax.set_title(f"Predicting a block's experts before its layer runs\n{_model_name(d['model'])}, {d['tokens']} tokens")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "prediction_recall.png")
    plt.close(fig)
    made["prediction_recall.png"] = {"what": ("per predicted MoE block: recall of its chosen experts by its router "
                                              "applied to the residual after the previous decoder layer (top-k, "
                                              "top-2k), to the previous block's input, and by the k most loaded "
                                              "experts; random top-k dotted"), "json": "prediction.per_block"}
    return made


# ---------------------------------------------------------------------------------------------
# Input files
# ---------------------------------------------------------------------------------------------

def builtin_data() -> Path | None:
    """The project's held-out corpus (data/heldout.txt), if this installation has it."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        p = parent / "data" / "heldout.txt"
        if p.is_file():
            return p
    return None


def read_texts(path: str | Path) -> list[str]:
    """Texts from a file: JSONL (*.jsonl, or every non-empty line a JSON object) takes each
    object's "text"; anything else is one text."""
    p = Path(path)
    if not p.exists():
        raise ProfileError(f"data file {str(p)!r} does not exist")
    if not p.is_file():
        raise ProfileError(f"data path {str(p)!r} is not a file")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"data file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    jsonl = p.suffix.lower() == ".jsonl" or (bool(lines) and all(ln.lstrip().startswith("{") for ln in lines))
    if not jsonl:
        if not raw.strip():
            raise ProfileError(f"data file {str(p)!r} is empty")
        return [raw]
    texts = []
    for n, ln in enumerate(raw.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"data file {str(p)!r} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ProfileError(f"data file {str(p)!r} line {n}: no string field \"text\"")
        texts.append(obj["text"])
    if not any(t.strip() for t in texts):
        raise ProfileError(f"data file {str(p)!r} has no text")
    return texts
