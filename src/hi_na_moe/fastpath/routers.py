"""scope="all": the MoE routers' logits on the native kernel, for decode-sized inputs.

A router (transformers 5.x: the *TopKRouter modules) is one small linear layer, the hidden state
to a logit per expert, followed by a few small ops (softmax, top-k, renormalisation). On a
decode step PyTorch's bf16 GEMV for that [experts, hidden] weight is most of the router's time:
OLMoE-1B-7B's 64 x 2048 router took 140 us a call in a decode step (torch.profiler), 2.2 ms of
a 43 ms step, for 256 KiB of weights (benchmarks/log/decode-step.md, 2026-11-30).

Only the linear changes hands. Everything after it must stay what the model computes, the
order of ties in top-k included, so a router is patched only when one of the known forms
below, run with F.linear for its logits, reproduces the module's own forward bit for bit on a
probe. Then that form runs with the logits of hi_na_moe's lossless kernel. The forms, as
transformers 5.x writes them:

- softmax-topk: softmax in float32 over the logits, the top k, optionally renormalised to
  sum 1 and optionally cast back to the logits' dtype (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral,
  MiniMax, Jamba, FlexOlmo);
- topk-softmax: the top k logits (optionally in float32 first), a softmax over those k,
  optionally cast to the input's dtype (GPT-OSS, with the router's bias; Granite-MoE; Aria);
- softmax-biased-topk (ERNIE 4.5): a router kept in float32 whose input is cast to float32 first,
  softmax over the logits, the experts chosen by the top k of the probabilities plus a score
  correction bias (the router's `*e_score_correction_bias`, one value per expert), their
  probabilities as weights divided by max(their sum, the router's norm_min), cast to the input's
  dtype;
- sigmoid-group-topk (DeepSeek-V3, GLM-4.5, dots.llm1, Solar Open): float32 logits of the input
  and weight cast to float32, sigmoid scores plus the score-correction bias scored per expert
  group (the sum of each group's two best), the experts chosen among the topk_group best groups,
  both top-ks unsorted as torch.topk(sorted=False) leaves them; the chosen scores as weights,
  optionally over (their sum + 1e-20), times routed_scaling_factor, in float32. The packed copy of
  such a router is float32 (the module's logits are float32 products of its cast weight).

Two forms can be the same function up to float32 rounding (a softmax over the top k, and a
softmax over all renormalised over the top k); when both reproduce a probe the first in the list
is used, and the two differ at most in the last bit of the scores.

- softmax-group-topk (DeepSeek-V2, DeepSeek-OCR 2's decoder): float32 logits as above, a softmax,
  the top k unsorted (greedy), or within the topk_group groups of largest maximum, the others'
  probabilities counted as 0 (group_limited_greedy), times routed_scaling_factor, in float32;
- softmax-group-topk in the logits' dtype (Mistral 4): the softmax in the logits' dtype (no
  float32), each expert group scored by the sum of its two largest probabilities, the top k among
  the topk_group best groups (both unsorted), the chosen probabilities as weights, optionally over
  (their sum + 1e-20), times routed_scaling_factor, every op in that dtype (router_select rounds
  each step to it);
- sigmoid-topk, bias argument (MiniMax-M2, Hunyuan-V3): the router's forward takes the correction
  bias as its second argument (the MoE block's `e_score_correction_bias` buffer); sigmoid scores
  of the logits (in the weight's dtype, or float32), the top k of scores plus the bias (unsorted),
  the chosen scores over their sum (plus 1e-20 or not: MiniMax-M2's gives NaN weights where every
  chosen score is zero, and the probe tells them apart by that), optionally times
  router_scaling_factor. Probed with a random bias; a bias of bfloat16 or float16 is read through
  a float32 copy, made again when the tensor changes.

Other routers match none of the forms and stay PyTorch's; the report names them.

The native logits are the same dot products accumulated in float32 in another order, then
rounded once: they can differ from F.linear's in the last bit (the probe checks they are within
that), and an expert whose probability ties with the k-th can then be chosen differently. That
is the same kind of difference every other scope="all" layer makes, and the reason routers are
patched under scope="all" only.

The form after the logits runs natively too (router_select, csrc/moe/router.cpp), for the
decode rows this module handles, when it reproduces the form on a probe: the same experts in
the same order, ties included (its top-k moves equal values as torch.topk's CPU kernel does,
which is not by index), and weights within a few float32 ulps of PyTorch's softmax (std::exp
against PyTorch's vectorised exp; PyTorch's own AVX2 and AVX-512 builds differ from each other
as much). NATIVE_SELECT = False keeps PyTorch's ops for it.
"""

