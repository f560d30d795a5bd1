"""scope="all": the decode step of multi-head latent attention (MLA) modules on a native kernel.

DeepSeek-V2 and V3 and the families built on them attend through a compressed cache: a position
holds kv_lora_rank latent values (after kv_a_layernorm) and qk_rope_head_dim rotated key values
shared by every head. transformers' modules then make every head's keys and values of every
cached position again through kv_b_proj at every step and run SDPA over them: S x H x (Dn + Dv)
x L multiply-adds a layer and step, which grows with the context (DeepSeek-V2-Lite's shape on
this machine: 1.9 ms a layer at 80 positions, 35 ms at 2048; benchmarks/RESULTS.md).

Here a decode call (one new token per sequence, at most 256 sequences; no mask, or a bool one, or
under eager an additive one standing for a bool one) runs as: the module's own projections and
norms (q_proj, or q_a_proj, q_a_layernorm and q_b_proj; kv_a_proj_with_mqa and kv_a_layernorm:
themselves on native kernels under scope="all"), the rotary embedding of the rope parts in the
module's own PyTorch ops (a few small tensors), the cache update (in place for a DynamicCache:
hi_na_moe.fastpath.kv_cache), one native call for the attention with kv_b_proj absorbed
(hina::mla_decode: the query goes into the latent space once, the scores and the weighted sum
run over the cached latent rows, the result comes out through kv_b_proj's value rows; float32
math, one rounding; a bfloat16 cache on CPUs with AVX512-BF16 read with bf16 dot products, the
latent query and the probabilities rounded to bfloat16 for them: moe.h's mla_bf16_dots), and the
module's own o_proj. (A decoder layer whose parts are all on native runners runs all of this in
its two native calls instead, and the decoder stack every layer's in one: hi_na_moe.fastpath.layers,
hi_na_moe.fastpath.stack.) kv_b_proj's weight is read where the module keeps it; when scope="all" packed it
alone as int8 / int4, at the AVX2 and AVX-512 tiers, as that layer's own codes and scales
(QuantWeight: a half / about a quarter of a bfloat16 copy's bytes, the packed values exactly;
sizes as mla_quant_fits takes them); otherwise what its packed forward computes is made dense
once, kv_b_proj(I)^T in the model's dtype (H (Dn + Dv) L values). The report's latent attention
line gives the bytes of these copies. Prefill calls of bfloat16 models (several new tokens; no
mask, or a bool one) where hi_na_moe.fastpath.attention's prefill kernel runs (AVX512-BF16 on AMD CPUs:
attention.prefill_kernel) make every head's keys and values once, as the module does, and run the
attention on that kernel, the values padded with zeros to the keys' width: DeepSeek-V2-Lite's shape
(keys of 192, values of 128, where PyTorch's SDPA is slow here) prefilled 512 tokens 1.26x and 2048
2.45x faster than with the modules' own forward (bench_prefill_attention.py --ckpt, 2026-12-02). A
second probe (a prompt; a chunk after cached positions with a left-padded row) checks them as
NativeAttention's does; other prefill calls are the module's own forward.

Which modules: a class named *Attention of one of the transformers families in FAMILIES, whose
forward was read to be the form above (others build on it with more: DeepSeek-V3.2's and GLM-5's
top-k indexers, which a probe at a few positions cannot tell apart), with exactly the children
of _PARTS, the integer sizes,
a float scaling, kv_b_proj without a bias, and the attention implementation "sdpa" or "eager".
What it computes is checked before it is patched: on a probe (random hidden states and rotary
angles, a DynamicCache holding a few positions) its own forward and the decode path run side by
side with each rotary form: DeepSeek-V2's complex multiplication (position_embeddings a complex
tensor), V3's interleaved pairs (rope_interleave) and rotate_half. A form is taken when the latent
and rope key it appends to the cache are the module's bit for bit and its output is within the
dtype's rounding of the module's (hi_na_moe.fastpath.attention's tolerance).

Mistral 4 (QUERY_SCALE) multiplies the query by a factor of the position after the rotary
embedding (Llama 4's attention temperature: 1 below the original context length, growing past
it). Its decode calls take the factor from their position_ids through the modeling file's own
function and multiply as the module does, and its probe puts a row past the original context;
its prefill calls keep their own forward. Its decoder layers pass the factor into their native
calls (LayerPreArgs::mla.q_scale), and the stack computes it from the step's positions.
LongCat-Flash (LORA_SCALES) multiplies the query, before the rotary embedding, and the normed
latent by fixed factors (its module's mla_scale_q_lora and mla_scale_kv_lora); both paths
multiply as it does. Kimi-Linear's MLA layers (NO_ROPE) rotate nothing: the form "none", the
query's and key's rope parts as projected. MiniCPM3's module is V3's with rotate_half only.
Bailing-hybrid's (OUTPUT_GATE, Ling 3.0) multiplies each head's output by a sigmoid gate of the
hidden states (its g_proj) before o_proj; both paths do it in its ops.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ..core.formats import Format
from ..core.native import native_module
from . import attention, kv_cache
from .attention import _IMPLEMENTATIONS, _MAX_BATCH, _OUT_RTOL, DecodeCalls, _bool_of_additive, call_args
from .common import _DTYPE_CODES, _matches
from .linear import patched_member

# transformers families whose MLA module's forward is this module's form (read in 5.23)
FAMILIES = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "axk1", "mistral4", "longcat_flash",
                      "minicpm3", "kimi_linear", "bailing_hybrid"})
# ... and those of them whose query is then multiplied by a scale of the position (Mistral 4's
# Llama-4-style attention temperature: get_llama_4_attn_scale(position_ids, beta, original max
# positions) of its modeling file, 1 below the original context)
QUERY_SCALE = frozenset({"mistral4"})
# ... and those that scale the query (before the rotary embedding) and the normed latent by fixed
# factors, the module's float attributes mla_scale_q_lora and mla_scale_kv_lora (LongCat-Flash,
# whose module is named *MLA)
LORA_SCALES = frozenset({"longcat_flash"})
# ... and those with no rotary embedding at all (Kimi-Linear's NoPE MLA: the rope part of the
# query and key kept as projected, and no position_embeddings parameter): the form "none"
NO_ROPE = frozenset({"kimi_linear"})
# ... and those whose heads' outputs are multiplied by a sigmoid gate of the hidden states before
# o_proj: sigmoid(g_proj(h).float()).to(dtype), one value a head (Bailing-hybrid, Ling 3.0)
OUTPUT_GATE = frozenset({"bailing_hybrid"})
ROPES = ("complex", "interleaved", "rotate_half")  # (and "none": NO_ROPE)
# Whether the kernels read a quantised kv_b_proj (scope="all" with int8 / int4) as its codes and
# scales (QuantWeight) instead of a dense copy of what its packed forward computes; off only for
# A/B measurements (bench_decode_breakdown.py --ab-mla-weight)
QUANT_WEIGHT = True
_PARTS = frozenset({"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                    "kv_b_proj", "o_proj"})
_SIZES = ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim", "layer_idx")


def _family(m: nn.Module) -> str | None:
    """The transformers model family whose modeling file defines the module's class, else None."""
    parts = type(m).__module__.split(".")
    if len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3] == f"modeling_{parts[2]}":
        return parts[2]
    return None


