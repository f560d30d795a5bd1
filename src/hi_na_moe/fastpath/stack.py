"""scope="all": a decoder stack's decode step as one loop over its layers' short paths.

A decoder layer on its short path (hi_na_moe.fastpath.layers) still costs a decode step one module call,
one round of hook and mode checks and one parse of its keyword arguments, and the model's forward
around the layers a mask, output capture and argument handling, all between the weight streams
where each Python frame runs several times slower than hot (benchmarks/studies/study_model_loop.py
measured 3-6 % of an int4 OLMoE step for all of it).

Which stacks: a module whose children are exactly embed_tokens, rotary_emb, layers and norm (the
*Model under a *ForCausalLM of OLMoE, Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, ...), every layer
patched as a hi_na_moe.fastpath.layers.NativeLayer by this enable (latent attention's included: its rotary
module's one complex tensor, DeepSeek-V2's, is handed over whole), every layer of full or
sliding-window attention (layer_types). A layer a window may restrict (_windowed: one typed sliding, every layer
of a config with a window and no layer_types, as Mixtral's forward masks them) takes decode steps
here only while none of its keys falls out of the window, so that it needs no mask: its cache
keeps the window's keys (a DynamicSlidingWindowLayer, as DynamicCache(config=...) and generate
make it) or holds fewer positions than the window; else, and for any step with a mask, the stack's
own forward runs. Layers typed full beside a window count as windowed unless the probe looked past
the window (a window of at most PROBE_WINDOW tokens) and saw the own forward leave them unmasked.
Its decode call then runs: the embedding called as a
module (its hooks run), the rotary module's output read from a table of its own outputs when
nothing could tell (hi_na_moe.fastpath.rope_table; else the module is called), each layer's short path
called straight, in order, and the final norm as a module, or at the end of the one native call
below when it is a NativeNorm with no hook (FINAL_NORM).

A decode call is a forward with input_ids of one token per row (at most common.DECODE_MAX_ROWS,
256, rows), a DynamicCache or StaticCache already holding positions, use_cache, at most an
attention mask (2-D, or the 4-D one generate prepares for a StaticCache) and position_ids, and
transformers' falsy output flags.
With a DynamicCache and no mask (or one of ones) the layers get no mask, as the own forward gives
them then; otherwise the mask comes from the create_causal_mask of the stack's own module,
called as its forward calls it (a StaticCache's bool mask over its buffer, padding; a 4-D mask
comes back as it is), and a mask the short paths do not read sends the layers through their
module calls with it. A forward autograd records, anything else, or anything that would observe
a skipped layer call (a hook on a layer or a part it skips, transformers' output-capturing hooks
while they capture, a global hook, a mode, compile tracing, a layer replaced or its forward
replaced, a layer in training mode), runs the stack's own forward.

With a DynamicCache (padding included) or a StaticCache (under the mask over its buffers), when
every layer's step can run in the native calls with the router's selection and the experts
inside (NativeLayer.plan_args) and every layer's cache takes the new position in place
(hi_na_moe.fastpath.kv_cache: slot, static_slot; latent attention's latents and rope keys in their two
buffers), the layers run in one native call instead
(decode_layers, through a StepPlan holding each layer's fixed arguments): the same kernels in the
same order as the loop, so the same bits, with no Python between the layers' weight streams.
ONE_CALL = False keeps the loop.

A *ForCausalLM over such a stack (children exactly model and lm_head) runs its plain decode calls
as the stack's step and the lm_head called straight (NativeCausalLM, below).

What it computes is checked before it is patched: from a cache the stack's own forward filled
with a prompt, one decode step of the own forward and one of this loop, each on its own copy of
the cache, must give an output of the same type with the same fields, the same last hidden state
and the same cache, bit for bit; with no mask, a mask of ones, position_ids, a padded row, and a
StaticCache without and with a 4-D mask.
"""

from __future__ import annotations

import copy
import sys
import threading
from array import array
from collections import OrderedDict

import torch
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..core.native import native_module
from ..core.registry import patched_runner
from ..core.torch_ops import _LAST_KERNEL
from . import kv_cache
from .common import DECODE_MAX_ROWS, _matches
from .layers import NativeLayer
from .linear import NativeLinear
from .norm import NativeNorm
from .rope_table import RopeTable
from .watch import Watch, observing

# a decode step with a DynamicCache runs every layer in one native call (StepPlan,
# decode_layers) when all of them can (NativeLayer.plan_args, kv_cache's in-place slots)
ONE_CALL = True
# with the one call, the final norm too when it is on the native kernel (NativeNorm)
FINAL_NORM = True
# the rotary module's output read from a table of its own outputs (hi_na_moe.fastpath.rope_table)
ROPE_TABLE = True
# a config with a sliding window and layers typed full attention: the longest window the probe
# looks past (a prompt of window + 1 tokens) to see that those layers are not windowed
PROBE_WINDOW = 256

_CHILDREN = frozenset(("embed_tokens", "rotary_emb", "layers", "norm"))
_KWARGS = frozenset(("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache",
                     "output_router_logits", "output_hidden_states", "output_attentions"))
_FLAGS = ("output_router_logits", "output_hidden_states", "output_attentions")


class Outputs:
    """Output objects of one transformers ModelOutput class with the given fields set, built as
    its constructor leaves them (every field an attribute, None unless given; the given ones, none
    of them None, also its items, in field order) without running the constructor, whose
    __init__ and __post_init__ look the dataclass fields up at every attribute set: 14 us warm,
    ~0.1 ms of a cold decode step (benchmarks/studies/study_step_python.py). Checked once against the
    constructor: a class it does not match (another base, other bookkeeping) gets the constructor."""

    __slots__ = ("cls", "names", "base", "fast")

    def __init__(self, cls: type, names: tuple[str, ...]):
        """names: in the class's field order (as __post_init__ sets the items), else the constructor."""
        self.cls, self.names, self.fast = cls, tuple(names), False
        try:
            empty = cls()
            self.base = dict(empty.__dict__)
            if (tuple(k for k in self.base if k in names) != self.names or any(v is not None for v in self.base.values())
                    or empty.keys()):
                return
            marks = tuple(torch.empty(0) for _ in self.names)
            want = cls(**dict(zip(self.names, marks)))
            self.fast = True
            got = self.build(*marks)
            self.fast = (type(got) is type(want) and isinstance(got, OrderedDict) and list(got.keys()) == list(want.keys())
                         and list(got.__dict__) == list(want.__dict__)
                         and all(got.__dict__[k] is want.__dict__[k] for k in want.__dict__)
                         and all(got[k] is want[k] for k in want.keys()) and got.to_tuple() == want.to_tuple())
        except Exception:
            self.fast = False

    def build(self, *values):
        """An object of the class with the fields `names` (in field order) set to `values`."""
        if not self.fast:
            return self.cls(**dict(zip(self.names, values)))
        o = self.cls.__new__(self.cls)
        d = o.__dict__
        d.update(self.base)
        for k, v in zip(self.names, values):
            d[k] = v
            _ODICT_SET(o, k, v)
        return o


_ODICT_SET = OrderedDict.__setitem__


def _same_cache(a, b) -> bool:
    """Whether two caches' layers hold the same keys and values, bit for bit (the probes')."""
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


def find_stacks(model: nn.Module, exclude: str, candidates: set[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of the decoder stacks of the module docstring's shape whose layers are all
    patched NativeLayers (so: after hi_na_moe.fastpath.layers patched them); with `candidates` (for
    inspect_model, nothing patched): whose layers' names are all in it."""
    found = []
    for name, m in model.named_modules():
        layers = m._modules.get("layers")
        if not (isinstance(layers, nn.ModuleList) and len(layers) and set(m._modules) == _CHILDREN
                and not _matches(name, exclude)):
            continue
        if candidates is None:
            ok = all(isinstance(patched_runner(layer), NativeLayer) for layer in layers)
        else:
            prefix = f"{name}.layers." if name else "layers."
            ok = all(f"{prefix}{i}" in candidates for i in range(len(layers)))
        if ok:
            found.append((name, m))
    return found


class NativeStack:
    """One decoder stack whose decode calls run its layers' short paths in one loop."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward):
        self.name, self.module = name, module
        self.original = original_forward
        self.native = native_module()[0]
        self.ready = False
        self._local = threading.local()  # (_buffer) each thread's buffers for its steps
        # (StepPlan, the layers' plan_args it was set with): replaced, never changed, when an
        # argument changes, so a step running on another thread keeps a consistent one
        self._plan: tuple | None = None

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass

    # -- the probe ----------------------------------------------------------------------------
    def matches(self) -> bool:
        m = self.module
        cfg = getattr(m, "config", None)
        layers = tuple(m.layers)
        if cfg is None or getattr(cfg, "num_hidden_layers", None) != len(layers):
            return False
        windowed = self._windowed(cfg, len(layers))
        if windowed is None:
            return False
        self.window, self.windowed = windowed
        runners = tuple(patched_runner(layer) for layer in layers)
        if not all(isinstance(r, NativeLayer) and r.ready for r in runners):
            return False
        dtypes = {r.attn.dtype for r in runners}
        emb = m.embed_tokens
        if len(dtypes) != 1 or getattr(emb, "weight", None) is None or emb.weight.dtype not in dtypes:
            return False
        self.runners, self.layers, self.layer_list = runners, layers, m.layers
        self.layer_dicts = tuple(layer.__dict__ for layer in layers)
        # (_observed) the layers themselves as the stack skips their module calls, and every
        # layer's parts (its Watch, made in its probe, before this one)
        own = Watch(list(layers), [(m, "layers")] + [(m.layers, str(i)) for i in range(len(layers))])
        self.watch = Watch.merged([own] + [r.watch for r in runners])
        self.config = cfg
        self.out_type = None
        # the mask builder the own forward calls (by its module's global name)
        self.mask_fn = getattr(sys.modules.get(type(m).__module__), "create_causal_mask", None)
        self._dynamic = DynamicCache
        self.rope = RopeTable(m.rotary_emb)
        norm_runner = patched_runner(m.norm)  # the final norm: inside the one call when on the kernel
        self.norm_runner = norm_runner if isinstance(norm_runner, NativeNorm) else None
        self.norm_forward = m.norm.__dict__.get("forward")
        return self._probe()

    @staticmethod
    def _windowed(cfg, n: int) -> tuple[int, tuple[int, ...]] | None:
        """(the sliding window or 0, the layers a window may restrict) for a config whose layers
        are full or sliding attention, or None (another kind: chunked, linear, ...). A layer typed
        "sliding_attention" is windowed; with a window and no layer_types, every layer (Mixtral's
        forward masks them all so); one typed "full_attention" beside a window is windowed too
        unless the probe sees past the window (_probe: a window of at most PROBE_WINDOW)."""
        window = getattr(cfg, "sliding_window", None) or 0
        types = getattr(cfg, "layer_types", None)
        if type(window) is not int or window < 0:
            return None
        if types is None:
            return window, tuple(range(n)) if window else ()
        if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
            return None
        if any(t == "sliding_attention" for t in types) and not window:
            return None
        return window, tuple(i for i, t in enumerate(types) if window and (t == "sliding_attention" or window > PROBE_WINDOW))

    def _probe(self) -> bool:
        m = self.module
        gen = torch.Generator().manual_seed(11)
        B, T = 2, 3
        vocab = m.embed_tokens.weight.shape[0]
        ids = torch.randint(vocab, (B, T), generator=gen)
        nxt = torch.randint(vocab, (B, 1), generator=gen)
        pad = torch.ones(B, T + 1, dtype=torch.long)
        pad[0, 0] = 0
        variants = [({}, DynamicCache), ({"attention_mask": torch.ones(B, T + 1, dtype=torch.long)}, DynamicCache),
                    ({"position_ids": torch.full((B, 1), T, dtype=torch.long)}, DynamicCache)]
        if self.mask_fn is not None and not self.windowed:  # (windowed layers: unmasked steps only, _args)
            keep = torch.zeros(B, 1, 1, 8, dtype=torch.bool)  # generate's own mask over a StaticCache
            keep[..., : T + 1] = True
            keep[0, ..., 0] = False
            variants += [({"attention_mask": pad}, DynamicCache), ({}, StaticCache),
                         ({"attention_mask": keep}, StaticCache)]
        try:
            with torch.no_grad():
                if self.window and len(self.windowed) < len(self.layers) and not self._probe_past_window(vocab, gen):
                    return False
                prompts = {}
                for kind in (DynamicCache, StaticCache):
                    c = kind(config=self.config) if kind is DynamicCache else kind(config=self.config, max_cache_len=8)
                    self.original(input_ids=ids, past_key_values=c, use_cache=True,
                                  attention_mask=torch.ones(B, T, dtype=torch.long) if kind is DynamicCache else None)
                    prompts[kind] = c
                for kw, kind in variants:
                    own, ours = copy.deepcopy(prompts[kind]), copy.deepcopy(prompts[kind])
                    want = self.original(input_ids=nxt, past_key_values=own, use_cache=True, **kw)
                    self._output_type(type(want))
                    fast = self._args((), {"input_ids": nxt, "past_key_values": ours, "use_cache": True, **kw})
                    if fast is None:
                        return False
                    got = self._run(*fast)
                    if (type(got) is not type(want) or set(want.keys()) != {"last_hidden_state", "past_key_values"}
                            or want.past_key_values is not own or got.past_key_values is not ours
                            or not torch.equal(got.last_hidden_state, want.last_hidden_state)
                            or got.last_hidden_state.dtype != want.last_hidden_state.dtype):
                        return False
                    if not _same_cache(own, ours):
                        return False
        except Exception:
            return False
        self.ready = True
        return True

    def _probe_past_window(self, vocab: int, gen: torch.Generator) -> bool:
        """Whether a decode step past the window, with the cache the stack's own forward makes
        (its sliding layers keeping the window's keys), is the own forward's: what shows that the
        layers typed full attention are not windowed (_windowed)."""
        ids = torch.randint(vocab, (1, self.window + 1), generator=gen)
        nxt = torch.randint(vocab, (1, 1), generator=gen)
        cache = DynamicCache(config=self.config)
        self.original(input_ids=ids, past_key_values=cache, use_cache=True)
        own, ours = copy.deepcopy(cache), copy.deepcopy(cache)
        want = self.original(input_ids=nxt, past_key_values=own, use_cache=True)
        self._output_type(type(want))
        fast = self._args((), {"input_ids": nxt, "past_key_values": ours, "use_cache": True})
        if fast is None:
            return False
        got = self._run(*fast)
        return (type(got) is type(want) and torch.equal(got.last_hidden_state, want.last_hidden_state)
                and _same_cache(own, ours))

    def _in_window(self, cache) -> bool:
        """Whether no key of this step falls out of a windowed layer's window (so the layers need
        no mask): the layer's cache keeps only the window's (a DynamicSlidingWindowLayer of this
        window), or holds fewer positions than the window."""
        layers = cache.layers
        if len(layers) != len(self.layers):
            return False
        for i in self.windowed:
            c = layers[i]
            if not ((type(c) is DynamicSlidingWindowLayer and c.sliding_window == self.window)
                    or (type(c) is DynamicLayer and c.get_seq_length() < self.window)):
                return False
        return True

    # -- the decode path ----------------------------------------------------------------------
    def _args(self, args: tuple, kwargs: dict):
        """(input_ids, cache, position_ids or None, the mask to build the layers' from or None,
        whether to build one, the positions the cache holds) when this call is a plain decode step."""
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                return None
            kwargs = {"input_ids": args[0], **kwargs}
        if not kwargs.keys() <= _KWARGS or kwargs.get("inputs_embeds") is not None:
            return None
        cfg = self.config
        if torch.is_grad_enabled() and self.module.embed_tokens.weight.requires_grad:
            return None  # a forward autograd records: the layers' own forwards
        for flag in _FLAGS:
            if kwargs.get(flag) or getattr(cfg, flag, False):
                return None
        use_cache = kwargs.get("use_cache")
        if not (use_cache if use_cache is not None else getattr(cfg, "use_cache", False)):
            return None
        ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
        if (type(ids) is not torch.Tensor or ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > DECODE_MAX_ROWS
                or ids.dtype is not torch.int64 or not ids.is_cpu or type(cache) not in (DynamicCache, StaticCache)):
            return None
        past = cache.get_seq_length()
        if past == 0:
            return None
        B = ids.shape[0]
        mask = kwargs.get("attention_mask")
        if mask is not None and (type(mask) is not torch.Tensor or mask.dim() not in (2, 4) or mask.shape[0] != B
                                 or not mask.is_cpu):
            return None  # another form (a dict of masks, ...): the stack's own forward
        pos = kwargs.get("position_ids")
        if pos is not None and (type(pos) is not torch.Tensor or pos.dim() != 2 or pos.shape[1] != 1
                                or pos.shape[0] not in (1, B) or not pos.is_cpu):
            return None
        if type(cache) is DynamicCache and (mask is None or (mask.dim() == 2 and mask.shape[1] == past + 1
                                                             and bool(mask.all()))):
            if self.windowed and not self._in_window(cache):
                return None
            return ids, cache, pos, None, False, past  # the layers get no mask
        if self.mask_fn is None or self.windowed:
            return None
        return ids, cache, pos, mask, True, past

    def _observed(self) -> bool:
        """Whether something would see a layer's module call, or a part a layer skips: the layers
        replaced (in the stack or its list), their forwards replaced, hooks on them (but
        transformers' idle output-capturing ones), what their own Watches see (self.watch: all of
        them in one pass), a layer training or no longer ready."""
        if observing() or len(self.layer_list._modules) != len(self.layers) or self.config.num_hidden_layers != len(self.layers):
            return True
        for d in self.layer_dicts:
            if d["training"]:
                return True
        for r in self.runners:
            if not r.ready:
                return True
        return self.watch.observed()

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """This thread's buffer `name` for a step's tensor that nothing keeps past the step (the
        embedded input, the one call's scratch; concurrent steps on other threads have their own):
        a decode step allocates no tensor it does not return. Made outside inference mode, so a
        step outside it can read and write it too."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        t = bufs.get(name)
        if t is None or t.shape != shape or t.dtype is not dtype:
            with torch.inference_mode(False):
                t = bufs[name] = torch.empty(shape, dtype=dtype)
        return t

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """embed_tokens(ids) [B, 1, H]: a plain nn.Embedding that nothing would see skipped (no
        hook, its own forward, no max_norm) has its rows copied natively into this thread's buffer
        (_buffer; the layers read it, nothing keeps it); anything else, or an id outside the table
        (the module's call raises it), is the module's call."""
        e = self.module._modules.get("embed_tokens")
        w = e._parameters.get("weight") if type(e) is nn.Embedding else None
        if (w is None or e.max_norm is not None or e._forward_hooks or e._forward_pre_hooks or "forward" in e.__dict__
                or type(w) not in (nn.Parameter, torch.Tensor) or w.dim() != 2 or not w.is_contiguous()
                or not w.is_cpu or not ids.is_contiguous()):
            return e(ids)
        B, H = ids.shape[0], w.shape[1]
        h = self._buffer("h", (B, 1, H), w.dtype)
        row = H * w.element_size()
        if not self.native.gather_rows_raw(w.data_ptr(), w.shape[0], row, ids.data_ptr(), B, h.data_ptr()):
            return e(ids)
        return h

    def _output_type(self, cls: type) -> None:
        if self.out_type is not cls:
            self.out_type, self.outputs = cls, Outputs(cls, ("last_hidden_state", "past_key_values"))

    def _run(self, ids: torch.Tensor, cache, pos, mask2d, masked: bool, past: int):
        return self.outputs.build(self._hidden(ids, cache, pos, mask2d, masked, past)[0], cache)

    def _hidden(self, ids: torch.Tensor, cache, pos, mask2d, masked: bool, past: int,
                head=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode step of _args' arguments: (the final norm's output, the own forward's
        last_hidden_state; the logits of `head` when they were computed in the one call, else
        None). head: a causal LM's lm_head runner (a NativeLinear) to run at the end of the one
        call (NativeCausalLM, HEAD_IN_CALL), where the final norm runs too; its hidden state is
        then a buffer of the thread's that the next step overwrites."""
        m = self.module
        h = self._embed(ids)
        rotary = m.rotary_emb
        # the rotary module's output from its table (hi_na_moe.fastpath.rope_table): of past for every row
        # (the stack's own positions), or of the given position_ids (generate passes them)
        rope = None
        if rotary is self.rope.module and ROPE_TABLE:
            rope = self.rope.lookup(h, past) if pos is None else self.rope.lookup_ids(h, pos)
        if pos is None and (rope is None or masked):  # as the stack's own forward makes them
            pos = (torch.arange(ids.shape[1]) + past).unsqueeze(0)
        mask = None
        if masked:
            mask = self.mask_fn(config=self.config, inputs_embeds=h, attention_mask=mask2d, past_key_values=cache,
                                position_ids=pos)
        pe = rope if rope is not None else rotary(h, pos)
        # (cos, sin), or DeepSeek-V2's one complex tensor, as the layers get it (pe)
        cos, sin = (pe, None) if type(pe) is torch.Tensor else pe
        pe = cos if sin is None else (cos, sin)
        at = self.runners[0].attn
        kw = {"position_embeddings": pe, "attention_mask": mask}
        if getattr(at, "q_scale", None) is not None:  # (Mistral 4's query scale reads the positions)
            kw["position_ids"] = pos if pos is not None else torch.full((ids.shape[0], 1), past, dtype=torch.long)
        fast = (at._fast_args(self.runners[0].attn_mod, (h,), kw)
                if type(h) is torch.Tensor and h.is_contiguous() and not h.is_neg() else None)
        if fast is not None:
            # (latent attention's with a query scale: NativeMLA._fast_args' fifth)
            qs = fast[4] if self.runners[0].mla and len(fast) > 4 else None
            out = self._one_call(h, cos, sin, cache, mask, qs, head) if ONE_CALL else None
            if out is not None:
                h, normed, logits = out
                if normed is not None:  # the final norm ran in the call
                    return normed, logits
            else:
                for r in self.runners:  # (latent attention's layers take the position embeddings whole)
                    h = r._fast(h, pe, None, cache, mask, qs) if r.mla else r._fast(h, cos, sin, cache, mask)
        else:  # a fallback, for hidden states the short paths do not read (say, another dtype than
            # the layers' after a cast): the layers called as the stack's own loop calls them
            if rope is not None:  # the layers' own code gets copies, not the table's rows
                pe = cos.clone() if sin is None else (cos.clone(), sin.clone())
                pos = (torch.arange(ids.shape[1]) + past).unsqueeze(0)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                          position_embeddings=pe)
        return m.norm(h), None

    def one_call_blocker(self) -> str | None:
        """Why this stack's decode steps never run in one native call ("<layer>: <reason>", for
        the report), or None."""
        if not ONE_CALL:
            return "hi_na_moe.fastpath.stack.ONE_CALL is False"
        for r in self.runners:
            why = r.one_call_blocker()
            if why is not None:
                return f"{r.name}: {why}"
        return None

    def _one_call(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, mask,
                  qs: torch.Tensor | None = None, head=None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None] | None:
        """The layers' decode step in one native call (ONE_CALL): (the last layer's output, the
        final norm's output when it ran in the call (_final_norm) else None, head's logits when
        it ran in the call (after the final norm) else None); or None with nothing run: a layer
        cannot (NativeLayer.plan_args) or its cache cannot take the new position in place.
        mask: None or the bool mask over the keys the attention's decode path takes (padding; a
        StaticCache's buffers, which it needs). qs: latent attention's query scale of this step's
        positions (Mistral 4: NativeMLA._fast_args), the same for every layer."""
        B, dt = h.shape[0], h.dtype
        args = []
        for r in self.runners:
            a = r.plan_args(dt, B)
            if a is None:
                return None
            args.append(a)
        slots, kv = [], []
        static = type(cache) is not self._dynamic  # a StaticCache (_args): its buffers, under its mask
        latent = self.runners[0].mla  # the tables' form: latent attention's, or the others'
        # a DynamicCache's layers of one form: their slots at once (kv_cache.slots, whose new
        # buffers are one tensor and whose commits are two torch ops for all)
        at0 = self.runners[0].attn
        together = None
        if not (static or latent) and all(not r.mla and (r.attn.Hkv, r.attn.D) == (at0.Hkv, at0.D) for r in self.runners):
            together = kv_cache.slots(cache, [r.attn_mod.layer_idx for r in self.runners], B, at0.Hkv, at0.D, dt)
            if together is None:
                return None
        for i, r in enumerate(self.runners):
            at = r.attn
            if r.mla != latent:
                return None
            # latent attention's cache: the latents [B, 1, cap, L] as keys, the rope keys as values
            heads, D, Dv = (1, at.L, at.Dr) if latent else (at.Hkv, at.D, None)
            if static:
                s = kv_cache.static_slot(cache, r.attn_mod.layer_idx, B, heads, D, dt, Dv)
                S = None if s is None or mask is None else s.k.shape[2]
            else:
                s = together[i] if together is not None else kv_cache.slot(cache, r.attn_mod.layer_idx, B, heads, D, dt, Dv)
                S = None if s is None else s.t + 1
            if (S is None or (not latent and at.kernel_keys is not None and S > at.kernel_keys)
                    or (mask is not None and mask.shape[-1] != S)):
                return None
            # (a sliding-window layer's view starts later: Slot.base)
            a = s.layout()
            slots.append(s)
            kv += (a[0], a[1], a[2], a[3], a[4], S, s.t, a[5], a[6])
        norm = self._final_norm(dt)
        # the head (its BoundForward and threads) when it can run after the final norm in the call
        head_key = None
        if head is not None and norm is not None and head.dtype is dt and head.in_features == h.shape[-1]:
            head_key = (head.bound, head.threads or torch.get_num_threads())
        plan = self._plan
        if plan is None or plan[1] != args or (head_key is not None and plan[2] != head_key):
            step = native_module()[0].StepPlan(len(args))
            for i, a in enumerate(args):
                step.set_layer(i, **a)
            if head_key is not None:
                step.set_head(*head_key)
            plan = self._plan = (step, args, head_key)
        at = self.runners[0].attn
        if latent:  # rope_latent's tables (NativeMLA.native_tables), rows of Dr
            tables = at.native_tables(cos if sin is None else (cos, sin))
            if tables is None:
                return None
            (cos, sin), width = tables, at.Dr
        else:
            width = at.table_width()  # a row of the tables (half: GPT-OSS's)
            cos, sin = cos.contiguous(), sin.contiguous()
        kv = array("q", kv)
        if qs is not None:  # one value a row
            qs = qs.reshape(-1).expand(B).contiguous()
        scratch = self._buffer("scratch", (plan[0].scratch_bytes(B),), torch.uint8)
        # the last layer's output: the step's only when the final norm runs in the call (else the
        # norm module gets it, and a hook on it could keep it); the norm's, when the head's
        # logits are the step's
        out = torch.empty_like(h) if norm is None else self._buffer("out", tuple(h.shape), dt)
        normed = (None if norm is None else torch.empty_like(h) if head_key is None
                  else self._buffer("normed", tuple(h.shape), dt))
        logits = None if head_key is None else torch.empty((B, 1, head.out_features), dtype=dt)
        names = plan[0].run(B, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), width if cos.numel() == B * width else 0,
                            0 if mask is None else mask.data_ptr(),
                            0 if mask is None or mask.shape[0] == 1 else mask.stride(0),
                            kv.buffer_info()[0], scratch.data_ptr(), out.data_ptr(),
                            *((0, 0.0, 0) if norm is None else (norm[0], norm[1], normed.data_ptr())),
                            0 if qs is None else qs.data_ptr(), 0 if logits is None else logits.data_ptr())
        if static:
            for s in slots:
                kv_cache.static_commit(s)
        else:
            kv_cache.commit_all(slots)
        for r, name in zip(self.runners, names):
            if r.moe is not None:  # (a dense layer runs no experts)
                _LAST_KERNEL[r.moe.experts.handle] = name
        return out, normed, logits

    def _final_norm(self, dt: torch.dtype) -> tuple[int, float] | None:
        """(weight address, eps) when the stack's final norm can run at the end of the one call
        as its NativeNorm (hi_na_moe.fastpath.linear) would run it, with nothing to see the module call
        skipped (no hook, the forward patched at enable, the same module); else None."""
        r = self.norm_runner
        norm = self.module._modules.get("norm")
        if (not FINAL_NORM or r is None or norm is not r.module or norm._forward_hooks or norm._forward_pre_hooks
                or norm.__dict__.get("forward") is not self.norm_forward):
            return None
        w = norm._parameters.get("weight")
        if (type(w) not in (nn.Parameter, torch.Tensor) or w.dtype is not dt or w.numel() != r.n
                or not w.is_contiguous() or not w.is_cpu or (norm.training and torch.is_grad_enabled() and w.requires_grad)):
            return None
        return w.data_ptr(), r.eps

    def forward(self, module: nn.Module, *args, **kwargs):
        fast = self._args(args, kwargs) if self.ready and not module.training else None
        if fast is None or self._observed():
            return self.original(*args, **kwargs)
        return self._run(*fast)


# -- the causal LM around a stack ---------------------------------------------------------------
# A *ForCausalLM's decode step around its NativeStack costs its own forward (transformers'
# decorators, the argument defaults, the slice of logits_to_keep), two module calls (the stack's
# and the lm_head's) and two output objects: ~0.3 ms of a cold Qwen1.5-MoE 4L int4 step
# (benchmarks/studies/study_step_python.py), 2-3 % of it. NativeCausalLM runs such a step as the stack's
# step and the lm_head called straight, one output object. CAUSAL_LM = False keeps the own forward.
CAUSAL_LM = True
# its lm_head (a NativeLinear) at the end of the stack's one call, after the final norm there
HEAD_IN_CALL = True

_LM_CHILDREN = frozenset(("model", "lm_head"))
_LM_KWARGS = _KWARGS | {"logits_to_keep", "labels", "return_dict"}


def find_causal_lms(model: nn.Module, exclude: str, candidates: set[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules whose children are exactly `model` and `lm_head` (an
    nn.Linear), `model` being a decoder stack patched as a NativeStack (so: after the stacks are
    patched); with `candidates` (for inspect_model, nothing patched): whose `model` is in it."""
    found = []
    if not CAUSAL_LM:
        return found
    for name, m in model.named_modules():
        if set(m._modules) != _LM_CHILDREN or not isinstance(m._modules["lm_head"], nn.Linear) or _matches(name, exclude):
            continue
        if candidates is None:
            r = patched_runner(m._modules["model"])
            ok = isinstance(r, NativeStack) and r.ready
        else:
            ok = (f"{name}.model" if name else "model") in candidates
        if ok:
            found.append((name, m))
    return found


class NativeCausalLM:
    """A *ForCausalLM whose plain decode calls run its NativeStack's step and its lm_head straight.

    A plain decode call: one the stack's forward takes its decode path for (NativeStack._args),
    with at most these of the causal LM's own arguments besides: labels None, return_dict None or
    True (and the config's return_dict true), logits_to_keep an int >= 0 (one position: every
    such int keeps it). The lm_head, when it is a NativeLinear, runs at the end of the stack's one
    call when the final norm does (HEAD_IN_CALL), else its runner's forward is called. Anything
    that would see a skipped call (a hook on `model` or `lm_head`, a forward or child replaced,
    what NativeStack._observed sees) runs the own forward.

    What it computes is checked before it is patched: from a cache the own forward filled with a
    prompt, one decode step of the own forward and one of this path, each on its own copy of the
    cache, must give an output of the same type with only logits and past_key_values set, the
    same logits bit for bit and the same cache; with logits_to_keep 0 and 1 and a mask of ones."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward):
        self.name, self.module = name, module
        self.original = original_forward
        self.ready = False

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass

    def matches(self) -> bool:
        m = self.module
        self.stack_module, self.head = m._modules["model"], m._modules["lm_head"]
        self.stack = patched_runner(self.stack_module)
        if not (isinstance(self.stack, NativeStack) and self.stack.ready):
            return False
        self.config = getattr(m, "config", None)
        if self.config is None:
            return False
        runner = patched_runner(self.head)
        # a single patched linear is called straight (its runner's forward); else the module
        self.head_runner = runner if isinstance(runner, NativeLinear) and len(runner.modules) == 1 else None
        skipped = [self.stack_module] + ([self.head] if self.head_runner is not None else [])
        self.watch = Watch(skipped, [(m, "model"), (m, "lm_head")])
        self.out_type = None
        return self._probe()

    def _probe(self) -> bool:
        gen = torch.Generator().manual_seed(12)
        B, T = 2, 3
        vocab = self.stack_module.embed_tokens.weight.shape[0]
        ids = torch.randint(vocab, (B, T), generator=gen)
        nxt = torch.randint(vocab, (B, 1), generator=gen)
        try:
            with torch.no_grad():
                prompt = DynamicCache(config=self.stack.config)
                self.original(input_ids=ids, past_key_values=prompt, use_cache=True)
                for kw in ({"logits_to_keep": 1}, {"logits_to_keep": 0, "attention_mask": torch.ones(B, T + 1, dtype=torch.long)}):
                    own, ours = copy.deepcopy(prompt), copy.deepcopy(prompt)
                    want = self.original(input_ids=nxt, past_key_values=own, use_cache=True, **kw)
                    if self.out_type is not type(want):
                        self.out_type, self.outputs = type(want), Outputs(type(want), ("logits", "past_key_values"))
                    fast = self._args((), {"input_ids": nxt, "past_key_values": ours, "use_cache": True, **kw})
                    if fast is None or self.watch.observed():
                        return False
                    got = self._run(fast)
                    if (type(got) is not type(want) or set(want.keys()) != {"logits", "past_key_values"}
                            or set(got.keys()) != {"logits", "past_key_values"}
                            or want.past_key_values is not own or got.past_key_values is not ours
                            or got.logits.dtype != want.logits.dtype or not torch.equal(got.logits, want.logits)):
                        return False
                    if not _same_cache(own, ours):
                        return False
        except Exception:
            return False
        self.ready = True
        return True

    def _args(self, args: tuple, kwargs: dict):
        """The stack's _args for this call when it is a plain decode call (class docstring), else None."""
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                return None
            kwargs = {"input_ids": args[0], **kwargs}
        if not kwargs.keys() <= _LM_KWARGS or kwargs.get("labels") is not None:
            return None
        rd = kwargs.get("return_dict")  # (None: the config's, as transformers' can_return_tuple reads it)
        if rd is not True and (rd is not None or not getattr(self.config, "return_dict", True)):
            return None
        keep = kwargs.get("logits_to_keep", 0)
        if type(keep) is not int or keep < 0:
            return None
        rest = {k: v for k, v in kwargs.items() if k not in ("logits_to_keep", "labels", "return_dict")}
        return self.stack._args((), rest)

    def _run(self, fast: tuple):
        head = self.head_runner
        if not HEAD_IN_CALL or (head is not None and self.head.training and torch.is_grad_enabled()):
            head = None  # (the runner's forward takes training with autograd elsewhere)
        h, logits = self.stack._hidden(*fast, head)
        if logits is None:
            logits = self.head(h) if self.head_runner is None else self.head_runner.forward(self.head, h)
        return self.outputs.build(logits, fast[1])

    def forward(self, module: nn.Module, *args, **kwargs):
        fast = (self._args(args, kwargs)
                if self.ready and self.stack.ready and not (module.training or self.stack_module.training) else None)
        if fast is None or self.watch.observed() or self.stack._observed():
            return self.original(*args, **kwargs)
        return self._run(fast)