from __future__ import annotations

import inspect
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.native import native_module
from ..core.ops import NATIVE_DTYPES
from .common import DECODE_MAX_ROWS, _matches

# more rows (a longer prefill): the module's own forward, whose GEMM is efficient; the decode
# paths' limit (common.DECODE_MAX_ROWS), so that a layer's own forward routes as its short path does
ROUTER_MAX_ROWS = DECODE_MAX_ROWS
NATIVE_SELECT = True  # the softmax and top-k after the logits on router_select (module docstring)
# the native logits may differ from F.linear's by this much (relative to the logits' scale):
# the dtype's rounding of a float32 sum taken in another order
_LOGIT_RTOL = {torch.float32: 2.0**-16, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

# a form: (linear, h, the score-correction bias or None) -> (logits, weights, indices)
Form = Callable[..., tuple]
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the weights of router_select may differ from the form's by this much (relative): float32
# softmaxes with another exp (a few ulps), or one step of the dtype they are cast to
_SELECT_RTOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _softmax_topk(k: int, renorm: bool, cast: bool) -> Form:
    def run(linear, h, bias=None):
        logits = linear(h)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, k, dim=-1)
        if renorm:
            top /= top.sum(dim=-1, keepdim=True)
        if cast:
            top = top.to(logits.dtype)
        return logits, top, idx

    # router_select's form, k, renorm, the weights' dtype (None: the input's) for logits of dtype
    # dt, whether the form returns its logits in float32, and the grouped form's settings
    run.native = lambda dt: (0, k, renorm, dt if cast else torch.float32, False, _NO_GROUPS)  # type: ignore[attr-defined]
    return run


def _topk_softmax(k: int, float_first: bool, cast: bool) -> Form:
    def run(linear, h, bias=None):
        logits = linear(h)
        if float_first:
            logits = logits.float()
        top, idx = torch.topk(logits, k, dim=-1)
        scores = F.softmax(top, dim=-1)
        if cast:
            scores = scores.type_as(h)
        return logits, scores, idx

    # (the native path's h has the logits' dtype)
    run.native = lambda dt: (1, k, False, dt if cast or not float_first else torch.float32,  # type: ignore[attr-defined]
                             float_first, _NO_GROUPS)
    return run


_CORRECTION = "e_score_correction_bias"
BIAS_BUFFER = _CORRECTION  # the MoE block's buffer a bias-argument router is called with
# router_select's groups, topk_group, scale and renormalising epsilon for the ungrouped forms
_NO_GROUPS = (1, 1, 1.0, 1e-20)


def _correction_path(module: nn.Module) -> tuple[str, ...] | None:
    """The path (submodule names, then the tensor's) of the router's score-correction bias, or
    None when it has none."""
    for name, _ in (*module.named_parameters(), *module.named_buffers()):
        if name.split(".")[-1] == _CORRECTION:
            return tuple(name.split("."))
    return None


def _correction(module: nn.Module, path: tuple[str, ...]):
    """The router's score-correction tensor at `path` (through the modules' dicts: this runs at
    every decode step), or None when it is gone."""
    m = module
    for part in path[:-1]:
        m = m._modules.get(part)
        if m is None:
            return None
    t = m._parameters.get(path[-1])
    return m._buffers.get(path[-1]) if t is None else t


def _softmax_biased_topk(k: int, module: nn.Module, path: tuple[str, ...]) -> Form:
    def run(linear, h, bias=None):
        logits = linear(h.float())
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        b = _correction(module, path) if bias is None else bias
        _, idx = torch.topk(probs + b.squeeze(), k, dim=-1)
        w = torch.gather(probs, dim=-1, index=idx)
        w = w / torch.clamp(w.sum(dim=-1, keepdim=True), min=module.norm_min)
        return logits, w.to(h.dtype), idx

    run.native = lambda dt: (0, k, True, None, False, _NO_GROUPS)  # type: ignore[attr-defined]  (weights: the input's dtype)
    run.biased = True  # type: ignore[attr-defined]
    return run


def _sigmoid_group_topk(k: int, module: nn.Module, path: tuple[str, ...]) -> Form:
    def run(linear, h, bias=None):
        logits = linear(h.float())
        scores = logits.sigmoid()
        choice = scores + (_correction(module, path) if bias is None else bias)
        G, E = module.num_group, logits.shape[-1]
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=module.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        idx = torch.topk(choice.masked_fill(~keep, float("-inf")), k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if module.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * module.routed_scaling_factor, idx

    run.native = lambda dt: (2, k, bool(module.norm_topk_prob), torch.float32, False,  # type: ignore[attr-defined]
                             (module.num_group, module.topk_group, float(module.routed_scaling_factor), 1e-20))
    run.biased = True  # type: ignore[attr-defined]
    run.float_logits = True  # type: ignore[attr-defined]  (float32 logits of a router of any dtype)
    return run


def _sigmoid_topk_arg(k: int, module: nn.Module, float_logits: bool, eps: float, scale: str | None) -> Form:
    """MiniMax-M2's and Hunyuan-V3's routers: the score-correction bias is their forward's second
    argument (the MoE block holds it)."""
    def run(linear, h, bias=None):
        logits = linear(h.float()) if float_logits else linear(h)
        scores = logits.float().sigmoid()
        idx = torch.topk(scores + bias, k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + eps) if eps else w / w.sum(dim=-1, keepdim=True)
        if scale is not None:
            w = w * getattr(module, scale)
        return logits, w, idx

    run.native = lambda dt: (2, k, True, torch.float32, False,  # type: ignore[attr-defined]
                             (1, 1, 1.0 if scale is None else float(getattr(module, scale)), eps))
    run.biased = True  # type: ignore[attr-defined]
    run.float_logits = float_logits  # type: ignore[attr-defined]
    return run


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, NaNs in the same places counting as equal (a renormalisation over a sum of
    zero scores gives NaN weights, which a form must reproduce)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def _takes_bias_argument(forward) -> bool:
    """Whether a router's (bound) forward takes the score-correction bias as a second positional
    argument (`forward(hidden_states, e_score_correction_bias)`)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return (len(params) == 2 and params[1].name.endswith("bias")
            and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params))


def _softmax_group_topk(k: int, module: nn.Module) -> Form:
    """DeepSeek-V2's router: softmax over float32 logits, greedy or group-limited top k (the
    groups by their largest probability, the others' probabilities counted as 0), times
    routed_scaling_factor."""
    def run(linear, h, bias=None):
        logits = linear(h.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if module.topk_method == "group_limited_greedy":
            G, E = module.num_group, logits.shape[-1]
            group_scores = scores.view(-1, G, E // G).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=module.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
            scores = scores.masked_fill(~keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E), 0.0)
        w, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
        return logits, w * module.routed_scaling_factor, idx

    def native(dt):
        grouped = module.topk_method == "group_limited_greedy"
        return (3, k, False, torch.float32, False, (module.num_group if grouped else 1,
                                                    module.topk_group if grouped else 1,
                                                    float(module.routed_scaling_factor), 0.0))

    run.native = native  # type: ignore[attr-defined]
    run.float_logits = True  # type: ignore[attr-defined]
    return run


def _softmax_group_topk_in_dtype(k: int, module: nn.Module) -> Form:
    """Mistral 4's router: the softmax in the logits' dtype, the expert groups scored by the sum of
    their two largest probabilities, the experts chosen among the topk_group best groups (both
    top-ks unsorted), the chosen probabilities as weights, optionally over (their sum + 1e-20), times
    routed_scaling_factor: every op in the logits' dtype, as the module's."""
    def run(linear, h, bias=None):
        logits = linear(h)
        scores = logits.softmax(-1)
        G, E = module.num_group, logits.shape[-1]
        group_scores = scores.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=module.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        idx = torch.topk(scores.masked_fill(~keep, 0.0), k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if module.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * module.routed_scaling_factor, idx

    run.native = lambda dt: (4, k, bool(module.norm_topk_prob), None, False,  # type: ignore[attr-defined]
                             (module.num_group, module.topk_group, float(module.routed_scaling_factor), 1e-20))
    return run


def _grouped(module: nn.Module) -> bool:
    """Whether the module has the grouped sigmoid form's settings (DeepSeek-V3's names)."""
    d = module.__dict__
    return (type(d.get("num_group")) is int and type(d.get("topk_group")) is int
            and type(d.get("norm_topk_prob")) is bool and type(d.get("routed_scaling_factor")) in (int, float))


def _forms(k: int, module: nn.Module | None = None, bias_arg: bool = False) -> list[tuple[str, Form]]:
    """Every variant of the known forms for top-k size k, with its name for the report (with the
    module: also those reading its score-correction bias and settings; with bias_arg: those taking
    the bias as the forward's argument)."""
    if bias_arg:
        d = module.__dict__
        scale = "router_scaling_factor" if type(d.get("router_scaling_factor")) in (int, float) else None
        return [(f"sigmoid-topk, bias argument{', float32 logits' if fl else ''}{', +1e-20' if eps else ''}"
                 f"{', scaled' if scale else ''}", _sigmoid_topk_arg(k, module, fl, eps, scale))
                for fl in (True, False) for eps in (1e-20, 0.0)]
    path = None if module is None else _correction_path(module)
    if path is not None:  # only forms that read it: a probe of a bias that is still zeros would pass the others
        out = []
        if type(module.__dict__.get("norm_min")) is float and module.weight.dtype is torch.float32:
            out.append(("softmax-biased-topk, float32 router", _softmax_biased_topk(k, module, path)))
        if _grouped(module):
            out.append(("sigmoid-group-topk, float32 logits", _sigmoid_group_topk(k, module, path)))
        return out
    out = []
    d = {} if module is None else module.__dict__
    if (d.get("topk_method") in ("greedy", "group_limited_greedy") and type(d.get("num_group")) is int
            and type(d.get("topk_group")) is int and type(d.get("routed_scaling_factor")) in (int, float)):
        out.append(("softmax-group-topk, float32 logits", _softmax_group_topk(k, module)))
    if module is not None and _grouped(module) and "topk_method" not in d:
        out.append(("softmax-group-topk in the logits' dtype", _softmax_group_topk_in_dtype(k, module)))
    for renorm in (True, False):
        for cast in (True, False):
            out.append((f"softmax-topk{', renormalised' if renorm else ''}{', cast' if cast else ''}",
                        _softmax_topk(k, renorm, cast)))
    for float_first in (False, True):
        for cast in (True, False):
            out.append((f"topk-softmax{', float32 logits' if float_first else ''}{', cast' if cast else ''}",
                        _topk_softmax(k, float_first, cast)))
    return out


def find_routers(model: nn.Module, exclude: str,
                 devices: tuple[str, ...] = ("cpu",)) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """Router candidates: ([(name, module)], [names of the routers that cannot be one]).

    A candidate is a module (not an nn.Linear, which scope="all" runs as a dense layer) whose
    class name contains "Router", with a 2-D float `weight` parameter (on `devices`), optionally a
    1-D `bias` of one value per output and a float32 score-correction bias of one value per
    expert (`*e_score_correction_bias`, a parameter or buffer, in it or a submodule: ERNIE 4.5,
    DeepSeek-V3), and no other parameter or buffer. What a candidate computes is still checked
    (NativeRouter.matches): DeepSeek-V3's groups and sigmoid scores match no form."""
    found, unfit = [], []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) or "Router" not in type(m).__name__ or _matches(name, exclude):
            continue
        params = dict(m.named_parameters(recurse=True))
        w, b = params.get("weight"), params.get("bias")
        if w is None or w.dim() != 2:
            continue  # not a router with its own logits weight (e.g. one holding an nn.Linear)
        extra = {n: t for n, t in (*params.items(), *m.named_buffers()) if n not in ("weight", "bias")}
        correction = all(n.split(".")[-1] == _CORRECTION and t.numel() == w.shape[0] and t.dtype is torch.float32
                         for n, t in extra.items()) and len(extra) <= 1
        if (not correction or w.device.type not in devices
                or w.dtype not in NATIVE_DTYPES or w.numel() == 0
                or (b is not None and (b.shape != (w.shape[0],) or b.dtype != w.dtype or b.device != w.device))):
            unfit.append(name)
            continue
        found.append((name, m))
    return found, unfit


def _settings(module: nn.Module) -> tuple:
    """The module's plain settings (top_k, norm_topk_prob, ...): a form is matched for these
    values, so a change after enable sends the calls back to the module's own forward."""
    return tuple((k, v) for k, v in sorted(vars(module).items())
                 if not k.startswith("_") and k != "training" and type(v) in (bool, int, float, str))




class NativeRouter:
    """One router module whose logits run on the native lossless kernel (decode-sized inputs)."""

    weights = "lossless"

    def __init__(self, name: str, module: nn.Module, original_forward, isa: str = "auto", threads: int = 0):
        self.name, self.module = name, module
        self.original = original_forward  # the module's own forward (bound)
        self.isa, self.threads = isa, threads
        w = module.weight
        # the module's weight dtype, and the packed copy's and its logits' (float32 for a form
        # computing them in float32 from a weight of another dtype: set by matches)
        self.wdtype = self.dtype = w.dtype
        self.experts, self.hidden = w.shape[0], w.shape[1]
        self.form: Form | None = None
        self.form_name: str | None = None
        # the form's score-correction bias (softmax-biased-topk): its path in the module, read at
        # every step; router_select chooses with it
        self.correction: tuple[str, ...] | None = None
        # or the bias is the forward's second argument (MiniMax-M2, Hunyuan-V3: the block holds it),
        # probed with _probe_bias
        self.bias_arg = _takes_bias_argument(original_forward)
        self._probe_bias = (torch.randn(self.experts, generator=torch.Generator().manual_seed(17)) * 0.3
                            if self.bias_arg else None)
        # (key, float32 copy, the tensor copied) of a bias argument of another dtype (_bias); the
        # tensor is held so that its id is not reused while the key names it
        self._bias_copy: tuple | None = None
        # router_select's (form, k, renorm, weights' dtype, float32 logits out) when it reproduces
        # the form (matches)
        self.select: tuple | None = None
        self.settings = _settings(module)
        self._setting_keys = tuple(k for k, _ in self.settings)
        self._setting_values = tuple(v for _, v in self.settings)
        self._lock = threading.Lock()
        # fastpath.replay's override of every call (benchmarks and tests only), or None
        self.replay: Callable | None = None
        self._pack(w, getattr(module, "bias", None))

    def _pack(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        """Pack a copy of the weight (and bias): the module keeps its own, so nothing is
        released or restored. The parameters' version counters tell when they change in place
        (load_state_dict, copy_) and a new copy is packed."""
        self.native = native_module()[0]
        with torch.no_grad():
            packed = self.native.PackedExperts.pack_linear(
                w.detach().to(self.dtype).contiguous(), None if b is None else b.detach().to(self.dtype).contiguous(),
                isa=self.isa,
                num_threads=self.threads, weights="lossless")
        self.packed, self.bound, self.nbytes = packed, packed.bind(), packed.nbytes
        self._state = (w, b, w._version, None if b is None else b._version)

    def _unchanged(self, module: nn.Module) -> bool:
        """Whether the packed copy is the module's current parameters (repacked when they were
        changed in place or replaced by ones of the same shape) and its settings are the probe's."""
        # through the parameter dict: a module attribute lookup is a Python call, and one that
        # misses (no bias) raises inside nn.Module.__getattr__; this runs at every decode step
        params = module._parameters
        w = params["weight"] if "weight" in params else getattr(module, "weight", None)
        b = params["bias"] if "bias" in params else module.__dict__.get("bias")
        pw, pb, vw, vb = self._state
        if w is not pw or b is not pb or w._version != vw or (b is not None and b._version != vb):
            if (not isinstance(w, torch.Tensor) or w.shape != (self.experts, self.hidden) or w.dtype is not self.wdtype
                    or not w.is_cpu or (b is not None and (b.shape != (self.experts,) or b.dtype is not self.wdtype))):
                return False
            with self._lock:
                self._pack(w, b)
        # settings hold only bools, ints, floats and strings: a missing one (None) never matches
        return tuple(map(module.__dict__.get, self._setting_keys)) == self._setting_values

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty((h.shape[0], self.experts), dtype=self.dtype)
        self.bound.linear(h.data_ptr(), h.shape[0], out.data_ptr(), self.threads or torch.get_num_threads())
        return out

    @property
    def biased(self) -> bool:
        """Whether the form chooses with a score-correction bias (the layers' native calls then
        pass it, as _bias() reads it, to their selection)."""
        return self.correction is not None or self.bias_arg

    @property
    def casts(self) -> bool:
        """Whether the form casts its input to the packed dtype itself (float32 logits of a router
        of another dtype, or ERNIE's float32 router): inputs of the layer's dtype are taken and
        converted, as the module converts them."""
        return bool(getattr(self.form, "float_logits", False)) or self.correction is not None

    def _bias(self, arg: torch.Tensor | None = None) -> torch.Tensor | None:
        """The form's score-correction bias as the form and router_select read it (float32, one
        contiguous value per expert, on the CPU), or None when it is not so any more: the module's
        own, or with bias_arg the forward's argument `arg` (bfloat16 or float16 converted, which is
        exact, as the form's addition promotes it)."""
        t = arg if self.bias_arg else _correction(self.module, self.correction)
        if (type(t) not in (torch.Tensor, nn.Parameter) or t.numel() != self.experts or not t.is_cpu
                or t.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
            return None
        if t.dtype is not torch.float32 and self.bias_arg:
            # a float32 copy, kept until the tensor changes: the stack's one call holds its address
            # across steps (StepPlan), so it must outlive this call and stay put
            key = (id(t), t.data_ptr(), t._version)
            if self._bias_copy is None or self._bias_copy[0] != key:
                self._bias_copy = (key, t.detach().float().reshape(-1).contiguous(), t)
            return self._bias_copy[1]
        return t if t.dtype is torch.float32 and t.is_contiguous() else None

    def weights_dtype(self, dt: torch.dtype) -> torch.dtype:
        """The dtype of the weights router_select gives for inputs of dtype dt (self.select set):
        the form's, or the input's for a form that casts them to it (ERNIE's)."""
        w = self.select[3]
        return dt if w is None else w

    def select_settings(self, bias: torch.Tensor | None) -> dict:
        """router_select's arguments beyond the form (the native calls' names): the score-correction
        bias's address and norm_min, and the grouped form's groups, topk_group and scale."""
        groups, topk_group, scale, eps = self.select[5]
        return {"sel_bias": 0 if bias is None else bias.data_ptr(),
                "norm_min": float(self.module.__dict__.get("norm_min", 0.0)) if bias is not None else 0.0,
                "sel_groups": groups, "sel_topk_group": topk_group, "sel_scale": scale, "sel_eps": eps}

    def select_into(self, logits: torch.Tensor, wdt: torch.dtype, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weights, indices) of the form from `logits` [B, experts] (contiguous, of self.dtype) on
        router_select, the weights in `wdt`; self.select must be set. With a score-correction bias:
        `bias`, or else _bias(); None when it is not as router_select reads it."""
        form, k, renorm = self.select[:3]
        B = logits.shape[0]
        t = None
        if self.biased:
            t = self._bias() if bias is None else bias
            if t is None:
                return None
        a = self.select_settings(t)
        w, idx = torch.empty(B, k, dtype=wdt), torch.empty(B, k, dtype=torch.int64)
        self.native.router_select_raw(_CODES[self.dtype], logits.data_ptr(), B, self.experts, k, form, renorm,
                                      _CODES[wdt], w.data_ptr(), idx.data_ptr(), a["sel_bias"], a["norm_min"],
                                      a["sel_groups"], a["sel_topk_group"], a["sel_scale"], a["sel_eps"])
        return w, idx

    def _select_reproduces(self, h: torch.Tensor) -> bool:
        """Whether router_select gives the form's experts, in its order, and its weights within
        _SELECT_RTOL, from F.linear's logits of h and from tie-heavy logits."""
        gen = torch.Generator().manual_seed(13)
        ties = (torch.randint(-6, 7, (256, self.experts), generator=gen).float() / 4).to(self.dtype)
        bias = self._probe_bias if self.bias_arg else None
        for logits in (self._reference_logits(h).contiguous(), ties):
            _, want_w, want_idx = self.form(lambda _: logits, logits, bias)
            try:
                got = self.select_into(logits, want_w.dtype, bias)
            except ValueError:  # settings router_select refuses (expert groups of one, ...)
                return False
            if got is None:
                return False
            w, idx = got
            if w.dtype != want_w.dtype or not torch.equal(idx, want_idx):
                return False
            want = want_w.float()
            nan = want.isnan()  # (a renormalisation over zero scores: NaN in both, in the same places)
            tol = _SELECT_RTOL[w.dtype] * want.abs() + torch.finfo(torch.float32).tiny
            if not torch.equal(w.isnan(), nan) or not bool(((w.float() - want).abs() <= tol)[~nan].all()):
                return False
        return True

    def _reference_logits(self, h: torch.Tensor) -> torch.Tensor:
        """F.linear's logits of h, in h's dtype (the weight cast to it, as a router computing in
        float32 casts its own)."""
        w, b = self.module.weight, getattr(self.module, "bias", None)
        return F.linear(h, w.to(h.dtype), None if b is None else b.to(h.dtype))

    def _probe(self, rows: int, seed: int) -> torch.Tensor:
        """Rows at scales from 1e-2 to 1e2: the softmax runs from flat to peaked, and
        low-precision logits tie."""
        gen = torch.Generator().manual_seed(seed)
        scale = torch.logspace(-2, 2, 5).repeat_interleave(-(-rows // 5))[:rows].unsqueeze(1)
        return (torch.randn(rows, self.hidden, generator=gen) * scale).to(self.wdtype)

    def _reproduces(self, candidates: list[tuple[str, Form]], h: torch.Tensor) -> list[tuple[str, Form]]:
        """The candidates whose output on h is the module's own, bit for bit."""
        bias = self._probe_bias if self.bias_arg else None
        try:
            want = self.original(h) if bias is None else self.original(h, bias)
        except Exception:
            return []
        if (not isinstance(want, (tuple, list)) or len(want) != 3 or not all(isinstance(t, torch.Tensor) for t in want)
                or want[2].dim() != 2 or want[2].dtype != torch.int64 or want[0].shape != (h.shape[0], self.experts)):
            return []
        out = []
        for name, form in candidates or _forms(want[2].shape[1], self.module, self.bias_arg):
            try:
                got = form(self._reference_logits, h, bias)
            except Exception:  # settings this form cannot take (say, expert groups of one)
                continue
            if all(g.dtype == x.dtype and g.shape == x.shape and _same_bits(g, x) for g, x in zip(got, want)):
                out.append((name, form))
        return out

    def matches(self) -> bool:
        """Whether one of the known forms, with F.linear's logits, gives the module's own output
        bit for bit on a probe, and the native logits are within rounding of F.linear's. Forms
        that are one function up to float32 rounding can all pass a small probe: a larger one
        then keeps those that also reproduce it (the first of them is used)."""
        with torch.no_grad():
            h = self._probe(40, 11)
            found = self._reproduces([], h)
            if len(found) > 1:
                found = self._reproduces(found, self._probe(2048, 12))
            if not found:
                return False
            self.form_name, self.form = found[0]
            if getattr(self.form, "biased", False) and not self.bias_arg:
                self.correction = _correction_path(self.module)
                # the model's own inputs are of its dtype, cast to float32 by the router: so too here
                if not self._reproduces([found[0]], h.bfloat16()):
                    return False
            if getattr(self.form, "float_logits", False) and self.dtype is not torch.float32:
                self.dtype = torch.float32  # its logits from a float32 copy of the weight
                self._pack(self.module.weight, getattr(self.module, "bias", None))
            x = h.to(self.dtype)
            ref = self._reference_logits(x).float()
            nat = self._logits(x).float()
            self.select = self.form.native(self.dtype)
            if not self._select_reproduces(x):
                self.select = None
        tol = _LOGIT_RTOL[self.dtype] * ref.abs().amax(dim=-1, keepdim=True)
        return bool(((nat - ref).abs() <= tol).all())

    def forward(self, module: nn.Module, h: torch.Tensor, *rest):
        if self.replay is not None:  # the routing replay's choice (fastpath.replay)
            return self.replay(self, h, *rest)
        # the decode call in few operations (see linear.NativeLinear.forward); anything else, and
        # a setting changed since the probe, go to the module's own forward. A float32 router of
        # the biased form casts its input itself (the form's logits are of h.float()); with
        # bias_arg the bias is the call's second argument
        if (len(rest) == self.bias_arg and type(h) is torch.Tensor and h.dim() == 2 and h.shape[1] == self.hidden
                and (h.dtype is self.dtype or ((self.biased or self.casts) and h.dtype in _CODES))
                and h.shape[0] <= ROUTER_MAX_ROWS and h.is_contiguous() and h.is_cpu and not h.requires_grad
                and not h.is_neg() and not module.training and self._unchanged(module)):
            bias = None
            if self.biased:
                bias = self._bias(rest[0] if rest else None)
                if bias is None:  # not as the form reads it any more
                    return self.original(h, *rest)
            if self.select is not None and NATIVE_SELECT:
                logits = self._logits(h if h.dtype is self.dtype else h.to(self.dtype))
                w, idx = self.select_into(logits, self.weights_dtype(h.dtype), bias)
                return logits.float() if self.select[4] else logits, w, idx
            return self.form(self._logits, h, bias)
        return self.original(h, *rest)

    def restore(self) -> None:  # the module's parameters were never touched
        pass