def find_mla(model: nn.Module, exclude: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of the latent attention candidates (see the module docstring)."""
    found = []
    for name, m in model.named_modules():
        family = _family(m)
        if (family not in FAMILIES or _matches(name, exclude)
                or not type(m).__name__.endswith(("Attention", "MLA") if family in LORA_SCALES else "Attention")):
            continue
        if family in LORA_SCALES and not all(type(getattr(m, a, None)) is float
                                             for a in ("mla_scale_q_lora", "mla_scale_kv_lora")):
            continue
        children = {n for n, _ in m.named_children()}
        if family in OUTPUT_GATE:  # (its gate: a Linear of the hidden size to one value a head)
            g = getattr(m, "g_proj", None)
            if not isinstance(g, nn.Linear) or g.out_features != getattr(m, "num_heads", None):
                continue
            children -= {"g_proj"}
        if not children <= _PARTS or not {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"} <= children:
            continue
        if not all(type(getattr(m, a, None)) is int and getattr(m, a) >= 0 for a in _SIZES):
            continue
        lora = getattr(m, "q_lora_rank", None)
        q_parts = ("q_a_proj", "q_a_layernorm", "q_b_proj") if lora is not None else ("q_proj",)
        if not all(isinstance(getattr(m, p, None), nn.Module) for p in q_parts):
            continue
        linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + [p for p in q_parts if p.endswith("proj")]
        if not all(isinstance(getattr(m, p), nn.Linear) for p in linears) or m.kv_b_proj.bias is not None:
            continue
        if not isinstance(getattr(m, "scaling", None), float):
            continue
        if getattr(getattr(m, "config", None), "_attn_implementation", None) not in _IMPLEMENTATIONS:
            continue
        if _family(m) in QUERY_SCALE and _query_scale(m) is None:
            continue
        found.append((name, m))
    return found


def _query_scale(m: nn.Module):
    """(the modeling file's get_llama_4_attn_scale, beta, original max positions) of a
    QUERY_SCALE family's module as its forward reads them, or None."""
    fn = getattr(sys.modules.get(type(m).__module__), "get_llama_4_attn_scale", None)
    rope = getattr(getattr(m, "config", None), "rope_parameters", None)
    if not callable(fn) or not isinstance(rope, dict):
        return None
    beta, orig = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if type(beta) not in (int, float) or type(orig) is not int or orig <= 0:
        return None
    return fn, beta, orig


def math_kernel(isa: str) -> str:
    """What computes latent attention's decode steps at tier `isa` (for `check`)."""
    build = {"amx": "AVX-512", "avx512": "AVX-512", "avx2": "AVX2"}.get(isa, "baseline C++")
    return f"the native {build} kernel with kv_b_proj absorbed, at every context length"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class QuantWeight:
    """kv_b_proj's weight as its packed int8 / int4 layer holds it (PackedExperts.unpack_row_quant:
    int8 codes with a float32 scale a row, or int4 codes two to a byte with a float32 scale a
    group: the packed row factor times the group's step), its rows in the native kernel's blocks
    of four (moe.h's MlaDecodeArgs::wq: a block's rows interleaved by 64 values (int8) or half a
    group (int4), so that the kernel streams a block in one pass). A half (int8) or about a third
    (int4 in groups of 32) of a dense bfloat16 copy's bytes, and exactly the packed layer's
    values (scale * code), where a dense copy rounds them to the model's dtype."""

    def __init__(self, packed, weights: str, group: int):
        codes, scales = (torch.from_dlpack(a) for a in packed.unpack_row_quant())
        rows = codes.shape[0]
        self.format, self.group, self.rows = weights, group, rows
        chunk = 64 if weights == Format.INT8 else group // 2  # bytes of a row between its block's others
        self.codes = codes.view(rows // 4, 4, -1, chunk).transpose(1, 2).contiguous()
        self.scales = scales if weights == Format.INT8 else scales.view(rows // 4, 4, -1).transpose(1, 2).contiguous()
        # what the native calls take (native_weight)
        self.handle = (1 if weights == Format.INT8 else 2, self.codes.data_ptr(), self.scales.data_ptr(), group)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def float(self) -> torch.Tensor:
        """The values [rows, L] in float32 (for the PyTorch fallback)."""
        codes = self.codes.transpose(1, 2).reshape(self.rows, -1)  # the plain rows again
        if self.format == Format.INT8:
            return codes.view(torch.int8).float() * self.scales.float()[:, None]
        half = self.group // 2
        scales = self.scales.transpose(1, 2).reshape(self.rows, -1)
        lo = (codes & 15).to(torch.int8) - 8
        hi = (codes >> 4).to(torch.int8) - 8
        q = torch.stack((lo.view(self.rows, -1, half), hi.view(self.rows, -1, half)), 2).view(self.rows, -1, self.group)
        return (q.float() * scales.float()[:, :, None]).view(self.rows, -1)


def native_weight(w: "torch.Tensor | QuantWeight"):
    """kv_b_proj's weight (NativeMLA._weight) as the native calls take it: a dense weight's
    address, or a QuantWeight's (format, codes, scales, group)."""
    return w.handle if isinstance(w, QuantWeight) else w.data_ptr()


class NativeMLA:
    """One latent attention module whose decode calls run on the native absorbed kernel."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward, isa: str = "auto", threads: int = 0):
        self.name, self.module = name, module
        self.original = original_forward
        self.native = native_module()[0]
        self.isa, self.threads = isa, threads
        m = module
        self.H, self.Dn, self.Dr = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        self.L, self.Dv = m.kv_lora_rank, m.v_head_dim
        self.hidden = m.kv_a_proj_with_mqa.in_features
        self.dtype = m.o_proj.weight.dtype
        self.eager = getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"
        # the forward's positional parameters, in its order (DeepSeek-V2 takes the mask second)
        params = inspect.signature(original_forward).parameters.values()
        self.names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        self.rope: str | None = None  # one of ROPES once the probe matched
        self._w, self._w_key = None, None
        self._wq = None  # (kv_b_proj's forward, its QuantWeight or None) (_quant_weight)
        self._fused = None  # the packed group of the q and kv_a projections, once looked up (False: none)
        # prefill calls on the native prefill kernel, once the second probe saw them match
        self.prefill = False
        self.calls = DecodeCalls()
        # a QUERY_SCALE family's (function, beta, original max positions): the query scaled by
        # the position's factor before the attention; its calls need their position_ids
        self.q_scale = _query_scale(m) if _family(m) in QUERY_SCALE else None
        # a LORA_SCALES family's: multiply the query and the normed latent by the module's factors
        self.lora_scales = _family(m) in LORA_SCALES
        self.no_rope = _family(m) in NO_ROPE
        self.output_gate = _family(m) in OUTPUT_GATE

    # -- kv_b_proj's weight -------------------------------------------------------------------
    def _weight(self) -> "torch.Tensor | QuantWeight":
        """kv_b_proj's weight [H (Dn + Dv), L] as the module computes with it: its own parameter
        while its forward is its own (read at every call, not copied); when scope="all" packed it
        alone as int8 / int4, the packed layer's codes and scales (QuantWeight, made once and kept
        while that forward stays); else what its patched forward computes, made dense once as
        kv_b_proj(I)^T and kept likewise. native_weight(w) is what the kernels take."""
        p = self.module.kv_b_proj
        fwd = p.__dict__.get("forward")
        rows = self.H * (self.Dn + self.Dv)
        if fwd is not None and QUANT_WEIGHT:
            wq = self._quant_weight(p, fwd, rows)
            if wq is not None:
                return wq
        if fwd is None:
            w = p.weight
            if (type(w) in (torch.Tensor, nn.Parameter) and w.dtype is self.dtype and w.shape == (rows, self.L)
                    and w.is_contiguous() and w.is_cpu and not w.is_neg()):
                return w.detach()
            key = (None, id(w), w.data_ptr(), w._version)
        else:
            key = (id(fwd),)
        if key != self._w_key:
            with torch.no_grad():
                w = p(torch.eye(self.L, dtype=self.dtype))
            if w.shape != (self.L, rows):
                raise RuntimeError(f"{self.name}.kv_b_proj gave {tuple(w.shape)} for the identity, not {(self.L, rows)}")
            self._w, self._w_key = w.t().contiguous(), key
        return self._w

    def _quant_weight(self, p: nn.Linear, fwd, rows: int) -> "QuantWeight | None":
        """kv_b_proj's packed int8 / int4 values as the kernels read them, when scope="all"
        packed it alone (not fused with another linear) in one of those formats, the kernel takes
        its sizes (mla_quant_fits: Dn and Dv multiples of 4, int8 with L a multiple of 64, int4
        groups dividing L) and runs at a vector tier; else None."""
        if self._wq is not None and self._wq[0] is fwd:  # decided for this forward (a decode step's path)
            return self._wq[1]
        self._wq = (fwd, None)
        # the baseline build (no AVX2: the generic tier, other architectures) reads codes 2.5x
        # slower than a dense bf16 copy (bench_mla_weight.py --isa generic, 2026-12-02): it keeps
        # the copy
        if self.native.resolve_isa(self.isa) not in ("avx2", "avx512", "amx"):
            return None
        member = patched_member(p)
        runner = None if member is None else member[0]
        if runner is None or runner.weights not in (Format.INT8, Format.INT4) or len(runner.modules) != 1:
            return None
        packed = runner.packed
        group = packed.layout["group_size"] if runner.weights == Format.INT4 else 0
        if ((packed.out_features, packed.H) != (rows, self.L)
                or not self.native.mla_quant_fits(runner.weights, group, self.L, self.Dn, self.Dv)):
            return None
        self._wq = (fwd, QuantWeight(packed, runner.weights, group))
        return self._wq[1]

    def reads_codes(self) -> bool:
        """Whether the kernels read kv_b_proj's weight as a quantised layer's codes and scales."""
        return isinstance(self._weight(), QuantWeight)

    def extra_bytes(self) -> int:
        """Bytes of the copy of kv_b_proj's weight this runner holds for the kernels (its codes
        and scales, or a dense copy; 0 when it reads the module's own)."""
        if self.module.kv_b_proj.__dict__.get("forward") is None:
            return 0
        return sum(w.nbytes for w in (self._w, None if self._wq is None else self._wq[1]) if w is not None)

    # -- the decode path ----------------------------------------------------------------------
    def _rotate(self, q: torch.Tensor, k: torch.Tensor, pe) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, T, Dr] and k [B, 1, T, Dr] through the rotary form, in the ops the module uses."""
        if self.rope == "none":
            return q, k
        if self.rope == "complex":
            f = pe.unsqueeze(1)
            xq = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
            xk = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
            return torch.view_as_real(xq * f).flatten(3).type_as(q), torch.view_as_real(xk * f).flatten(3).type_as(k)
        cos, sin = pe
        if self.rope == "interleaved":
            cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
            sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
            q1, q2, k1, k2 = q[..., 0::2], q[..., 1::2], k[..., 0::2], k[..., 1::2]
            return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                    torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @staticmethod
    def native_tables(pe) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The position embeddings pe as the native calls' rope_latent reads them (hi_na_moe.fastpath.layers,
        hi_na_moe.fastpath.stack): the complex form's float32 (re, im) pairs (both tables the same), else
        the (cos, sin) rows; contiguous. None for a conjugated complex view."""
        if type(pe) is torch.Tensor:
            if pe.is_conj():
                return None
            tab = torch.view_as_real(pe).contiguous()
            return tab, tab
        return pe[0].contiguous(), pe[1].contiguous()

    def _queries_and_cache(self, m: nn.Module, h: torch.Tensor, pe, cache, qs: torch.Tensor | None = None) -> tuple:
        """(q_nope [B, H, T, Dn], rotated q_rope [B, H, T, Dr], the cache's latents [B, 1, S, L]
        and rope keys [B, 1, S, Dr]) of h [B, T, hidden], as the module makes them: its
        projections and kv_a_layernorm, its rotary form, the new positions appended (in place for
        one position, kv_cache.append), and with qs (a QUERY_SCALE family's [B or 1, 1, T, 1] in
        the dtype) the query times qs, each value rounded as the module's product rounds it."""
        B, T = h.shape[:2]
        H, Dn, Dr, L = self.H, self.Dn, self.Dr, self.L
        q, ckv = self._projections(m, h)
        q_nope, q_pe = torch.split(q.view(B, T, H, Dn + Dr).transpose(1, 2), [Dn, Dr], dim=-1)
        latent, k_pe = torch.split(ckv, [L, Dr], dim=-1)
        latent = m.kv_a_layernorm(latent)
        if self.lora_scales:  # (read at every call, as the module reads them)
            q_nope, q_pe = q_nope * m.mla_scale_q_lora, q_pe * m.mla_scale_q_lora
            latent = latent * m.mla_scale_kv_lora
        latent = latent.view(B, 1, T, L)
        q_pe, k_pe = self._rotate(q_pe, k_pe.view(B, 1, T, Dr), pe)
        if cache is not None:
            latent, k_pe = kv_cache.append(cache, m.layer_idx, latent, k_pe)
        if qs is not None:
            q_nope, q_pe = q_nope * qs, q_pe * qs
        return q_nope, q_pe, latent, k_pe

    def _decode(self, m: nn.Module, h: torch.Tensor, pe, cache, mask: torch.Tensor | None = None,
                qs: torch.Tensor | None = None):
        """(output, None) of a decode step (h [B, 1, hidden]; qs: _queries_and_cache's)."""
        B, H, Dn, Dr, L, Dv = h.shape[0], self.H, self.Dn, self.Dr, self.L, self.Dv
        q_nope, q_pe, latent, k_pe = self._queries_and_cache(m, h, pe, cache, qs)
        w = self._weight()
        out = torch.empty(B, 1, H * Dv, dtype=self.dtype)
        if self._kernel_fits(q_nope, q_pe, latent, k_pe, mask, B):
            ps = mask is not None and mask.shape[0] > 1
            self.native.mla_decode_raw(
                _DTYPE_CODES[self.dtype], q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(),
                q_pe.stride(0), q_pe.stride(1), native_weight(w), latent.data_ptr(), latent.stride(0), latent.stride(2),
                k_pe.data_ptr(), k_pe.stride(0), k_pe.stride(2), out.data_ptr(), B, H, latent.shape[2], Dn, Dr, L, Dv,
                m.scaling, 0 if mask is None else mask.data_ptr(), mask.stride(0) if ps else 0,
                self.threads or torch.get_num_threads(), self.isa)
        else:
            self._absorbed_torch(q_nope, q_pe, w, latent, k_pe, mask, m.scaling, out)
        return m.o_proj(self._gated(m, h, out)), None

    def _projections(self, m: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, the compressed key-value projection) of h as the module makes them; in one kernel
        call when scope="all" packed q_proj (or q_a_proj) and kv_a_proj_with_mqa as one group
        (linear.FUSE_GROUPS: the same outputs as their member calls)."""
        lora = getattr(m, "q_lora_rank", None) is not None
        first = m.q_a_proj if lora else m.q_proj
        if self._fused is None:
            a, b = patched_member(first), patched_member(m.kv_a_proj_with_mqa)
            self._fused = (a[0] if a is not None and b is not None and a[0] is b[0] and (a[1], b[1]) == (0, 1)
                           and len(a[0].modules) == 2 else False)
        if self._fused:
            q, ckv = self._fused.split(self._fused.forward(first, h))
        else:
            q, ckv = first(h), m.kv_a_proj_with_mqa(h)
        return (m.q_b_proj(m.q_a_layernorm(q)) if lora else q), ckv

    def _prefill(self, m: nn.Module, h: torch.Tensor, pe, cache, mask: torch.Tensor | None = None):
        """(output, None) of a call with T > 1 new tokens a row (bfloat16): the module's
        projections, norm, rotary ops and cache update as the decode path makes them, every
        head's keys and values made from the cached latents as the module makes them (kv_b_proj,
        the rope key repeated over the heads), and the attention on the native prefill kernel,
        whose keys and values share one width: the values are padded with zeros from Dv to
        Dn + Dr, which adds nothing to the sums, and the output's extra columns dropped."""
        B, T = h.shape[:2]
        H, Dn, Dr, Dv = self.H, self.Dn, self.Dr, self.Dv
        Dk = Dn + Dr
        q_nope, q_pe, latent, k_pe = self._queries_and_cache(m, h, pe, cache)
        S = latent.shape[2]
        kv = m.kv_b_proj(latent).view(B, S, H, Dn + Dv).transpose(1, 2)
        keys = torch.empty(B, H, S, Dk, dtype=self.dtype)
        keys[..., :Dn] = kv[..., :Dn]
        keys[..., Dn:] = k_pe
        values = torch.zeros(B, H, S, Dk, dtype=self.dtype)
        values[..., :Dv] = kv[..., Dn:]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [B, H, T, Dk]
        out = torch.empty(B, T, H, Dk, dtype=self.dtype)
        qs, ks = query.stride(), keys.stride()
        threads = self.threads or torch.get_num_threads()
        done = (mask is None or mask.shape[-1] == S) and (mask is not None or S >= T) and self.native.attention_prefill_raw(
            query.data_ptr(), qs[0], qs[2], qs[1], B, T, H, H, S, Dk, keys.data_ptr(), ks[0], ks[1], ks[2],
            values.data_ptr(), ks[0], ks[1], ks[2], m.scaling, out.data_ptr(), threads, self.isa,
            0 if mask is None else mask.data_ptr(), 0 if mask is None or mask.shape[0] == 1 else mask.stride(0),
            0 if mask is None else mask.stride(2), 0)
        if not done:  # what transformers' SDPA call computes (no mask: causal from the first key)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None,
                                               scale=m.scaling)
            out.copy_(o.transpose(1, 2))
        return m.o_proj(self._gated(m, h, out[..., :Dv].reshape(B, T, H * Dv))), None

    def _gated(self, m: nn.Module, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs out [B, T, H Dv] times an OUTPUT_GATE family's gate, in the module's
        ops (sigmoid of g_proj in float32, rounded to the dtype, then the product, one value a
        head); out itself for the others."""
        if not self.output_gate:
            return out
        B, T = out.shape[:2]
        gate = torch.sigmoid(m.g_proj(h).float()).to(h.dtype)
        return (out.view(B, T, self.H, self.Dv) * gate.unsqueeze(-1)).reshape(B, T, self.H * self.Dv)

    def _kernel_fits(self, q_nope, q_pe, latent, k_pe, mask, B: int) -> bool:
        """Whether the kernel reads these tensors (what a cache hands back is checked: another
        cache class may hold something else)."""
        S = latent.shape[2] if type(latent) is torch.Tensor and latent.dim() == 4 else -1
        return (S >= 1 and type(k_pe) is torch.Tensor and latent.dtype is self.dtype and k_pe.dtype is self.dtype
                and latent.shape == (B, 1, S, self.L) and k_pe.shape == (B, 1, S, self.Dr)
                and latent.stride(3) == 1 and k_pe.stride(3) == 1 and latent.is_cpu and k_pe.is_cpu
                and not latent.is_neg() and not k_pe.is_neg() and q_nope.stride(3) == 1 and q_pe.stride(3) == 1
                and q_pe.dtype is self.dtype and (mask is None or mask.shape[-1] == S))

    def _absorbed_torch(self, q_nope, q_pe, w, latent, k_pe, mask, scale: float, out: torch.Tensor) -> None:
        """The kernel's computation in PyTorch ops (float32), into out [B, 1, H Dv]: a fallback
        for caches that hand back tensors the kernel does not read."""
        B, H, Dn, Dv = q_nope.shape[0], self.H, self.Dn, self.Dv
        wf = w.float().view(H, Dn + Dv, self.L)
        ql = torch.einsum("bhd,hdl->bhl", q_nope[:, :, 0].float(), wf[:, :Dn])
        c = latent[:, 0].float()
        scores = (torch.einsum("bhl,bsl->bhs", ql, c)
                  + torch.einsum("bhd,bsd->bhs", q_pe[:, :, 0].float(), k_pe[:, 0].float())) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        p = torch.nan_to_num(scores.softmax(-1))  # a row attending nothing: zeros
        o = torch.einsum("bhl,hel->bhe", torch.einsum("bhs,bsl->bhl", p, c), wf[:, Dn:])
        out.copy_(o.reshape(B, 1, H * Dv))

    def forward(self, module: nn.Module, *args, **kwargs):
        fast = self._fast_args(module, args, kwargs, prefill=True)
        if fast is None:
            self.calls.own(args, kwargs)
            return self.original(*args, **kwargs)
        if fast[0].shape[1] > 1:
            return self._prefill(module, *fast)
        self.calls.native += 1
        return self._decode(module, *fast)

    def _fast_args(self, module: nn.Module, args: tuple, kwargs: dict, prefill: bool = False):
        """(hidden, position embeddings, cache, mask) when this call is a plain decode step the
        probe's rotary form takes, or with `prefill` a prefill call the native prefill kernel
        takes (self.prefill), else None."""

        def takes(h: torch.Tensor) -> bool:
            B, T = h.shape[:2]
            return (h.shape[2] == self.hidden and h.dtype is self.dtype and T >= 1
                    and (B <= _MAX_BATCH if T == 1 else prefill and self.prefill and attention.PREFILL))

        got = call_args(module, args, kwargs, self.eager, takes, self.names)
        if got is None:
            return None
        h, pe, mask, cache = got
        B, T = h.shape[:2]
        if self.q_scale is not None:  # the query's scale from the call's positions, as the module makes it
            if prefill and T > 1:
                return None  # (prefill: the module's own forward)
            i = self.names.index("position_ids") if "position_ids" in self.names else len(args)
            pos = args[i] if i < len(args) else kwargs.get("position_ids")
            if type(pos) is not torch.Tensor or pos.dim() != 2 or pos.shape[1] != T or pos.shape[0] not in (1, B):
                return None
            fn, beta, orig = self.q_scale
            qs = fn(pos, beta, orig)
            if type(qs) is not torch.Tensor or qs.shape != (pos.shape[0], 1, T, 1):
                return None
            qs = qs.to(self.dtype)
        half = self.Dr // 2
        if self.rope == "none":  # (no position embeddings: the module takes none)
            if pe is not None:
                return None
            tables, width = (), 0
        elif self.rope == "complex":
            tables, width = (pe,), half
            if type(pe) is not torch.Tensor or pe.dtype is not torch.complex64:
                return None
        else:
            if not isinstance(pe, tuple) or len(pe) != 2 or any(type(t) is not torch.Tensor for t in pe):
                return None
            tables, width = pe, self.Dr
            if any(t.dtype is not self.dtype for t in pe):
                return None
        for t in tables:  # a table a row and position, or one for every row
            if t.numel() not in (B * T * width, T * width) or t.shape[-1] != width or not t.is_cpu:
                return None
        return (h, pe, cache, mask) if self.q_scale is None else (h, pe, cache, mask, qs)

    # -- the probe ----------------------------------------------------------------------------
    def _tables(self, form: str, ang: torch.Tensor):
        """The position embeddings of angles ang [B, 1, Dr / 2] as the form's rotary module hands
        them over."""
        if form == "none":
            return None
        if form == "complex":
            return torch.polar(torch.ones_like(ang), ang)
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def matches(self) -> bool:
        """Whether one rotary form computes what the module's own forward does (module docstring);
        under eager also with an additive float mask."""
        if self.native is None or not hasattr(self.native, "mla_decode_raw"):
            return False
        m = self.module
        gen = torch.Generator().manual_seed(7)
        B, past = 2, 5
        h = torch.randn(B, 1, self.hidden, generator=gen).to(self.dtype)
        ang = torch.rand(B, 1, self.Dr // 2, generator=gen) * 6.3
        c0 = torch.randn(B, 1, past, self.L, generator=gen).to(self.dtype)
        k0 = torch.randn(B, 1, past, self.Dr, generator=gen).to(self.dtype)
        fmask = torch.zeros(B, 1, 1, past + 1, dtype=self.dtype)
        fmask[1, :, :, [0, 2]] = torch.finfo(self.dtype).min
        bmask = fmask == 0
        cases = [None, fmask if self.eager else bmask]

        def cache():
            c = DynamicCache()
            c.update(c0.clone(), k0.clone(), m.layer_idx)
            return c

        # a QUERY_SCALE family: one row past the original context (a scale other than 1)
        extra, qs = {}, None
        if self.q_scale is not None:
            fn, beta, orig = self.q_scale
            pos = torch.tensor([[3 * orig + 2], [past]])
            extra = {"position_ids": pos}
            qs = fn(pos, beta, orig).to(self.dtype)

        original = self._original_for_probe()
        with torch.no_grad():
            for form in ("none",) if self.no_rope else ROPES:
                self.rope = form
                pe = self._tables(form, ang)
                ok = True
                for mk in cases:
                    own, ours = cache(), cache()
                    try:
                        want = original(hidden_states=h, position_embeddings=pe, attention_mask=mk,
                                        past_key_values=own, **extra)
                    except Exception:
                        ok = False
                        break
                    if (not isinstance(want, tuple) or len(want) != 2 or not isinstance(want[0], torch.Tensor)
                            or want[0].shape != h.shape):
                        ok = False
                        break
                    try:
                        got, _ = self._decode(m, h, pe, ours, None if mk is None else _bool_of_additive(mk)
                                              if self.eager else mk, qs)
                    except Exception:
                        ok = False
                        break
                    a, b = own.layers[m.layer_idx], ours.layers[m.layer_idx]
                    tol = _OUT_RTOL[self.dtype] * want[0].float().abs().amax()
                    if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                            and bool(((got.float() - want[0].float()).abs() <= tol).all())):
                        ok = False
                        break
                if ok:
                    self.prefill = (self.dtype is torch.bfloat16 and self.q_scale is None
                                    and attention.prefill_kernel(self.isa, self.Dn + self.Dr, self.H, self.H)
                                    and self._prefill_matches(gen))
                    return True
        self.rope = None
        return False

    def _prefill_matches(self, gen: torch.Generator) -> bool:
        """Whether the prefill path computes what the module's own forward does
        (attention.prefill_probe, on a latent cache)."""
        B, past, T = 2, 5, 7
        h = torch.randn(B, T, self.hidden, generator=gen).to(self.dtype)
        pe = self._tables(self.rope, torch.rand(B, T, self.Dr // 2, generator=gen) * 6.3)
        c0 = torch.randn(B, 1, past, self.L, generator=gen).to(self.dtype)
        k0 = torch.randn(B, 1, past, self.Dr, generator=gen).to(self.dtype)
        return attention.prefill_probe(self.module, self._original_for_probe(),
                                       lambda c, mk: self._prefill(self.module, h, pe, c, mk), h, pe, (c0, k0),
                                       self.eager, self.eager)

    def _original_for_probe(self):
        """The module's own forward as the probes call it (keywords, position_embeddings among
        them), without position_embeddings for a NO_ROPE family (its forward has no such
        parameter)."""
        if not self.no_rope:
            return self.original
        return lambda **kw: self.original(**{k: v for k, v in kw.items() if k != "position_embeddings"})

    def restore(self) -> None:  # nothing of the module was touched but its forward
        pass
