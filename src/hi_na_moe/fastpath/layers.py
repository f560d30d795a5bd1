"""scope="all": a pre-norm decoder layer's decode step in few calls.

After the norms, the attention, the routers and the linears run on native kernels, what is left of
a decode step besides the weight stream is the Python between them. A decode step calls ~15
modules per decoder layer (OLMoE: the layer, two norms, the attention, its four projections and
two q/k norms, the MoE block, its router and experts), each through nn.Module.__call__, and two
residual adds; with the caches the weight stream leaves behind, each frame and each torch op
costs several times its hot time (benchmarks/studies/bench_call_overhead.py).

Which layers: a module whose class name ends in "DecoderLayer", with input_layernorm, self_attn,
post_attention_layernorm and mlp, both norms patched as hi_na_moe.fastpath.norm.NativeNorm and the
attention as hi_na_moe.fastpath.attention.NativeAttention (or latent attention as hi_na_moe.fastpath.mla.NativeMLA,
whose decode path calls its own projections) by this enable. Its decode call then runs as:
the input norm's kernel; the attention's decode path with its q/k/v projections, q/k norms and
o_proj called straight on their runners (no module calls); one native call for the residual add
and the post-attention norm; the MoE block's router and experts called straight on their runners
when the block is of a known form (the router then the experts, as OLMoE, Mixtral and Qwen3-MoE
write it; those plus a sigmoid-gated shared expert, as Qwen2-MoE does, the shared expert and its
gate called as modules), else the mlp module called as usual (the first of what it returns when
that is a tuple: GPT-OSS's block returns its router scores too); one native call for the last
residual add.

Everything else is the layer's own forward: prefill, training, any argument the attention's
decode path does not take, and any call while something would observe the modules this path
does not call: a forward hook or pre-hook on them (transformers' output-capturing hooks only
while they capture), a global module hook, a dispatch or function mode, torch.compile tracing,
or a forward replaced after enable.

When every part is on a runner the native calls take, the step is two native calls around the
cache update instead (layer_decode_pre: input norm, q/k/v, q/k norms, rotary, k and v written into
the cache's buffers; layer_decode_post: attention, o_proj, residual add and post-attention norm,
the router's logits (a float32 router on a float32 copy of its input) and selection (with a
score-correction bias), the experts, a shared expert (gated or not), the last residual add; in a
dense layer its gated MLP on the native MLP call and the last residual add), and hi_na_moe.fastpath.stack
can run all layers' steps in one (plan_args). Latent attention's layers take them too
(_latent_native): the first call runs the q / kv_a projections' packed group, q_a_layernorm and
q_b_proj (with a q_lora_rank), the rotary form (hina::rope_latent: DeepSeek-V2's complex product
where PyTorch's is vectorised, 16 pairs a head or a multiple of them; V3's interleaved pairs;
rotate_half) and kv_a_layernorm, writing the latent and the rope key into the cache's two buffers,
and the second runs the absorbed kernel (mla_decode) before o_proj. Where those calls do not give
the layer's bits its probe falls back to the Python step above.

What it computes is checked before it is patched: on a probe (two rows of random hidden states
and rotary tables, a DynamicCache holding a few positions) the layer's own forward, itself on
the patched modules, and this path must return the same output and append the same keys and
values, bit for bit (the adds round as PyTorch's add does, the norm is the same kernel). A layer
whose MoE block fails it with the block's short path is probed again with the block called as a
module.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from ..core.native import native_module
from ..core.registry import patched_experts, patched_runner
from ..core.torch_ops import _LAST_KERNEL
from . import kv_cache, routers
from .attention import FORMS, NativeAttention
from .common import _DTYPE_CODES, DECODE_MAX_ROWS, _matches
from .linear import patched_member
from .mla import ROPES, NativeMLA, native_weight
from .mlp import NativeMLP, sigmoid_rows
from .norm import NativeNorm
from .routers import ROUTER_MAX_ROWS, NativeRouter
from .watch import Watch, observing

# with the router's selection native (routers.NATIVE_SELECT), the MoE block's experts and the
# layer's last residual add run in the same native call as the attention (layer_decode_post)
FUSE_EXPERTS = True
# with them, a shared expert on the native MLP call (hi_na_moe.fastpath.mlp) and its gate too; False: the
# shared expert runs as modules after the call (and the stack keeps its loop)
FUSE_SHARED = True
# plan_args returns the last step's arguments (the same dict) while nothing they hold changed, and
# a layer keeps its partial StepPlan (_layer_call) as long
HOLD_PLAN_ARGS = True

_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _region(scratch: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """The tensor of dtype and shape at byte offset (StepPlan.layer_regions': 64-byte aligned) in a
    partial plan's scratch."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return scratch[offset:offset + n].view(dtype).view(shape)


def _cache_of(k: torch.Tensor, v: torch.Tensor, S: int) -> tuple:
    """StepPlan's 9 values of a cache (k, v [B, heads, positions, D or Dv], the heads' stride k's):
    the first call writes position 0 and the second reads [0, S)."""
    ks, vs = k.stride(), v.stride()
    return k.data_ptr(), v.data_ptr(), ks[0], ks[1], ks[2], S, 0, vs[0], vs[2]


def _slot_of(slot) -> tuple:
    """StepPlan's 9 values of a cache slot (kv_cache.Slot): the first call writes its next
    position, the second reads up to it."""
    a = slot.layout()
    return a[0], a[1], a[2], a[3], a[4], slot.t + 1, slot.t, a[5], a[6]


_NO_CACHE = (0,) * 9  # (the second call's cache when PyTorch ran the attention: not read)


def find_layers(model: nn.Module, exclude: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the decoder layers of the pre-norm shape (see the module docstring);
    whether their parts run on native kernels is checked when they are patched."""
    found = []
    for name, m in model.named_modules():
        if (type(m).__name__.endswith("DecoderLayer") and not _matches(name, exclude)
                and all(isinstance(getattr(m, p, None), nn.Module) for p in _PARTS)):
            found.append((name, m))
    return found


class NativeLayer:
    """One decoder layer whose decode calls take the short path of the module docstring."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward):
        self.name, self.module = name, module
        self.original = original_forward
        self.native = native_module()[0]
        self.ready = False
        self.mla = False  # the attention is latent attention (hi_na_moe.fastpath.mla)
        self.step = self.latent_step = None  # what the native calls run (_native_step, _latent_native)
        self._plan_held = None  # (key, arguments, parts) of plan_args' last step (_layer_args)
        self._call_held = None  # (key, arguments, parts, plan, scratch size, regions): _layer_call's last

    # -- the parts ----------------------------------------------------------------------------
    def _prepare(self) -> bool:
        """Resolve the parts' runners; False when the layer is not of this shape."""
        m = self.module
        self.ln1, self.attn_mod, self.ln2, self.mlp = (getattr(m, p) for p in _PARTS)
        self.norm1, self.norm2 = patched_runner(self.ln1), patched_runner(self.ln2)
        self.attn = patched_runner(self.attn_mod)
        # latent attention (hi_na_moe.fastpath.mla): its decode path called straight, the layer's step in
        # Python (no native calls: layer_decode_pre/post know no latent cache)
        self.mla = isinstance(self.attn, NativeMLA) and self.attn.rope is not None
        if self.mla and self.attn.no_rope:  # (a module without rotary embedding takes no position embeddings)
            return False
        if not (isinstance(self.norm1, NativeNorm) and isinstance(self.norm2, NativeNorm)
                and (isinstance(self.attn, NativeAttention) and self.attn.form is not None or self.mla)):
            return False
        # the attention's projections and q/k norms as functions (no module calls), for its
        # decode path; latent attention calls its own (NativeMLA._projections)
        self.direct = None if self.mla else self._attention_direct()
        self.hidden = self.norm1.n
        self.moe = self._moe_direct(self.mlp)
        self.dense = self._dense_native() if self.moe is None else None
        self.step = None if self.mla else self._native_step()
        self.latent_step = self._latent_native() if self.mla else None
        self._watch()
        self.ready = self.norm2.n == self.hidden == self.attn.hidden
        return self.ready

    def _attention_direct(self) -> tuple:
        """(qkv(h) -> (q, k, v), q_norm, k_norm, o_proj) computing what the attention module's
        parts compute without their module calls (a part not on a runner: the module itself)."""
        a = self.attn_mod

        def direct(mod: nn.Module):
            """A function computing mod(x) without its module call, or the module itself."""
            runner = patched_runner(mod)
            if isinstance(runner, NativeNorm):
                return lambda x: runner.forward(mod, x)
            member = patched_member(mod)
            if member is not None and len(member[0].modules) == 1:
                runner = member[0]
                return lambda x: runner.forward(mod, x)
            return mod

        q, k, v = patched_member(a.q_proj), patched_member(a.k_proj), patched_member(a.v_proj)
        if (q is not None and k is not None and v is not None and q[0] is k[0] is v[0]
                and (q[1], k[1], v[1]) == (0, 1, 2) and len(q[0].modules) == 3):
            group = q[0]
            qkv = lambda h: group.split(group.forward(a.q_proj, h))  # noqa: E731  one kernel call
        else:
            qp, kp, vp = direct(a.q_proj), direct(a.k_proj), direct(a.v_proj)
            qkv = lambda h: (qp(h), kp(h), vp(h))  # noqa: E731
        norms = (direct(a.q_norm), direct(a.k_norm)) if self.attn.form != FORMS[0] else (None, None)
        return qkv, norms[0], norms[1], direct(a.o_proj)

    def _native_step(self):
        """(q/k/v group, o_proj's runner, q/k norm code, q_norm's and k_norm's runners) for the
        two native calls (layer_decode_pre/post), or None when a part is not on a runner they can
        call: the projections one q/k/v group and o_proj alone on the dense kernels, the q/k norms
        (if any) on the norm kernel, no clamp of q/k/v."""
        a, at = self.attn_mod, self.attn
        q, o = patched_member(a.q_proj), patched_member(a.o_proj)
        if (q is None or len(q[0].modules) != 3 or patched_member(a.k_proj) != (q[0], 1)
                or patched_member(a.v_proj) != (q[0], 2) or o is None or len(o[0].modules) != 1
                or at.clip is not None or q[0].dtype is not at.dtype or o[0].dtype is not at.dtype):
            return None
        qk = FORMS.index(at.form)
        norms = (None, None)
        if qk:
            norms = (patched_runner(a.q_norm), patched_runner(a.k_norm))
            if not all(isinstance(n, NativeNorm) for n in norms):
                return None
        return q[0], o[0], qk, norms[0], norms[1]

    def _latent_native(self):
        """For latent attention (hi_na_moe.fastpath.mla): (the packed group of q_proj or q_a_proj and
        kv_a_proj_with_mqa, o_proj's runner, q_b_proj's runner or None, q_a_layernorm's NativeNorm or
        None (both None without q_lora_rank), kv_a_layernorm's NativeNorm, the rotary form's code in
        mla.ROPES) for the two native calls, or None when a part is not on a runner they can call:
        the two projections one group of two on the dense kernels, q_b_proj and o_proj alone on
        them, the norms on the norm kernel."""
        a, at = self.attn_mod, self.attn
        if at.lora_scales or at.output_gate:  # (forms the native calls do not run: the Python step)
            return None
        lora = getattr(a, "q_lora_rank", None) is not None
        g = patched_member(a.q_a_proj if lora else a.q_proj)
        kv, o = patched_member(a.kv_a_proj_with_mqa), patched_member(a.o_proj)
        if (g is None or kv is None or g[0] is not kv[0] or (g[1], kv[1]) != (0, 1) or len(g[0].modules) != 2
                or o is None or len(o[0].modules) != 1 or g[0].dtype is not at.dtype or o[0].dtype is not at.dtype):
            return None
        qb = qa = None
        if lora:
            b, qa = patched_member(a.q_b_proj), patched_runner(a.q_a_layernorm)
            if (b is None or len(b[0].modules) != 1 or b[0].dtype is not at.dtype or not isinstance(qa, NativeNorm)
                    or qa.n != a.q_lora_rank):
                return None
            qb = b[0]
        kvn = patched_runner(a.kv_a_layernorm)
        if not isinstance(kvn, NativeNorm) or kvn.n != at.L:
            return None
        # the complex form's bits are PyTorch's vectorised complex product's: a head of fewer than
        # 16 pairs, or not a multiple of 16, leaves pairs to its scalar loop, which contracts an FMA
        if at.rope == "complex" and (at.Dr // 2) % 16:
            return None
        return g[0], o[0], qb, qa, kvn, ROPES.index(at.rope)

    def _watch(self) -> None:
        """What _observed compares at every call (Watch): the modules this path does not call
        through __call__ (with a fused shared expert, its modules too), and the links it found
        them by."""
        a = self.attn_mod
        skipped = [self.ln1, self.ln2, *a.modules()]
        links = [(self.module, p) for p in _PARTS] + [(a, n) for n, _ in a.named_children()]
        if self.moe is not None:
            skipped += [self.mlp, self.moe.gate, self.mlp.experts]
            links += [(self.mlp, n) for n, _ in self.mlp.named_children()]
            if self.moe.shared_native is not None:
                plain = "shared_experts" in self.mlp._modules
                se = self.mlp.shared_experts if plain else self.mlp.shared_expert
                skipped += [*se.modules()] + ([] if plain else [self.mlp.shared_expert_gate])
                links += [(se, n) for n, _ in se.named_children()]
        elif self.dense is not None:  # the dense MLP in the native call
            skipped += [*self.mlp.modules()]
            links += [(self.mlp, n) for n, _ in self.mlp.named_children()]
        self.watch = Watch(skipped, links)
        # the norms' weights as the native calls read them, through the parameter dicts (a
        # module attribute lookup of a parameter is a Python call, and this runs every step)
        params = [(self.ln1._parameters, self.norm1.n), (self.ln2._parameters, self.norm2.n)]
        if self.step is not None and self.step[2]:
            params += [(a.q_norm._parameters, self.step[3].n), (a.k_norm._parameters, self.step[4].n)]
        if self.latent_step is not None:  # (q_a_layernorm's with q_lora_rank, then kv_a_layernorm's)
            qa, kv = self.latent_step[3], self.latent_step[4]
            params += ([] if qa is None else [(a.q_a_layernorm._parameters, qa.n)]) + [(a.kv_a_layernorm._parameters, kv.n)]
        self.params = tuple(params)

    def _moe_direct(self, mlp: nn.Module):
        """A function computing a MoE block's forward for decode rows without the block's, its
        router's and its experts' module calls, or None. The forms: the router then the experts
        (OLMoE, Mixtral, Qwen3-MoE; GPT-OSS's router child is named router and its block also
        returns the router's scores, which its layer drops), and those plus a sigmoid-gated shared
        expert (Qwen2-MoE) or shared experts added as they are (ERNIE 4.5, GLM-4.5, Aria), each
        called as a module; the layer's probe tells whether the block computes that."""
        children = {n for n, _ in mlp.named_children()}
        shared = children == {"gate", "experts", "shared_expert", "shared_expert_gate"}
        # added, no gate: ERNIE 4.5, GLM-4.5, dots.llm1 (gate), Aria (router)
        plain = children in ({"gate", "experts", "shared_experts"}, {"router", "experts", "shared_experts"})
        if (not (children in ({"gate", "experts"}, {"router", "experts"}) or shared or plain)
                or mlp.__dict__.get("forward") is not None):
            return None
        gate, experts = mlp._modules["router" if "router" in children else "gate"], mlp.experts
        router, runner = patched_runner(gate), patched_experts(experts)
        if not isinstance(router, NativeRouter) or runner is None or router.hidden != self.hidden:
            return None
        H = self.hidden
        # a router taking the correction bias as an argument (MiniMax-M2, Hunyuan-V3): the block's
        # buffer, read at every call (the layer's probe shows the block passes it)
        buffers = mlp._buffers
        if router.bias_arg and not isinstance(buffers.get(routers.BIAS_BUFFER), torch.Tensor):
            return None

        def moe(x: torch.Tensor, logits: torch.Tensor | None = None, chosen: tuple | None = None) -> torch.Tensor:
            """The block's output; `logits`: the router's, already computed natively from x
            (layer_decode_post), after router._unchanged(gate) said its packed copy is current;
            `chosen`: with them, the router's (weights, indices) from router_select."""
            h = x.view(-1, H)
            arg = (buffers.get(routers.BIAS_BUFFER),) if router.bias_arg else ()
            if chosen is not None:
                w, idx = chosen
            elif logits is None:
                _, w, idx = router.forward(gate, h, *arg)
            else:
                _, w, idx = router.form(lambda _: logits, h, router._bias(*arg) if router.biased else None)
            out = runner.fast(h, idx, w)
            if out is None:
                out = experts(h, idx, w)
            if shared:
                out = out + torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
            elif plain:
                out = out + mlp.shared_experts(h)
            return out.view(x.shape)

        moe.router, moe.gate, moe.experts, moe.shared = router, gate, runner, shared or plain
        # the correction bias as the native calls read it (router._bias), or None
        moe.bias = lambda: router._bias(buffers.get(routers.BIAS_BUFFER) if router.bias_arg else None)
        moe.shared_native = self._shared_native(mlp, plain) if shared or plain else None
        return moe

    def _shared_native(self, mlp: nn.Module, plain: bool):
        """(the shared expert's NativeMLP, its gate's NativeLinear or None when `plain`: added without
        one) when the native calls can run both in the layer's step (layer_decode_post), else None:
        the shared expert on the gated-MLP call (hi_na_moe.fastpath.mlp), its gate alone on the dense kernel,
        one output, the layer's dtype."""
        runner = patched_runner(mlp.shared_experts if plain else mlp.shared_expert)
        if not isinstance(runner, NativeMLP) or not runner.ready or runner.hidden != self.hidden:
            return None
        if plain:
            return runner, None
        g = patched_member(mlp.shared_expert_gate)
        if (g is None or g[1] != 0 or len(g[0].modules) != 1 or g[0].out_features != 1
                or g[0].in_features != self.hidden or g[0].dtype is not runner.dtype):
            return None
        sigmoid_rows(runner.dtype)  # (its probe now, at enable, not in a decode step: _shared_args)
        return runner, g[0]

    def _dense_native(self):
        """The dense MLP's NativeMLP when the native call can run it (layer_decode_post's mlp: a
        dense layer, as ERNIE 4.5's first, DeepSeek's first_k_dense_replace or Qwen2-MoE's
        mlp_only_layers), else None."""
        runner = patched_runner(self.mlp)
        if not isinstance(runner, NativeMLP) or not runner.ready or runner.hidden != self.hidden:
            return None
        return runner

    def _observed(self) -> bool:
        """Whether something would see the skipped modules' calls (module docstring)."""
        return observing() or self.parts_observed()

    def parts_observed(self) -> bool:
        """Whether a hook, a replaced forward or a replaced part would see the skipped modules."""
        return self.watch.observed()

    # -- the decode path ----------------------------------------------------------------------
    def _fast(self, x: torch.Tensor, cos, sin: torch.Tensor | None, cache, mask, qs=None) -> torch.Tensor:
        """The decode step; latent attention (self.mla) takes its position embeddings as `cos`
        (sin None): a complex tensor or a (cos, sin) pair, as the module gets them, and with a
        query scale (Mistral 4) the scale of the call's positions as qs (NativeMLA._fast_args)."""
        B, H = x.shape[0], self.hidden
        if (self.step is not None or self.latent_step is not None) and B <= DECODE_MAX_ROWS:
            out = self._native_fast(x, cos, sin, cache, mask, qs)
            if out is not None:
                return out
        code = _DTYPE_CODES[x.dtype]
        h = self.norm1.forward(self.ln1, x)
        if self.mla:
            a, _ = self.attn._decode(self.attn_mod, h, cos, cache, mask, qs)
        else:
            a, _ = self.attn._decode(self.attn_mod, self.attn.form, h, cos, sin, cache, mask, self.direct)
        w = self.ln2.weight
        if (type(a) is torch.Tensor and a.shape == x.shape and a.dtype is x.dtype and a.is_contiguous()
                and not a.is_neg() and w.dtype is x.dtype and w.is_contiguous() and w.is_cpu and B <= DECODE_MAX_ROWS):
            s, n2 = torch.empty_like(x), torch.empty_like(x)
            self.native.add_rms_norm_raw(x.data_ptr(), a.data_ptr(), B, H, w.data_ptr(), self.norm2.eps,
                                         s.data_ptr(), n2.data_ptr(), code)
        else:
            s = x + a
            n2 = self.ln2(s)
        if self.moe is not None:
            return self._residual(s, self.moe(n2), code)
        out = self.mlp(n2)
        # a block returning (hidden, router scores), as GPT-OSS's does and its layer unpacks
        # (the probe shows whether the layer takes the first)
        return self._residual(s, out[0] if type(out) is tuple else out, code)

    def _residual(self, s: torch.Tensor, out, code: int) -> torch.Tensor:
        """s + out, the layer's last residual add: natively into s (a tensor of this call's own)
        when out is as the kernel reads it."""
        if (type(out) is torch.Tensor and out.shape == s.shape and out.dtype is s.dtype and out.is_contiguous()
                and not out.is_neg() and out.is_cpu):
            self.native.add_raw(s.data_ptr(), out.data_ptr(), s.numel(), s.data_ptr(), code)
            return s
        return s + out

    def _norm_weights(self, dt: torch.dtype) -> list[torch.Tensor] | None:
        """The norms' weights the native calls read (input, post-attention, then q and k norms if
        any), through the parameter dicts at every step, or None when one is not as they read it
        (another dtype or size, not contiguous, not on the CPU)."""
        weights = []
        for params, n in self.params:
            w = params.get("weight")
            if (type(w) not in (nn.Parameter, torch.Tensor) or w.dtype is not dt or w.numel() != n
                    or not w.is_contiguous() or not w.is_cpu):
                return None
            weights.append(w)
        return weights

    def _native_fast(self, x: torch.Tensor, cos, sin: torch.Tensor | None, cache, mask, qs=None):
        """The step in two native calls around the cache update, through this layer's partial
        StepPlan (_layer_call): with the router's native selection (routers.NATIVE_SELECT) the
        second one also runs the selection, the experts and the last residual add (FUSE_EXPERTS;
        a shared expert not on them makes the whole MoE block run as modules after it), else the
        form runs in PyTorch on the call's logits and the experts' kernel after it; None, with
        nothing run, when a weight is not as the kernels read it (then the per-module path runs).
        Latent attention (self.mla) takes its position embeddings as `cos` (sin None)."""
        weights = self._norm_weights(x.dtype)
        if weights is None:
            return None
        plan, parts, nbytes, regions = self._layer_call(x.dtype, x.shape[0], weights)
        scratch = torch.empty(nbytes, dtype=torch.uint8)
        if self.mla:
            pre = self._latent_pre(x, cos, cache, mask, plan, scratch, regions, qs)
            if pre is None:
                return None
        else:
            pre = self._attention_pre(x, cos, sin, cache, mask, plan, scratch, regions)
        return self._post(x, plan, parts, scratch, regions, *pre)

    def _attention_pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, mask, plan, scratch,
                       regions: dict) -> tuple:
        """The first native call (StepPlan.layer_pre) and the cache update of a layer of
        hi_na_moe.fastpath.attention: (the cache the second call's attention reads, the mask it
        applies, the heads' outputs when PyTorch's SDPA computed them instead (None: the kernel
        does), the tensors the call's addresses point into)."""
        at, dt = self.attn, x.dtype
        B, D, Hq, Hkv = x.shape[0], at.D, at.Hq, at.Hkv
        cos, sin = cos.contiguous(), sin.contiguous()
        width = at.table_width()  # a row of the tables (half: GPT-OSS's)
        # k and v go straight into the cache's buffers when it can grow in place (kv_cache)
        slot = None if cache is None else kv_cache.slot(cache, self.attn_mod.layer_idx, B, Hkv, D, dt)
        if slot is None:
            k, v = torch.empty(B, Hkv, 1, D, dtype=dt), torch.empty(B, Hkv, 1, D, dtype=dt)
            kv = _cache_of(k, v, 0)
        else:
            kv = _slot_of(slot)
        plan.layer_pre(B, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), width if cos.numel() == B * width else 0, kv,
                       scratch.data_ptr(), scratch.numel())
        if slot is not None:
            keys, values = kv_cache.commit(slot)
        else:
            keys, values = (k, v) if cache is None else cache.update(k, v, self.attn_mod.layer_idx)
        # (the kernel takes one head stride for keys and values)
        if at.kernel_fits(keys, values, mask, B) and keys.stride(1) == values.stride(1):
            return _cache_of(keys, values, keys.shape[2]), mask, None, (keys, values, cos, sin)
        # SDPA does the attention math (attention.math_kernel); the second call then skips its own
        m = self.attn_mod
        sinks = at._sink_logits(m)
        heads = torch.empty(B, 1, Hq * D, dtype=dt)
        at.sdpa(m, _region(scratch, regions["q"], dt, (B, Hq, D)), keys, values, mask, heads, sinks)
        return _NO_CACHE, None, heads, (keys, values, cos, sin, sinks)

    def _latent_pre(self, x: torch.Tensor, pe, cache, mask, plan, scratch, regions: dict, qs=None) -> tuple | None:
        """_attention_pre for latent attention (hi_na_moe.fastpath.mla): the first native call makes the
        queries and writes the latent and rope key into the cache's buffers, and the second runs
        the absorbed attention kernel on them; None, with nothing run, when the rotary tables are
        not as the kernels read them."""
        at, dt = self.attn, x.dtype
        B, heads, Dn, Dr, L = x.shape[0], at.H, at.Dn, at.Dr, at.L
        tables = at.native_tables(pe)
        if tables is None:
            return None
        (tab, tab_s), width = tables, Dr
        idx = self.attn_mod.layer_idx
        slot = None if cache is None else kv_cache.slot(cache, idx, B, 1, L, dt, Dr)
        if slot is None:
            k, v = torch.empty(B, 1, 1, L, dtype=dt), torch.empty(B, 1, 1, Dr, dtype=dt)
            kv = _cache_of(k, v, 0)
        else:
            kv = _slot_of(slot)
        if qs is not None:  # a query scale: one value a row
            qs = qs.reshape(-1).expand(B).contiguous()
        plan.layer_pre(B, x.data_ptr(), tab.data_ptr(), tab_s.data_ptr(), width if tab.numel() == B * width else 0, kv,
                       scratch.data_ptr(), scratch.numel(), 0 if qs is None else qs.data_ptr())
        if slot is not None:
            latent, k_pe = kv_cache.commit(slot)
        else:
            latent, k_pe = (k, v) if cache is None else cache.update(k, v, idx)
        q = _region(scratch, regions["q"], dt, (B, heads, 1, Dn + Dr))  # the queries, their rope parts rotated
        q_nope, q_pe = q[..., :Dn], q[..., Dn:]
        keep = (tab, tab_s, latent, k_pe, qs)
        if at._kernel_fits(q_nope, q_pe, latent, k_pe, mask, B):
            return _cache_of(latent, k_pe, latent.shape[2]), mask, None, keep
        # the kernel's computation in PyTorch ops (NativeMLA._absorbed_torch)
        heads_out = torch.empty(B, 1, heads * at.Dv, dtype=dt)
        at._absorbed_torch(q_nope, q_pe, at._weight(), latent, k_pe, mask, self.attn_mod.scaling, heads_out)
        return _NO_CACHE, None, heads_out, keep

    def _post(self, x: torch.Tensor, plan, parts: tuple, scratch: torch.Tensor, regions: dict, kv: tuple, mask,
              heads: torch.Tensor | None, keep: tuple) -> torch.Tensor:
        """The second native call (StepPlan.layer_post) after _attention_pre or _latent_pre: the
        attention, o_proj, the residual add and norm, and what of the MLP block the layer's plan
        holds (parts: _layer_call's); the rest of the block after it, on the call's outputs."""
        dt = x.dtype
        B = x.shape[0]
        s = torch.empty_like(x)
        name = plan.layer_post(B, x.data_ptr(), kv, 0 if mask is None else mask.data_ptr(),
                               0 if mask is None or mask.shape[0] == 1 else mask.stride(0), scratch.data_ptr(),
                               scratch.numel(), s.data_ptr(), 0 if heads is None else heads.data_ptr())
        logits_ran, selected, fused, dense = parts
        moe = self.moe
        if fused:
            _LAST_KERNEL[moe.experts.handle] = name
            return s
        if dense:
            return s
        code = _DTYPE_CODES[dt]
        n2 = _region(scratch, regions["normed"], dt, tuple(x.shape))
        if moe is not None:
            router = moe.router
            logits = chosen = None
            if logits_ran:  # (in the router's dtype: a router that casts its input gives its own)
                logits = _region(scratch, regions["logits"], router.dtype, (B, router.experts))
            if selected:
                k = router.select[1]
                chosen = (_region(scratch, regions["w"], router.weights_dtype(dt), (B, k)),
                          _region(scratch, regions["idx"], torch.int64, (B, k)))
            return self._residual(s, moe(n2, logits, chosen), code)
        out = self.mlp(n2)
        return self._residual(s, out[0] if type(out) is tuple else out, code)  # (GPT-OSS's block: _fast)

    def _shared_args(self, moe, dt: torch.dtype, B: int) -> tuple | None:
        """A shared expert's arguments to the native calls (its gate/up group's and down_proj's
        BoundForwards, its intermediate size, and its gate's BoundForward if it has one), or None
        when they cannot run it."""
        if moe.shared_native is None or not FUSE_SHARED:
            return None
        mlp, gate = moe.shared_native
        if mlp.dtype is not dt or B > DECODE_MAX_ROWS:
            return None
        # the gate's sigmoid (shared_combine) is std::exp's, PyTorch's only up to so many rows (its
        # vector exp beyond); more: the block's own sigmoid, the shared expert after the call
        most = sigmoid_rows(dt)
        if gate is not None and most is not None and B > most:
            return None
        return mlp.bounds() + (() if gate is None else (gate.bound,))

    def _dense_args(self, dt: torch.dtype, B: int) -> tuple | None:
        """A dense layer's MLP arguments to the native calls (its gate/up group's and down_proj's
        BoundForwards, its intermediate size), or None when they cannot run it."""
        d = self.dense
        if d is None or not FUSE_EXPERTS or d.dtype is not dt or B > DECODE_MAX_ROWS:
            return None
        return d.bounds()

    def one_call_blocker(self) -> str | None:
        """Why this layer's decode step can never run in the stack's one native call (for the
        report), or None when it can, subject to what plan_args checks at each step."""
        moe = self.moe
        if self.mla:
            if self.latent_step is None:
                return ("its latent attention (MLA) runs in the layer's Python step: its projections or norms are not "
                        "on the runners the native calls take, or its rotary form is one they do not reproduce")
        elif self.step is None:
            return "its q/k/v or o_proj are not on the runners the native calls take"
        elif not self.attn.kernel:
            return f"no native attention kernel at tier {self.attn.isa} (PyTorch's SDPA does the math)"
        if moe is None:
            if self.dense is not None:
                return None
            if not isinstance(getattr(self.mlp, "experts", None), nn.Module):
                return "its dense MLP is not a gated MLP on the native MLP call (hi_na_moe.fastpath.mlp)"
            return "its MoE block is called as a module (not of the router-then-experts form)"
        if moe.shared and moe.shared_native is None:
            return ("its MoE block's shared expert is not on the native MLP call (with its sigmoid gate, if any, on "
                    "the dense kernel): run as modules after the routed experts")
        if moe.router.select is None:
            return "its router's softmax/top-k stay PyTorch's (router_select did not reproduce its probe)"
        if moe.router.dtype is not self.attn.dtype and not moe.router.casts:
            return "its router's dtype is not the layer's"
        return None

    def plan_args(self, dt: torch.dtype, B: int) -> dict | None:
        """This layer's keyword arguments to StepPlan.set_layer (after its index) for a decode step of B
        rows of dtype dt in hi_na_moe.fastpath.stack's one native call, or None when its step cannot run
        there: that call runs what _native_fast runs with the router's selection and the experts
        in the second call, the attention on the kernel, and no shared expert. Read at every step
        (the weights as _native_fast reads them, the router's _unchanged, the experts' binding):
        the stack sets a layer again when they change."""
        if (self.one_call_blocker() is not None or not FUSE_EXPERTS or not routers.NATIVE_SELECT
                or self.attn.dtype is not dt or B > DECODE_MAX_ROWS or B > ROUTER_MAX_ROWS):
            return None
        weights = self._norm_weights(dt)
        if weights is None:
            return None
        held = self._layer_args(dt, B, weights, True)
        return None if held is None else held[1]

    def _layer_call(self, dt: torch.dtype, B: int, weights: list[torch.Tensor]) -> tuple:
        """The partial StepPlan (one layer, its two calls apart) of this step of B rows in dtype dt,
        with what its second call runs (_layer_args' parts), its scratch's size and where in it the
        calls leave what the rest of the layer reads (StepPlan.layer_regions): made again only when
        the layer's arguments change."""
        held = self._layer_args(dt, B, weights, False)
        if len(held) == 3:
            key, args, parts = held
            plan = self.native.StepPlan(1, partial=True)
            plan.set_layer(0, **args)
            held = self._call_held = (key, args, parts, plan, plan.scratch_bytes(B), plan.layer_regions(B))
        return held[3:4] + held[2:3] + held[4:]

    def _layer_args(self, dt: torch.dtype, B: int, weights: list[torch.Tensor], full: bool) -> tuple | None:
        """StepPlan.set_layer's keyword arguments of this layer for a step of B rows in dtype dt, and
        parts: (the router's logits, its selection, the experts with the last residual add, a dense
        MLP with it) as the second call runs them. full (the stack's one call): the whole MLP block
        in the call, else None; else (the layer's own partial plan) what can run there now.
        Everything the arguments are made of that can change between steps is read first, into a
        key: while it equals the last step's, the last step's (key, arguments, parts[, the partial
        plan's]) are returned, the arguments the same dict (building them took about half of the
        7 us a layer plan_args takes warm; the stack then compares them by identity). The rest is
        fixed at enable (the runners' sizes, forms and groups)."""
        moe, at = self.moe, self.attn
        ptrs = [w.data_ptr() for w in weights]
        if self.mla:
            group, o, q_b, qa, kv, form = self.latent_step
            mla_w = native_weight(at._weight())  # kept by the attention runner while kv_b_proj's forward stays
            sinks, threads = None, group.threads or torch.get_num_threads()
            key = [dt, B, *ptrs, self.norm1.eps, self.norm2.eps, qa.eps if q_b is not None else 0.0, kv.eps,
                   self.attn_mod.scaling, threads, group.bound, o.bound, None if q_b is None else q_b.bound, mla_w]
        else:
            qkv, o, qk, qn, kn = self.step
            sinks = at._sink_logits(self.attn_mod)  # kept by the attention runner until the parameter changes
            threads = qkv.threads or torch.get_num_threads()
            key = [dt, B, *ptrs, self.norm1.eps, self.norm2.eps, qn.eps if qk else 0.0, kn.eps if qk else 0.0,
                   self.attn_mod.scaling, threads, 0 if sinks is None else sinks.data_ptr(), qkv.bound, o.bound]
        dense = fused = shared = settings = None
        logits_ran = selected = False
        if moe is None:  # a dense layer
            dense = self._dense_args(dt, B)
            if dense is None and full:
                return None
            key.append(dense)
        else:
            logits_ran, bias = self._router_ready(moe, dt, B)
            router = moe.router
            selected = logits_ran and router.select is not None and routers.NATIVE_SELECT
            if selected:
                shared = self._shared_args(moe, dt, B) if moe.shared else ()
                if FUSE_EXPERTS and shared is not None:
                    fused = moe.experts.bound_for(dt, self.hidden, B * router.select[1])
                settings = router.select_settings(bias)
            if full and fused is None:
                return None
            key += [logits_ran, router.bound, router.select, router.experts, router.dtype, selected, fused, shared,
                    settings]
        key = tuple(key)
        held = self._plan_held if full else self._call_held
        if HOLD_PLAN_ARGS and held is not None and held[0] == key:
            return held
        args = dict(dtype=_DTYPE_CODES[dt], H=self.hidden, ln1_w=ptrs[0], ln1_eps=self.norm1.eps, o=o.bound,
                    ln2_w=ptrs[1], ln2_eps=self.norm2.eps, scale=self.attn_mod.scaling, isa=at.isa,
                    num_threads=threads)
        if self.mla:
            lora = 0 if q_b is None else qa.n
            args.update(qkv=group.bound, Hq=at.H, Hkv=1, D=at.Dn + at.Dr, qk_norm=0, qn_w=0, kn_w=0, qn_eps=0.0,
                        kn_eps=0.0, mla=(form, at.Dn, at.Dr, at.L, lora, None if q_b is None else q_b.bound,
                                         ptrs[2] if lora else 0, qa.eps if lora else 0.0, ptrs[-1], kv.eps),
                        mla_w=mla_w, mla_Dv=at.Dv)
        else:
            args.update(qkv=qkv.bound, Hq=at.Hq, Hkv=at.Hkv, D=at.D, qk_norm=qk, qn_w=ptrs[2] if qk else 0,
                        kn_w=ptrs[3] if qk else 0, qn_eps=qn.eps if qk else 0.0, kn_eps=kn.eps if qk else 0.0,
                        sinks=0 if sinks is None else sinks.data_ptr(), half_table=at.half_table,
                        interleaved_f32=at.rope == "interleaved_f32", rot=at.rot)
        if dense is not None:
            args["mlp"] = dense
        elif logits_ran:
            args.update(router=router.bound, E=router.experts,
                        router_dtype=_DTYPE_CODES[router.dtype] if router.dtype is not dt else -1)
            if selected:
                form, k, renorm = router.select[:3]
                args.update(sel_form=form, sel_k=k, sel_renorm=renorm,
                            sel_w_dtype=_DTYPE_CODES[router.weights_dtype(dt)], **settings)
                if fused is not None:
                    args.update(experts=fused[0], experts_threads=fused[1], shared=shared)
        held = (key, args, (logits_ran, selected, fused is not None, dense is not None))
        if full:
            self._plan_held = held
        return held

    def _router_ready(self, moe, dt: torch.dtype, B: int) -> tuple[bool, torch.Tensor | None]:
        """(whether the native calls can compute the MoE block's router for B rows of dtype dt now,
        the score-correction bias they then read or None): a router of the layer's dtype or one whose
        form casts its input, decode-sized rows, not training, its packed copy current, its bias (if
        any) as the form reads it."""
        router, gate = moe.router, moe.gate
        if ((router.dtype is not dt and not router.casts) or B > ROUTER_MAX_ROWS or gate.training
                or not router._unchanged(gate)):
            return False, None
        if not router.biased:
            return True, None
        bias = moe.bias()
        return bias is not None, bias

    def forward(self, module: nn.Module, *args, **kwargs):
        if self.ready and not module.training and len(args) == 1 and not self._observed():
            x = args[0]
            fast = self.attn._fast_args(self.attn_mod, (x,), kwargs)
            if fast is not None and x.is_contiguous() and not x.is_neg():
                if self.mla:  # (a query scale's last: NativeMLA._fast_args)
                    return self._fast(x, fast[1], None, fast[2], fast[3], fast[4] if len(fast) > 4 else None)
                _, cos, sin, cache, mask = fast
                return self._fast(x, cos, sin, cache, mask)
        return self.original(*args, **kwargs)

    # -- the probe ----------------------------------------------------------------------------
    def matches(self) -> bool:
        """Whether the layer has this shape and its own forward gives this path's bits on the
        probe of the module docstring; with the MoE block's short path when it has one, else
        with the block called as a module."""
        if not self._prepare():
            return False
        if self._probe():
            return True
        if self.latent_step is not None:  # latent attention in the layer's step in Python instead
            self.latent_step = None
            self._watch()
            if self._probe():
                return True
        if self.moe is None:
            return False
        if self.moe.shared_native is not None:  # the shared expert as modules after the call
            self.moe.shared_native = None
            self._watch()
            if self._probe():
                return True
        self.moe = None  # a block of another form: called as a module
        self._watch()
        return self._probe()

    def _probe(self) -> bool:
        at = self.attn
        gen = torch.Generator().manual_seed(3)
        B, past = 2, 4
        x = torch.randn(B, 1, self.hidden, generator=gen).to(at.dtype)
        if self.mla:  # the latent and rope key cache, the form's position embeddings
            ang = torch.rand(B, 1, at.Dr // 2, generator=gen) * 6.3
            pe = at._tables(at.rope, ang)
            cos, sin = (pe, None) if at.rope == "complex" else pe
            k0 = torch.randn(B, 1, past, at.L, generator=gen).to(at.dtype)
            v0 = torch.randn(B, 1, past, at.Dr, generator=gen).to(at.dtype)
        else:
            ang = torch.rand(B, 1, at.D // 2, generator=gen) * 6.3
            pe = cos, sin = at.tables(ang)  # the tables the attention takes
            k0 = torch.randn(B, at.Hkv, past, at.D, generator=gen).to(at.dtype)
            v0 = torch.randn(B, at.Hkv, past, at.D, generator=gen).to(at.dtype)
        idx = self.attn_mod.layer_idx

        def cache():
            c = DynamicCache()
            c.update(k0.clone(), v0.clone(), idx)
            return c

        extra, qs = {}, None
        if self.mla and at.q_scale is not None:  # a query scale (Mistral 4): a row past the original context
            fn, beta, orig = at.q_scale
            pos = torch.tensor([[3 * orig + 2], [past]])
            extra, qs = {"position_ids": pos}, fn(pos, beta, orig).to(at.dtype)
        with torch.no_grad():
            own, ours = cache(), cache()
            try:
                want = self.original(x, attention_mask=None, past_key_values=own, use_cache=True,
                                     position_embeddings=pe, **extra)
                got = self._fast(x, pe if self.mla else cos, sin, ours, None, qs)
            except Exception:
                return False
        if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or want.shape != got.shape:
            return False
        mine, theirs = ours.layers[idx], own.layers[idx]
        self.ready = (torch.equal(got, want) and torch.equal(mine.keys, theirs.keys)
                      and torch.equal(mine.values, theirs.values))
        return self.ready

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass
