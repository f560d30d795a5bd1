"""scope="all": the decode step of Llama-like attention modules on native kernels.

On a decode step an attention module does little arithmetic but many small PyTorch ops: views
and transposes, the rotary embedding (about ten elementwise ops), the KV-cache update, SDPA, a
reshape. With the caches the weight streaming leaves behind, OLMoE-1B-7B's attention modules
took 5-7 ms of a 43-50 ms int4 step besides their projections (benchmarks/log/decode-step.md, 2026-11-30).
Here a decode call (one new token per sequence; no attention mask, or a bool one over the keys
as a StaticCache or a padded batch brings) runs as: the module's own
projections and q/k norms (themselves on native kernels under scope="all"), one native call for
the rotary embedding of q and k, the cache update (in place for a DynamicCache: hi_na_moe.fastpath.kv_cache),
one native call for the attention (AVX-512 build; AVX2 build up to 512
cached positions; elsewhere PyTorch's SDPA, faster there on Intel, and the report says which;
on AMD CPUs, where SDPA measured 2.5-25x slower, the native kernel at every tier), and
the module's own o_proj. A prefill call of a bfloat16 model (several new tokens; no mask, or a
bool one) runs the same way with the attention on the native prefill kernel (bfloat16 dot
products: CPUs with AVX512-BF16 at the avx512/amx tiers, on AMD CPUs, where SDPA measured
0.3-0.5x its speed; elsewhere SDPA; see prefill_math). Everything else (float masks, training,
attention weights asked for, unknown arguments) is the module's own forward.

Which modules: a class named *Attention with q_proj, k_proj, v_proj and o_proj, an integer
head_dim, layer_idx and num_key_value_groups, a float scaling, and the model's attention
implementation "sdpa" or "eager" (GPT-OSS has no other on CPU). Under eager, transformers passes
additive float masks: one holding only 0 and the dtype's lowest value (or -inf) is taken as the
bool mask it stands for, any other (ALiBi-like biases) leaves the call to the module; a prefill
call without a mask (eager then attends every key) too; and the attention weights eager returns
are not computed, so a call while transformers captures them (output_attentions) or while another
hook watches the module is the module's own. Attention sinks (GPT-OSS: a learned logit per head
in the softmax's denominator, the module's `sinks`) and rotary tables of half the head size
(GPT-OSS's cos/sin, applied to the two halves) are forms of their own, and so is ERNIE 4.5's
rotation of interleaved pairs in float32 on float32 tables, and GLM-4.5's partial rotary (the
first int(head_dim * partial_rotary_factor) values of a head rotated, the rest kept; tried first
when the config sets the factor); a sliding window is in the
mask transformers builds, which the kernels follow. What it computes is checked
before it is patched: on a probe (random hidden states and rotary tables, a DynamicCache holding
a few positions) its own forward and each known form run side by side. A form is taken when the
keys and values it appends to the cache are the module's bit for bit (projections, norms,
clamp and the rotary embedding in the same roundings) and its output is within the dtype's
rounding of the module's (the attention's float32 sums run in another order than SDPA's). The
forms differ only in where q/k norms sit: none (Llama, Mixtral, Qwen2-MoE), on the whole
projection (OLMoE) or per head (Qwen3-MoE); OLMoE's clip_qkv clamp is read from the config.
A module with a `sinks` tensor of one value per query head is tried with them; rotary tables of
head_dim / 2 are tried when the module's forward rejects full-width ones.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ..core.native import native_module
from . import kv_cache
from .common import _DTYPE_CODES, DECODE_MAX_ROWS, _matches
from .watch import _idle_capture_hooks

# tier -> (the build of the attention kernel it runs, the most cached positions it takes; beyond
# them PyTorch's SDPA), by CPU vendor, from benchmarks/bench_attention_kernel.py (RESULTS.md):
# - Intel (the Xeon measured on 2026-11-30): the AVX-512 build took 0.21-0.95x SDPA's time from 16 to 4096
#   positions; the AVX2 build 0.32x at 16, 0.91x at 512 and 1.3-1.8x beyond (SDPA held to AVX2
#   too, ATEN_CPU_CAPABILITY=avx2); the generic tier's baseline loops 1.4-2.7x from 144 positions
#   on, so there SDPA does the math.
# - AMD (the EPYC measured on 2026-11-30, Zen 4, torch 2.13): SDPA took 2.5-25x the native kernel's time at
#   every tier and length measured (16-4096 positions; the AVX2 build 0.08-0.11x of SDPA held to
#   AVX2, the generic loops 0.19-0.24x): the native kernel at every tier and length.
# - Anything else: the Intel table (untested).
INTEL_TIERS = {"avx2": ("AVX2", 512), "avx512": ("AVX-512", None), "amx": ("AVX-512", None)}
AMD_TIERS = {"generic": ("generic C++", None), "avx2": ("AVX2", None), "avx512": ("AVX-512", None),
             "amx": ("AVX-512", None)}


@functools.cache
def _vendor() -> str:
    """The CPU's vendor string ("" without the native library: nothing runs the kernels then)."""
    try:
        return native_module()[0].cpu_features()["vendor"]
    except Exception:
        return ""


@functools.cache
def kernel_tiers() -> dict[str, tuple[str, int | None]]:
    """The tier table of this CPU's vendor (above)."""
    return AMD_TIERS if _vendor() == "AuthenticAMD" else INTEL_TIERS


# Prefill attention (more than one new token) of bfloat16 models: the native kernel
# (csrc/kernels/avx512/attention_prefill_avx512bf16.cpp) needs AVX512-BF16 and the avx512/amx
# tier. It is taken on the vendors below: on the AMD EPYC measured on 2026-12-01 SDPA took 1.9-3.5x
# its time at 512-4096 tokens (benchmarks/bench_prefill_attention.py, RESULTS.md). Intel CPUs
# with AVX512-BF16 have AMX as well, which SDPA's CPU kernel may use: unmeasured against it, so
# SDPA there.
PREFILL_VENDORS = frozenset({"AuthenticAMD"})
# False: prefill calls take the modules' own forward (for A/B measurements and as a way out)
PREFILL = True


def prefill_kernel(isa: str, D: int, Hq: int, Hkv: int) -> bool:
    """Whether prefill attention of a bfloat16 model with these heads runs on the native kernel."""
    native = native_module()[0]
    return (native is not None and _vendor() in PREFILL_VENDORS
            and bool(native.attention_prefill_supported(D, Hq, Hkv, isa)))


def prefill_math(isa: str) -> str:
    """What computes the attention of prefill calls at tier `isa` (for the report and `check`)."""
    native = native_module()[0]
    if native is None:
        return "PyTorch's SDPA (no native library)"
    if not native.attention_prefill_supported(128, 1, 1, isa):
        why = ("this CPU has no AVX512-BF16" if not native.cpu_features().get("avx512bf16")
               else f"the kernel runs at the avx512/amx tiers, not {isa}")
        return f"PyTorch's SDPA (a fallback: {why})"
    if _vendor() not in PREFILL_VENDORS:
        return "PyTorch's SDPA (the native AVX512-BF16 kernel is measured faster on AMD CPUs only)"
    return "the native AVX512-BF16 kernel for bfloat16 models (head sizes multiple of 16), PyTorch's SDPA otherwise"


def math_kernel(isa: str) -> str:
    """What computes the attention of a decode step at tier `isa` (for the report)."""
    tiers = kernel_tiers()
    if isa not in tiers:
        return f"PyTorch's SDPA (a fallback: the native kernel has no vector build for tier {isa})"
    name, most = tiers[isa]
    return f"the native {name} kernel" + (f" up to {most} cached positions, PyTorch's SDPA beyond" if most else "")


_MAX_BATCH = DECODE_MAX_ROWS  # sequences a decode call may have (common.DECODE_MAX_ROWS)
# arguments the families' decoder layers pass that these forms do not read (SDPA ignores them)
_IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits"})
# output tolerance on the probe, relative to the largest output value: the attention's float32
# sums in another order, rounded once to the dtype, then o_proj
_OUT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8}
FORMS = ("no qk norm", "qk norm on the projections", "qk norm per head")
# the attention implementations whose calls these paths take (see the module docstring)
_IMPLEMENTATIONS = ("sdpa", "eager")


def _bool_of_additive(mask: torch.Tensor) -> torch.Tensor | None:
    """The bool mask an additive float mask stands for (0: attended; the dtype's lowest value or
    -inf: not), or None when it holds any other value (a bias the kernels do not add)."""
    allowed = mask == 0
    if bool(allowed.all()):  # a decode step's usual mask: two ops, not six
        return allowed
    blocked = (mask == torch.finfo(mask.dtype).min) | torch.isneginf(mask)
    if not bool((allowed | blocked).all()):
        return None
    return allowed



def find_attention(model: nn.Module, exclude: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the attention candidates (see the module docstring)."""
    found = []
    for name, m in model.named_modules():
        if not type(m).__name__.endswith("Attention") or _matches(name, exclude):
            continue
        if not all(isinstance(getattr(m, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            continue
        if not all(type(getattr(m, a, None)) is int for a in ("head_dim", "layer_idx", "num_key_value_groups")):
            continue
        if not isinstance(getattr(m, "scaling", None), float):
            continue
        if getattr(getattr(m, "config", None), "_attn_implementation", None) not in _IMPLEMENTATIONS:
            continue
        found.append((name, m))
    return found


def _sink_rescale(o: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  sinks: torch.Tensor, groups: int) -> torch.Tensor:
    """SDPA's output o [B, Hq, T, D] with attention sinks added to its softmax: each row's
    weights shrink by L / (L + e^z) = sigmoid(log L - z), L the sum of its exponentiated scores
    (float32, from the scores computed again; the SDPA fallback's, not the kernels' way). A row
    attending no key stays zeros."""
    k = keys.repeat_interleave(groups, dim=1) if groups > 1 else keys
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    f = torch.sigmoid(torch.logsumexp(scores, dim=-1, keepdim=True) - sinks.view(1, -1, 1, 1))
    return (o.float() * f).to(o.dtype)


def _watched(module: nn.Module) -> bool:
    """Whether a hook on the module may look at its output (eager's attention weights, which
    the native paths do not compute): any hook but transformers' idle output-capturing ones."""
    if not module._forward_hooks and not module._forward_pre_hooks:
        return False
    return not _idle_capture_hooks(module)


class DecodeCalls:
    """Decode calls (one new token) an attention runner took on its native path, and those it left
    to the module's own forward: a module whose probe matched but whose every call is refused at
    runtime (GLM-4.5's partial rotary tables before 2026-12-02) shows as native 0, own n
    (registry.decode_call_counts; `hi-na-moe bench` names such modules)."""

    __slots__ = ("native", "declined")

    def __init__(self):
        self.native = self.declined = 0

    def own(self, args: tuple, kwargs: dict) -> None:
        """Count a call the module's own forward takes, if it is decode-shaped."""
        h = args[0] if args else kwargs.get("hidden_states")
        if type(h) is torch.Tensor and h.dim() == 3 and h.shape[1] == 1:
            self.declined += 1


_CALL_NAMES = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")


def call_args(module: nn.Module, args: tuple, kwargs: dict, eager: bool, takes,
              names: tuple[str, ...] = _CALL_NAMES) -> tuple | None:
    """(hidden_states, position_embeddings, mask, past_key_values) of a call to an attention module
    holding only those (and arguments SDPA ignores), with hidden states [B, T, hidden] on the CPU
    that takes(hidden) accepts, and a mask that is None or bool [B or 1, 1, T, S] (under eager an
    additive float mask standing for one is converted; see the module docstring); else None.
    names: the forward's positional parameters, in order."""
    if module.training or len(args) > len(names):
        return None
    got = dict(zip(names, args))
    if any(key not in _CALL_NAMES and key not in _IGNORED_KWARGS for key in got):
        return None
    for key, val in kwargs.items():
        if key in _CALL_NAMES and key not in got:
            got[key] = val
        elif key == "output_attentions" and not val:
            continue
        elif key not in _IGNORED_KWARGS:
            return None
    h, mask = got.get("hidden_states"), got.get("attention_mask")
    if eager and _watched(module):
        return None
    if type(h) is not torch.Tensor or h.dim() != 3 or not h.is_cpu or h.requires_grad or not takes(h):
        return None
    B, T = h.shape[:2]
    if eager:
        if mask is None and T > 1:
            return None  # eager without a mask attends every key, not the causal ones
        if type(mask) is torch.Tensor and mask.is_floating_point() and mask.dim() == 4 and mask.is_cpu:
            mask = _bool_of_additive(mask)  # a few small ops for a decode step's [B, 1, 1, S]
            if mask is None:
                return None  # an additive bias, not a mask
    if mask is not None and (type(mask) is not torch.Tensor or mask.dtype is not torch.bool or mask.dim() != 4
                             or mask.shape[0] not in (1, B) or mask.shape[1] != 1 or mask.shape[2] != T
                             or mask.stride(3) != 1 or not mask.is_cpu):
        return None  # a float or per-head mask: the module's own forward
    return h, got.get("position_embeddings"), mask, got.get("past_key_values")


def prefill_probe(m: nn.Module, original, ours, h: torch.Tensor, pe, past: tuple, eager: bool,
                  skip_unattended: bool) -> bool:
    """Whether a runner's prefill path (ours(cache, mask) -> (output, None)) computes what the
    module's own forward (original) does on h [2, T, hidden] with position embeddings pe: the
    cache appended bit for bit, the output within rounding; on a fresh cache with no mask (causal:
    what transformers passes for a prompt) and on a cache holding past = (keys, values) with a bool
    mask (a later chunk of a prompt; the second row left-padded, its first query attending
    nothing). Under eager the module gets these masks as additive float ones, the prompt's causal
    one included. skip_unattended: leave out the outputs of queries attending nothing (the kernels
    give zeros there, eager without sinks the mean of the values: a padding position's output,
    which no other position reads)."""
    B, T = h.shape[:2]
    P = past[0].shape[2]
    dtype = h.dtype
    mask = torch.ones(B, 1, T, P + T, dtype=torch.bool).tril(P)
    mask[1, :, :, :P + 1] = False
    causal = torch.ones(1, 1, T, T, dtype=torch.bool).tril()
    for with_past in (False, True):
        caches = []
        for _ in range(2):
            c = DynamicCache()
            if with_past:
                c.update(past[0].clone(), past[1].clone(), m.layer_idx)
            caches.append(c)
        mk = mask if with_past else None
        own = mk
        if eager:  # transformers' additive masks; a prompt's causal one too (eager has no is_causal)
            mk = mk if with_past else causal
            own = torch.zeros(mk.shape, dtype=dtype).masked_fill(~mk, torch.finfo(dtype).min)
        try:
            want = original(hidden_states=h, position_embeddings=pe, attention_mask=own, past_key_values=caches[0])
            got, _ = ours(caches[1], mk)
        except Exception:
            return False
        if not isinstance(want, tuple) or not isinstance(want[0], torch.Tensor) or got.shape != want[0].shape:
            return False
        a, b = caches[0].layers[m.layer_idx], caches[1].layers[m.layer_idx]
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            return False
        want = want[0]
        if skip_unattended and mk is not None:
            seen = mk.any(-1).expand(B, 1, T).reshape(B, T)
            want, got = want[seen], got[seen]
        tol = _OUT_RTOL[dtype] * want.float().abs().amax()
        if not bool(((got.float() - want.float()).abs() <= tol).all()):
            return False
    return True


def _partial_rotary_dims(module: nn.Module, D: int) -> int | None:
    """The rotary dims of a head when the module's config rotates fewer than D of them (its
    partial_rotary_factor, in rope_parameters or on the config, as the rotary modules read it:
    int(D * factor)), else None."""
    cfg = getattr(module, "config", None)
    params = getattr(cfg, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    if type(factor) not in (int, float) or not 0 < factor < 1:
        return None
    rot = int(D * factor)
    return rot if rot >= 2 and rot % 2 == 0 else None


class NativeAttention:
    """One attention module whose decode calls run on the native rotary and attention kernels."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward, isa: str = "auto", threads: int = 0):
        self.name, self.module = name, module
        self.original = original_forward
        self.native = native_module()[0]
        self.isa, self.threads = isa, threads
        # else SDPA does the attention math (math_kernel); beyond kernel_keys positions too
        tiers = kernel_tiers()
        self.kernel = isa in tiers
        self.kernel_keys = tiers[isa][1] if self.kernel else None
        self.D = module.head_dim
        self.Hq = module.q_proj.out_features // self.D
        self.Hkv = module.k_proj.out_features // self.D
        self.hidden = module.q_proj.in_features
        self.dtype = module.o_proj.weight.dtype
        self.form: str | None = None
        self.clip = getattr(getattr(module, "config", None), "clip_qkv", None)
        self.eager = getattr(getattr(module, "config", None), "_attn_implementation", None) == "eager"
        # the probe's findings: whether the module's sinks enter the softmax, and whether its rotary
        # tables are head_dim / 2 wide (GPT-OSS)
        self.sinks = False
        self._sink_f32, self._sink_key = None, None
        self.half_table = False
        # the rotary form: "rotate_half" (transformers' usual, tables in the model's dtype) or
        # "interleaved_f32" (ERNIE 4.5: pairs (2i, 2i + 1), float32 math on float32 tables)
        self.rope = "rotate_half"
        self.table_dtype = self.dtype
        # the rotary dims of a head (rotate_half: the first rot rotated, the rest kept; GLM-4.5's
        # partial_rotary_factor makes it less than D)
        self.rot = self.D
        # prefill calls on the native kernel (prefill_kernel), once the probe saw them match
        self.prefill = False
        self.calls = DecodeCalls()

    # -- the decode path ----------------------------------------------------------------------
    def _project(self, m: nn.Module, h: torch.Tensor, form: str, B: int, direct=None):
        """q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D] (contiguous) as the module computes them
        before the rotary embedding. `direct` (hi_na_moe.fastpath.layers): (qkv(h) -> (q, k, v),
        q_norm(x), k_norm(x)) computing what the modules compute, without their module calls."""
        if direct is None:
            q, k, v = m.q_proj(h), m.k_proj(h), m.v_proj(h)
            q_norm, k_norm = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
        else:
            q, k, v = direct[0](h)
            q_norm, k_norm = direct[1], direct[2]
        if form == FORMS[1]:
            q, k = q_norm(q), k_norm(k)
        elif form == FORMS[2]:
            q = q_norm(q.view(B, 1, self.Hq, self.D))
            k = k_norm(k.view(B, 1, self.Hkv, self.D))
        if self.clip is not None:
            q, k, v = (t.clamp(min=-self.clip, max=self.clip) for t in (q, k, v))
        return (q.reshape(B, self.Hq, self.D).contiguous(), k.reshape(B, self.Hkv, self.D).contiguous(),
                v.reshape(B, self.Hkv, self.D).contiguous())

    def _sink_logits(self, m: nn.Module) -> torch.Tensor | None:
        """The module's sinks as float32 [Hq], or None when its softmax has none: a copy made
        again whenever the parameter changes (another tensor, or its version counter moved)."""
        if not self.sinks:
            return None
        p = m.sinks
        key = (id(p), p.data_ptr(), p._version)
        if self._sink_key != key:
            self._sink_f32, self._sink_key = p.detach().float().contiguous(), key
        return self._sink_f32

    def table_width(self) -> int:
        """Values a row of the rotary tables the module takes holds."""
        return self.rot // 2 if self.half_table else self.rot

    def tables(self, ang: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the angles ang [..., D/2] as this module's rotary module hands them over
        (the probes' tables): half-width or both halves, of the rotary dims, in the table dtype."""
        ang = ang[..., : self.rot // 2]
        emb = ang if self.half_table else torch.cat([ang, ang], dim=-1)
        return emb.cos().to(self.table_dtype), emb.sin().to(self.table_dtype)

    def _rotate(self, x: torch.Tensor, rows: int, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                threads: int) -> torch.Tensor:
        """x [rows, heads, D] through the rotary form (cos, sin: [rows, table_width()] contiguous)."""
        out = torch.empty_like(x)
        if self.rope == "interleaved_f32":
            self.native.rope_interleaved_f32_raw(x.data_ptr(), rows, heads, self.D, cos.data_ptr(), sin.data_ptr(),
                                                 cos.shape[-1], out.data_ptr(), _DTYPE_CODES[self.dtype], threads)
        else:
            self.native.rope_rotate_half_raw(x.data_ptr(), rows, heads, self.D, cos.data_ptr(), sin.data_ptr(),
                                             out.data_ptr(), _DTYPE_CODES[self.dtype], self.isa, threads,
                                             self.half_table, self.rot)
        return out

    def _decode(self, m: nn.Module, form: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                mask: torch.Tensor | None = None, direct=None):
        """(output, None) of a decode step; `direct` (hi_na_moe.fastpath.layers): the projections' and
        q/k norms' functions for _project, and o_proj's, called instead of the modules."""
        B = h.shape[0]
        code = _DTYPE_CODES[self.dtype]
        q, k, v = self._project(m, h, form, B, direct)
        w = self.table_width()
        cos, sin = cos.reshape(-1, w), sin.reshape(-1, w)
        if cos.shape[0] != B:  # one position for every row (position_ids [1, 1]): broadcast
            cos, sin = cos.expand(B, w), sin.expand(B, w)
        cos, sin = cos.contiguous(), sin.contiguous()
        threads = self.threads or torch.get_num_threads()
        qr = self._rotate(q, B, self.Hq, cos, sin, threads)
        kr = self._rotate(k, B, self.Hkv, cos, sin, threads)
        keys, values = kr.unsqueeze(2), v.unsqueeze(2)  # [B, Hkv, 1, D]
        if cache is not None:
            keys, values = kv_cache.append(cache, m.layer_idx, keys, values)
        out = torch.empty(B, 1, self.Hq * self.D, dtype=self.dtype)
        sinks = self._sink_logits(m)
        if self.kernel_fits(keys, values, mask, B):
            ks, vs = keys.stride(), values.stride()
            self.native.attention_decode_raw(
                code, qr.data_ptr(), B, self.Hq, self.Hkv, keys.shape[2], self.D, keys.data_ptr(), ks[0], ks[1], ks[2],
                values.data_ptr(), vs[0], vs[1], vs[2], m.scaling, out.data_ptr(),
                self.threads or torch.get_num_threads(), self.isa, 0 if mask is None else mask.data_ptr(),
                0 if mask is None or mask.shape[0] == 1 else mask.stride(0), 0 if sinks is None else sinks.data_ptr())
        else:
            self.sdpa(m, qr, keys, values, mask, out, sinks)
        return (m.o_proj(out) if direct is None else direct[3](out)), None

    def kernel_fits(self, keys, values, mask: torch.Tensor | None, B: int) -> bool:
        """Whether the native kernel takes the attention over these cached keys and values."""
        return (self.kernel and type(keys) is torch.Tensor and type(values) is torch.Tensor and keys.dtype is self.dtype
                and values.dtype is self.dtype and keys.dim() == 4 and keys.shape == values.shape
                and keys.shape[0] == B and keys.shape[1] == self.Hkv and keys.shape[3] == self.D
                and keys.shape[2] >= 1 and keys.stride(3) == 1 and values.stride(3) == 1 and keys.is_cpu
                and values.is_cpu and not keys.is_neg() and not values.is_neg()
                and (mask is None or mask.shape[-1] == keys.shape[2])
                and (self.kernel_keys is None or keys.shape[2] <= self.kernel_keys))

    def sdpa(self, m: nn.Module, qr: torch.Tensor, keys, values, mask, out: torch.Tensor,
             sinks: torch.Tensor | None = None) -> None:
        """The attention by PyTorch's SDPA into out [B, 1, Hq D]: no vector build for this tier,
        or a cache that hands back something the kernel does not take."""
        B = qr.shape[0]
        q = qr.view(B, self.Hq, 1, self.D)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=m.scaling,
                                           enable_gqa=self.Hq != self.Hkv)
        if sinks is not None:
            o = _sink_rescale(o, q, keys, mask, m.scaling, sinks, self.Hq // self.Hkv)
        out.copy_(o.transpose(1, 2).reshape(B, 1, -1))

    # -- the prefill path ---------------------------------------------------------------------
    def _prefill(self, m: nn.Module, form: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                 mask: torch.Tensor | None = None):
        """(output, None) of a call with T > 1 new tokens per row (bfloat16): the decode path's
        projections, rotary embedding and cache update over B T rows, the attention on the
        native prefill kernel (SDPA where it declines)."""
        B, T = h.shape[:2]
        q, k, v = self._project(m, h.reshape(B * T, 1, self.hidden), form, B * T)
        w = self.table_width()
        cos = cos.reshape(-1, T, w).expand(B, T, w).reshape(B * T, w).contiguous()
        sin = sin.reshape(-1, T, w).expand(B, T, w).reshape(B * T, w).contiguous()
        threads = self.threads or torch.get_num_threads()
        qr = self._rotate(q, B * T, self.Hq, cos, sin, threads)
        kr = self._rotate(k, B * T, self.Hkv, cos, sin, threads)
        keys = kr.view(B, T, self.Hkv, self.D).transpose(1, 2)  # [B, Hkv, T, D], as the module's
        values = v.view(B, T, self.Hkv, self.D).transpose(1, 2)
        if cache is not None:
            keys, values = kv_cache.append(cache, m.layer_idx, keys, values)
        out = torch.empty(B, T, self.Hq * self.D, dtype=self.dtype)
        sinks = self._sink_logits(m)
        done = False
        if (type(keys) is torch.Tensor and type(values) is torch.Tensor and keys.dtype is self.dtype
                and values.dtype is self.dtype and keys.dim() == 4 and keys.shape == values.shape
                and keys.shape[:2] == (B, self.Hkv) and keys.shape[3] == self.D and keys.stride(3) == 1
                and values.stride(3) == 1 and keys.is_cpu and values.is_cpu and not keys.is_neg()
                and not values.is_neg() and (mask is None or mask.shape[-1] == keys.shape[2])
                and (mask is not None or keys.shape[2] >= T)):
            ks, vs = keys.stride(), values.stride()
            mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
            done = self.native.attention_prefill_raw(
                qr.data_ptr(), T * self.Hq * self.D, self.Hq * self.D, self.D, B, T, self.Hq, self.Hkv,
                keys.shape[2], self.D, keys.data_ptr(), ks[0], ks[1], ks[2], values.data_ptr(), vs[0], vs[1], vs[2],
                m.scaling, out.data_ptr(), threads, self.isa, 0 if mask is None else mask.data_ptr(), mb,
                0 if mask is None else mask.stride(2), 0 if sinks is None else sinks.data_ptr())
        if not done:  # what transformers' SDPA call computes (no mask: causal over the first T keys)
            if mask is None:
                keys, values = keys[:, :, :T], values[:, :, :T]
                mask = torch.ones(T, T, dtype=torch.bool).tril() if sinks is not None else None
            qt = qr.view(B, T, self.Hq, self.D).transpose(1, 2)
            o = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, is_causal=mask is None,
                                               scale=m.scaling, enable_gqa=self.Hq != self.Hkv)
            if sinks is not None:
                o = _sink_rescale(o, qt, keys, mask, m.scaling, sinks, self.Hq // self.Hkv)
            out.copy_(o.transpose(1, 2).reshape(B, T, -1))
        return m.o_proj(out), None

    def forward(self, module: nn.Module, *args, **kwargs):
        fast = self._fast_args(module, args, kwargs, prefill=True)
        if fast is None:
            self.calls.own(args, kwargs)
            return self.original(*args, **kwargs)
        if fast[0].shape[1] == 1:
            self.calls.native += 1
            return self._decode(module, self.form, *fast)
        return self._prefill(module, self.form, *fast)

    def _fast_args(self, module: nn.Module, args: tuple, kwargs: dict, prefill: bool = False):
        """(hidden, cos, sin, cache, mask) when this call is a plain decode step, or with
        `prefill` a prefill call the native prefill kernel takes (self.prefill), else None."""

        def takes(h: torch.Tensor) -> bool:
            B, T = h.shape[:2]
            return (h.shape[2] == self.hidden and h.dtype is self.dtype and T >= 1
                    and (B <= _MAX_BATCH if T == 1 else prefill and self.prefill and PREFILL))

        got = call_args(module, args, kwargs, self.eager, takes)
        if got is None:
            return None
        h, pe, mask, cache = got
        if not isinstance(pe, tuple) or len(pe) != 2:
            return None
        B, T = h.shape[:2]
        cos, sin = pe
        w = self.table_width()
        for t in (cos, sin):
            if (type(t) is not torch.Tensor or t.dtype is not self.table_dtype or t.numel() not in (B * T * w, T * w)
                    or not t.is_cpu or t.is_neg() or t.shape[-1] != w):
                return None
        return h, cos, sin, cache, mask

    # -- the probe ----------------------------------------------------------------------------
    def matches(self) -> bool:
        """Whether one of the forms computes what the module's own forward does (module docstring):
        the q/k norm forms, with or without the module's sinks, with full-width or half-width
        rotary tables; under eager also with an additive float mask."""
        m = self.module
        gen = torch.Generator().manual_seed(5)
        B, past = 2, 5
        h = torch.randn(B, 1, self.hidden, generator=gen).to(self.dtype)
        ang = torch.rand(B, 1, self.D // 2, generator=gen) * 6.3
        k0 = torch.randn(B, self.Hkv, past, self.D, generator=gen).to(self.dtype)
        v0 = torch.randn(B, self.Hkv, past, self.D, generator=gen).to(self.dtype)
        # under eager, a second case: an additive mask hiding two of row 1's keys
        fmask = torch.zeros(B, 1, 1, past + 1, dtype=self.dtype)
        fmask[1, :, :, [0, 2]] = torch.finfo(self.dtype).min
        masks = [None] + ([fmask] if self.eager else [])
        sinks = getattr(m, "sinks", None)
        sink_options = ((True, False) if isinstance(sinks, torch.Tensor) and tuple(sinks.shape) == (self.Hq,)
                        else (False,))

        def cache():
            c = DynamicCache()
            c.update(k0.clone(), v0.clone(), m.layer_idx)
            return c

        # the rotary forms: (half-width tables, form, the tables' dtype, rotary dims); the partial
        # one first when the config asks for it (a module rotating whole heads on D-wide tables
        # would match the full form on the probe's tables, and then get narrower ones at runtime)
        ropes = [(False, "rotate_half", self.dtype, self.D), (True, "rotate_half", self.dtype, self.D),
                 (False, "interleaved_f32", torch.float32, self.D)]
        rot = _partial_rotary_dims(m, self.D)
        if rot is not None:
            ropes.insert(0, (False, "rotate_half", self.dtype, rot))
        with torch.no_grad():
            for half, rope, tdt, self.rot in ropes:
                self.half_table, self.rope, self.table_dtype = half, rope, tdt
                cos, sin = self.tables(ang)
                wants = []
                for mk in masks:
                    own_cache = cache()
                    try:
                        want = self.original(hidden_states=h, position_embeddings=(cos, sin), attention_mask=mk,
                                             past_key_values=own_cache)
                    except Exception:
                        break
                    if (not isinstance(want, tuple) or len(want) != 2 or (want[1] is not None and not self.eager)
                            or not isinstance(want[0], torch.Tensor) or want[0].shape != h.shape):
                        return False
                    layer = own_cache.layers[m.layer_idx]
                    wants.append((mk, want[0], layer.keys, layer.values))
                if len(wants) != len(masks):
                    continue  # this table width is not the module's
                for form in FORMS:
                    if form != FORMS[0] and not (isinstance(getattr(m, "q_norm", None), nn.Module)
                                                 and isinstance(getattr(m, "k_norm", None), nn.Module)):
                        continue
                    for with_sinks in sink_options:
                        self.sinks = with_sinks
                        if all(self._decode_matches(form, h, cos, sin, cache(), *w) for w in wants):
                            self.form = form
                            self.prefill = (self.dtype is torch.bfloat16
                                            and prefill_kernel(self.isa, self.D, self.Hq, self.Hkv)
                                            and self._prefill_matches(form, gen))
                            return True
        self.half_table = self.sinks = False
        self.rope, self.table_dtype, self.rot = "rotate_half", self.dtype, self.D
        return False

    def _decode_matches(self, form: str, h, cos, sin, cache, mask, want, want_k, want_v) -> bool:
        """Whether _decode in this form appends want_k/want_v bit for bit and returns want within
        rounding (mask: the module's own, an additive float one under eager)."""
        m = self.module
        try:
            got, _ = self._decode(m, form, h, cos, sin, cache, None if mask is None else _bool_of_additive(mask))
        except Exception:
            return False
        layer = cache.layers[m.layer_idx]
        if not (torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)):
            return False
        tol = _OUT_RTOL[self.dtype] * want.float().abs().amax()
        return got.shape == want.shape and bool(((got.float() - want.float()).abs() <= tol).all())

    def _prefill_matches(self, form: str, gen: torch.Generator) -> bool:
        """Whether the prefill path computes what the module's own forward does (prefill_probe)."""
        B, past, T = 2, 5, 7
        h = torch.randn(B, T, self.hidden, generator=gen).to(self.dtype)
        cos, sin = self.tables(torch.rand(B, T, self.D // 2, generator=gen) * 6.3)
        k0 = torch.randn(B, self.Hkv, past, self.D, generator=gen).to(self.dtype)
        v0 = torch.randn(B, self.Hkv, past, self.D, generator=gen).to(self.dtype)
        return prefill_probe(self.module, self.original, lambda c, mk: self._prefill(self.module, form, h, cos, sin, c, mk),
                             h, (cos, sin), (k0, v0), self.eager, self.eager)

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass
