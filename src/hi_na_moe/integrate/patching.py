"""enable_for_model / disable_for_model / inspect_model, and the transformers ExpertsInterface
registration.

Patching is per instance: the replacement forward is set as an attribute of the module object
(never on its class), the original attribute state is kept, and disable removes exactly what
enable added. Weights are not touched, so outputs after disable are bit-identical to before.

Threads: forwards may run on any number of threads at once. enable_for_model and
disable_for_model change the blocks' weights (release / restore), so they are serialised
against the patched forwards of the same model (see `_Gate`): disable waits until no forward
is inside a patched block, and forwards arriving while enable or disable works wait at the
gate and then run the accelerated path (enable done) or the block's own forward (disable
done). A wait longer than DRAIN_TIMEOUT_S raises a RuntimeError and leaves the model as it
was. A forward already running a block's own code on another thread when enable releases
that block's weights is not waited for: nothing shows such a forward safely (see
`_patch_block`), so enable is called between forwards, or with keep_weights=True, which
releases nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import types
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core import ops, reference, trim as trim_mod
from ..core.config import EXPERIMENTAL, HinaConfig, load_config
from ..core.formats import Scope
from ..core.memory import read_in_embeddings
from ..core.native import native_module
from ..core.registry import patched_runner
from ..core.spec import check_routing
from ..core.store import current_source, recording_source
from ..fastpath import linear, norm, orchestrate
from ..fastpath.attention import find_attention, math_kernel, prefill_math
from ..fastpath.layers import find_layers
from ..fastpath.mla import find_mla
from ..fastpath.mlp import find_mlps
from ..fastpath.routers import find_routers
from ..fastpath.stack import find_causal_lms, find_stacks
from . import adapters, tiering

_LOCK = threading.RLock()
# patched module -> what enable changed on it
_PATCHED: "weakref.WeakKeyDictionary[nn.Module, _PatchState]" = weakref.WeakKeyDictionary()
# root passed to enable_for_model -> the modules it patched and its report
_ROOTS: "weakref.WeakKeyDictionary[nn.Module, tuple[list, EnableReport]]" = weakref.WeakKeyDictionary()
# root -> the gate between its patched blocks' forwards and its enable/disable
_GATES: "weakref.WeakKeyDictionary[nn.Module, _Gate]" = weakref.WeakKeyDictionary()
# scope="all": per enabled model, the dense layers patched (hi_na_moe.fastpath.orchestrate.patch)
_DENSE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_MISSING = object()

# How long disable_for_model waits for forwards in flight in the patched blocks of the same model
# before it gives up with a RuntimeError (the model is then left as it was).
DRAIN_TIMEOUT_S = 60.0


class _Gate:
    """A readers-writer lock (writer preference) between the forwards of the blocks one
    enable_for_model patched (readers: any number at once, from any threads) and that enable's
    weight changes (the writer: enable while it releases the model's weights, disable while it
    restores them). A forward arriving while the writer works waits here, then runs the
    accelerated path if the blocks are still enabled (`active`), or the block's own forward,
    restored by then. So no forward ever reads weights in the middle of being swapped."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # thread id of the enable/disable at work
        self._writers_waiting = 0
        self.parked: set[int] = set()  # threads waiting here (tests see a forward held at the gate)
        self.active = True  # False once the blocks are restored (disable, or a failed enable)
        # per thread (ident): how many forwards it has inside the gate, absent at zero. Not a
        # threading.local: CPython 3.11 can deadlock when the GC frees one while another thread
        # exits (a CI run hung so, freeing a gate in tests/test_concurrency.py; cpython#106883)
        self._depth: dict[int, int] = {}

    def enter(self) -> None:
        me = threading.get_ident()
        depth = self._depth.get(me, 0)
        if depth:
            # nested in a forward of this thread that holds a reader's place: no writer can be
            # at work until it leaves (acquire_write waits for readers == 0), so no lock is needed
            self._depth[me] = depth + 1
            return
        with self._cond:
            if self._writer is not None or self._writers_waiting:
                if self._writer != me:
                    self.parked.add(me)
                    try:
                        while self._writer is not None or self._writers_waiting:
                            self._cond.wait()
                    finally:
                        self.parked.discard(me)
            self._readers += 1
        self._depth[me] = 1

    def exit(self) -> None:
        me = threading.get_ident()
        depth = self._depth[me] - 1
        if depth:
            self._depth[me] = depth
            return  # the outer forward still holds the reader's place
        del self._depth[me]
        with self._cond:
            self._readers -= 1
            if self._readers == 0 and self._writers_waiting:
                self._cond.notify_all()

    def inside(self) -> bool:
        """Whether the calling thread is inside a forward of a block behind this gate."""
        return self._depth.get(threading.get_ident(), 0) > 0

    def acquire_write(self, timeout: float, what: str) -> None:
        if self.inside():
            raise RuntimeError(
                f"hi_na_moe: {what} was called from inside a forward of the same model (a hook?); it would "
                "wait for that forward forever. Call it after the forward returns"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer is not None or self._readers:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(
                            f"hi_na_moe: {what} waited {timeout:g} s for {self._readers} forward(s) still running "
                            "in this model's MoE blocks on other threads and gave up; the model is unchanged. "
                            "Call it again once those forwards have returned"
                        )
                    self._cond.wait(left)
                self._writer = threading.get_ident()
            finally:
                self._writers_waiting -= 1
                if self._writer is None:
                    self._cond.notify_all()  # forwards held back by this writer may go on

    def release_write(self) -> None:
        with self._cond:
            self._writer = None
            self._cond.notify_all()


@dataclass
class _PatchState:
    forward: Any  # the instance's own `forward` attribute before enable, or _MISSING
    extra_repr: Any


@dataclass
class BlockReport:
    name: str
    module_class: str
    adapter: str
    # "accelerated" (a native kernel runs it), "reference" (the pure-PyTorch path runs it) or
    # "native" (left to the model's own code; `reason` says why)
    status: str
    reason: str | None = None  # why native, or why the reference path rather than a kernel
    kernel: str | None = None
    weights: str | None = None  # how the kernels store the experts: the model's dtype (lossless), int8, int4-g32
    sqnr_db: float | None = None  # quantised: output SQNR vs the original weights on a random probe
    experts: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    gate: str | None = None
    expert_bytes: int | None = None
    packed_bytes: int | None = None  # the native kernels' packed copy
    released_bytes: int | None = None  # the model's own copy freed while enabled
    cache: str | None = None  # quantised: "built", "reused" or "rebuilt (why)" in the packed-expert store
    memory: str | None = None  # from the store: "copied" into memory or "mapped" (config key memory)


@dataclass
class EnableReport:
    """What enable_for_model did (or inspect_model would do), per MoE block."""

    model_class: str
    config: dict[str, Any]
    blocks: list[BlockReport] = field(default_factory=list)
    dry_run: bool = False
    # what the native kernels' parallel regions run on (config key `pool`), once any block is native
    pool: str | None = None
    # with the own workers and a libgomp loaded: the team the stacks' one-call decode steps are
    # hosted on (ThreadPool::host; the own workers while a contended step's backoff lasts)
    pool_hosted: str | None = None
    # scope="all": the dense linear layers on the native kernels (hi_na_moe.fastpath.linear.DenseReport)
    dense: list = field(default_factory=list)
    # scope="all": the RMSNorm modules on the native kernel, and those whose probe did not match
    # what the kernel computes (left to PyTorch)
    norms: list = field(default_factory=list)
    norms_differ: list = field(default_factory=list)
    # scope="all": the routers whose logits run on the native kernel (hi_na_moe.fastpath.routers), and
    # those matching no known form (left to PyTorch)
    routers: list = field(default_factory=list)
    routers_differ: list = field(default_factory=list)
    # of those routers, the ones whose softmax/top-k stay PyTorch's ops (router_select did not
    # reproduce their form on the probe, e.g. a C++ standard library whose selection moves ties
    # otherwise than PyTorch's build)
    routers_select_pytorch: list = field(default_factory=list)
    # scope="all": the attention modules whose decode calls run on the native rotary and
    # attention kernels (hi_na_moe.fastpath.attention), and the candidates matching no form
    attention: list = field(default_factory=list)
    attention_differ: list = field(default_factory=list)
    attention_math: str | None = None  # what computes their attention (attention.math_kernel)
    # of those, the modules whose prefill calls run on the native prefill kernel, and what
    # computes prefill attention at this tier (attention.prefill_math)
    attention_prefill: list = field(default_factory=list)
    attention_prefill_math: str | None = None
    # scope="all": the multi-head latent attention modules (DeepSeek-V2/V3, ...) whose decode calls
    # run on the native absorbed kernel (hi_na_moe.fastpath.mla), the candidates whose probe differed, and
    # the bytes of the copies of packed kv_b_proj weights that kernel reads (an int8 / int4 one's
    # codes and scales, others dense) and how many of them are codes and scales
    attention_latent: list = field(default_factory=list)
    attention_latent_differ: list = field(default_factory=list)
    attention_latent_bytes: int = 0
    attention_latent_quant: int = 0
    attention_latent_prefill: list = field(default_factory=list)  # of those, prefill on the native kernel
    # scope="all": the gated MLP modules (shared experts, dense MLPs) whose decode calls are one
    # native call (hi_na_moe.fastpath.mlp), and the candidates whose probe did not match
    mlps: list = field(default_factory=list)
    mlps_differ: list = field(default_factory=list)
    # scope="all": the decoder layers whose decode calls take the short path (hi_na_moe.fastpath.layers),
    # and the candidates that did not (a part left to PyTorch, or the probe differed)
    layers: list = field(default_factory=list)
    layers_differ: list = field(default_factory=list)
    # scope="all": the decoder stacks whose decode calls loop over those layers' short paths
    # (hi_na_moe.fastpath.stack), and the candidates whose probe differed
    stacks: list = field(default_factory=list)
    stacks_differ: list = field(default_factory=list)
    # scope="all": the causal LMs whose decode calls run their stack's step and lm_head straight
    # (hi_na_moe.fastpath.stack.NativeCausalLM), and the candidates whose probe differed
    causal_lms: list = field(default_factory=list)
    causal_lms_differ: list = field(default_factory=list)
    # of those stacks, why a stack's DynamicCache / StaticCache decode steps cannot run all its layers in one
    # native call: stack name -> "<layer name>: <reason>" (stacks absent here can)
    stacks_loop_only: dict = field(default_factory=dict)
    # of those stacks, why a stack's decode steps call its rotary module instead of reading its table
    # (hi_na_moe.fastpath.rope_table): stack name -> reason (stacks absent here read it)
    stacks_rotary_module: dict = field(default_factory=dict)
    # the embedding tables whose pages enable read once (hi_na_moe.core.memory.read_in_embeddings), their
    # bytes and the seconds it took
    embeddings_read: list = field(default_factory=list)
    embeddings_read_bytes: int = 0
    embeddings_read_s: float = 0.0
    # the memory tier (memory_limit; hi_na_moe.integrate.tiering): what the report says of it
    memory_tier: list = field(default_factory=list)
    top_k: str | None = None  # HinaConfig.top_k other than "model": what the trim does (core.trim)
    experimental: str | None = None  # HinaConfig.experimental's switches as set

    @property
    def accelerated(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.status == "accelerated"]

    @property
    def reference(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.status == "reference"]

    @property
    def native(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.status == "native"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_class": self.model_class, "dry_run": self.dry_run, "config": self.config, "pool": self.pool,
            "pool_hosted": self.pool_hosted,
            "summary": {"moe_blocks": len(self.blocks), "accelerated": len(self.accelerated),
                        "reference": len(self.reference), "native": len(self.native)},
            "blocks": [asdict(b) for b in self.blocks],
            "dense": [asdict(d) for d in self.dense],
            "norms": list(self.norms), "norms_differ": list(self.norms_differ),
            "routers": list(self.routers), "routers_differ": list(self.routers_differ),
            "routers_select_pytorch": list(self.routers_select_pytorch),
            "attention": list(self.attention), "attention_differ": list(self.attention_differ),
            "mlps": list(self.mlps), "mlps_differ": list(self.mlps_differ),
            "layers": list(self.layers), "layers_differ": list(self.layers_differ),
            "stacks": list(self.stacks), "stacks_differ": list(self.stacks_differ),
            "stacks_loop_only": dict(self.stacks_loop_only),
            "stacks_rotary_module": dict(self.stacks_rotary_module),
            "causal_lms": list(self.causal_lms), "causal_lms_differ": list(self.causal_lms_differ),
            "attention_math": self.attention_math,
            "attention_prefill": list(self.attention_prefill),
            "attention_prefill_math": self.attention_prefill_math,
            "attention_latent": list(self.attention_latent),
            "attention_latent_differ": list(self.attention_latent_differ),
            "attention_latent_bytes": self.attention_latent_bytes,
            "attention_latent_quant": self.attention_latent_quant,
            "attention_latent_prefill": list(self.attention_latent_prefill),
            "embeddings_read": list(self.embeddings_read), "embeddings_read_bytes": self.embeddings_read_bytes,
            "embeddings_read_s": self.embeddings_read_s,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        head = "hi_na_moe (dry run, nothing changed)" if self.dry_run else "hi_na_moe"
        lines = [
            f"{head} on {self.model_class}: {len(self.blocks)} MoE block(s): {len(self.accelerated)} on native "
            f"kernels, {len(self.reference)} on the PyTorch reference path, {len(self.native)} left native"
        ]
        if not self.blocks:
            lines.append("  no MoE blocks found (pass router_name= for a custom model)")
        if self.pool:
            lines.append(f"  kernel threads: {self.pool}")
        quant = any(b.sqnr_db is not None for b in self.blocks)
        rows = [("block", "status", "kernel", "weights") + (("SQNR dB", "cache") if quant else ())
                + ("E", "H", "I", "gate", "note")]
        for b in self.blocks:
            q = (f"{b.sqnr_db:.1f}" if b.sqnr_db is not None else "-", b.cache or "-") if quant else ()
            rows.append((b.name, b.status, b.kernel or "-", b.weights or "-") + q + (str(b.experts or "-"),
                         str(b.hidden or "-"), str(b.intermediate or "-"), b.gate or "-", b.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        if self.dense:
            by_fmt: dict[str, int] = {}
            for d in self.dense:
                by_fmt[d.weights] = by_fmt.get(d.weights, 0) + 1
            fmts = ", ".join(f"{n} {f}" for f, n in by_fmt.items())
            freed = sum(d.released_bytes for d in self.dense)
            if self.dry_run:
                lines.append(f"  dense linear layers scope='all' would run on native kernels: {len(self.dense)} ({fmts}), "
                             f"{sum(d.packed_bytes for d in self.dense) / 2**20:.0f} MiB packed")
            else:
                events: dict[str, int] = {}
                for d in self.dense:
                    if d.cache:
                        events[d.cache] = events.get(d.cache, 0) + 1
                store = ("; in the packed-expert store: " + ", ".join(f"{k} {n}" for k, n in events.items())
                         if events else "")
                lines.append(f"  dense linear layers on native kernels (scope='all'): {len(self.dense)} ({fmts}); "
                             f"{freed / 2**20:.0f} MiB of their own weights released{store}")
        held = [(r.memory, r.packed_bytes or 0) for r in [*self.blocks, *self.dense] if r.memory]
        if held:
            by = {k: (sum(1 for m, _ in held if m == k), sum(n for m, n in held if m == k)) for k in ("copied", "mapped")}
            lines.append(f"  expert blocks and dense layers from the packed-expert store (memory={self.config.get('memory')!r}): "
                         f"{by['copied'][0]} copied into memory ({by['copied'][1] / 2**20:.0f} MiB), "
                         f"{by['mapped'][0]} read through its file mapping ({by['mapped'][1] / 2**20:.0f} MiB)")
        lines.extend(self.memory_tier)
        if self.top_k:
            lines.append(f"  top_k={self.config.get('top_k')!r}: {self.top_k}; outputs differ from the model's")
        if self.experimental:
            lines.append(f"  experimental switches (process-wide, for A/B runs): {self.experimental}")
        if self.dry_run and (self.norms or self.routers or self.attention or self.attention_latent
                             or self.routers_differ or self.mlps or self.layers):
            left = f"; {len(self.routers_differ)} router(s) left to PyTorch" if self.routers_differ else ""
            mlps = f"{len(self.mlps)} gated MLP(s), " if self.mlps else ""
            latent = f"{len(self.attention_latent)} latent attention module(s), " if self.attention_latent else ""
            lines.append(f"  small modules scope='all' would probe at enable and run natively where their form "
                         f"matches: {len(self.norms)} RMSNorm, {len(self.routers)} router(s), {len(self.attention)} "
                         f"attention module(s), {latent}{mlps}{len(self.layers)} decoder layer(s), "
                         f"{len(self.stacks)} decoder stack(s){left}")
        elif self.norms or self.norms_differ:
            left = (f"; {len(self.norms_differ)} left to PyTorch (they compute something else, e.g. "
                    f"{self.norms_differ[0]})" if self.norms_differ else "")
            lines.append(f"  RMSNorm modules on the native kernel for decode-sized inputs: {len(self.norms)}{left}")
        if not self.dry_run and (self.routers or self.routers_differ):
            left = (f"; {len(self.routers_differ)} left to PyTorch (no known router form, e.g. "
                    f"{self.routers_differ[0]})" if self.routers_differ else "")
            native = len(self.routers) - len(self.routers_select_pytorch)
            select = (f" (softmax/top-k natively in {native}; in PyTorch in {len(self.routers_select_pytorch)}, whose "
                      f"probe router_select did not reproduce, e.g. {self.routers_select_pytorch[0]})"
                      if self.routers_select_pytorch else " (and their softmax/top-k)" if self.routers else "")
            lines.append(f"  routers with their logits on the native kernel for decode-sized inputs: "
                         f"{len(self.routers)}{select}{left}")
        if not self.dry_run and (self.attention or self.attention_differ):
            left = (f"; {len(self.attention_differ)} left to PyTorch (no known form, e.g. "
                    f"{self.attention_differ[0]})" if self.attention_differ else "")
            math = f" (attention math: {self.attention_math})" if self.attention_math else ""
            lines.append(f"  attention modules with decode steps on the native kernels: {len(self.attention)}{math}{left}")
            if self.attention:
                pre = (f"{len(self.attention_prefill)} of {len(self.attention)} with their attention on the native "
                       "AVX512-BF16 kernel" if self.attention_prefill
                       else f"their own forward (prefill attention at this tier: {self.attention_prefill_math})")
                lines.append(f"    prefill calls: {pre}")
        if not self.dry_run and (self.attention_latent or self.attention_latent_differ):
            left = (f"; {len(self.attention_latent_differ)} left to PyTorch (their probe differed, e.g. "
                    f"{self.attention_latent_differ[0]})" if self.attention_latent_differ else "")
            quant = (f", {self.attention_latent_quant} of them the quantised layers' codes and scales"
                     if self.attention_latent_quant else "")
            copy = (f"; {self.attention_latent_bytes / 2**20:.1f} MiB of kv_b_proj copies it reads{quant}"
                    if self.attention_latent_bytes else "")
            lines.append(f"  latent attention (MLA) modules with decode steps on the native absorbed kernel: "
                         f"{len(self.attention_latent)}{copy}{left}")
            if self.attention_latent:
                pre = (f"{len(self.attention_latent_prefill)} of {len(self.attention_latent)} with their attention on "
                       "the native AVX512-BF16 kernel" if self.attention_latent_prefill
                       else f"their own forward (prefill attention at this tier: {self.attention_prefill_math})")
                lines.append(f"    prefill calls: {pre}")
        if not self.dry_run and (self.mlps or self.mlps_differ):
            left = (f"; {len(self.mlps_differ)} take their own forward (a projection not on the dense kernels, "
                    f"an activation other than SiLU, or their probe differed, e.g. {self.mlps_differ[0]})"
                    if self.mlps_differ else "")
            lines.append(f"  gated MLPs (shared experts, dense MLPs) with decode steps in one native call: "
                         f"{len(self.mlps)}{left}")
        if not self.dry_run and (self.layers or self.layers_differ):
            left = (f"; {len(self.layers_differ)} take their own forward (a part left to PyTorch, or their probe "
                    f"differed, e.g. {self.layers_differ[0]})" if self.layers_differ else "")
            lines.append(f"  decoder layers with decode steps in few native calls: {len(self.layers)}{left}")
        if not self.dry_run and (self.stacks or self.stacks_differ):
            left = (f"; {len(self.stacks_differ)} take their own forward (a layer of other than full or "
                    f"sliding-window attention, or their probe differed, e.g. "
                    f"{self.stacks_differ[0]!r})" if self.stacks_differ else "")
            names = ", ".join(repr(n) for n in self.stacks)
            lines.append(f"  decoder stacks with decode steps as one loop over those layers: {len(self.stacks)}"
                         f"{' (' + names + ')' if names else ''}{left}")
            one = [n for n in self.stacks if n not in self.stacks_loop_only]
            if one:
                lines.append(f"  of those, with a DynamicCache or StaticCache every layer in one native call: {len(one)}")
                if self.pool_hosted:
                    lines.append(f"  those calls' threads: {self.pool_hosted}'s team, hosted (the own workers for a "
                                 f"while after a step that found its threads held off their cores)")
            for name, why in self.stacks_loop_only.items():
                lines.append(f"  {name!r} keeps the loop, not one native call: {why}")
            for name, why in self.stacks_rotary_module.items():
                lines.append(f"  {name!r} calls its rotary module at every step (no table of its outputs): {why}")
        if not self.dry_run and (self.causal_lms or self.causal_lms_differ):
            left = (f"; {len(self.causal_lms_differ)} take their own forward (their probe differed, e.g. "
                    f"{self.causal_lms_differ[0]!r})" if self.causal_lms_differ else "")
            names = ", ".join(repr(n) for n in self.causal_lms)
            lines.append(f"  causal LMs with decode steps as their stack's step and lm_head, called straight: "
                         f"{len(self.causal_lms)}{' (' + names + ')' if names else ''}{left}")
        if self.embeddings_read:
            lines.append(f"  embedding tables read in at enable (a new token's row is then not a disk read in its decode "
                         f"step): {len(self.embeddings_read)} ({self.embeddings_read_bytes / 2**20:.0f} MiB, "
                         f"{self.embeddings_read_s:.2f} s)")
        return "\n".join(lines)


def _block_report(match: adapters.BlockMatch, status: str, choice: ops.Choice | None) -> BlockReport:
    spec = match.spec
    rep = BlockReport(match.name, type(match.module).__name__, match.adapter, status)
    if spec is None:
        rep.reason = match.reason
        return rep
    rep.status = "accelerated" if choice.kernel != "reference" else "reference"
    rep.kernel = choice.kernel
    rep.reason = choice.note if choice else None
    rep.weights = str(spec.weight_dtype).replace("torch.", "")
    if choice is not None and isinstance(choice.runner, ops.NativeExperts):
        rep.weights = ops.weights_label(choice.runner.weights, choice.runner.group_size, spec.weight_dtype)
    rep.experts, rep.hidden, rep.intermediate = spec.num_experts, spec.hidden, spec.intermediate
    if spec.gate_spec is not None:
        rep.gate = spec.gate_spec.describe() + ("" if spec.has_gate else " (no gate)")
    else:
        rep.gate = "model's own (" + (spec.gate_unrecognised or "custom") + ")"
    rep.expert_bytes = spec.nbytes()
    return rep


class _TrimHolder:
    """The trim (HinaConfig.top_k) an enabled model's reference-path blocks read at each call;
    set_top_k changes it (the native blocks hold theirs in the packed block)."""

    def __init__(self, trim: trim_mod.Trim | None):
        self.trim = trim


# root passed to enable_for_model -> its _TrimHolder
_TRIMS: "weakref.WeakKeyDictionary[nn.Module, _TrimHolder]" = weakref.WeakKeyDictionary()


def _trimmed_reference(holder: _TrimHolder) -> ops.Runner:
    """The reference path, with the holder's trim (HinaConfig.top_k) applied to its routing first."""

    def run(spec, hidden, idx, w):
        trim = holder.trim
        if trim is None:
            return reference.experts_forward(spec, hidden, idx, w)
        check_routing(spec, hidden, idx, w)
        return reference.experts_forward(spec, hidden, *reference.trim_routing(idx, w, trim))

    run.reference = True
    return run


def _guarded(run: ops.Runner, module: nn.Module, holder: _TrimHolder | None = None) -> ops.Runner:
    """Native kernels do not do autograd. A module in training mode with autograd recording runs
    the reference path instead (gradients flow as natively; the holder's trim applied as the
    kernels apply it); in eval mode the kernels run and the experts' output carries no autograd history, as with
    any inference kernel."""
    if run is reference.experts_forward or getattr(run, "reference", False):
        return run
    fallback = _trimmed_reference(holder if holder is not None else _TrimHolder(getattr(run, "trim", None)))
    ref = weakref.ref(module)

    def guarded(spec, hidden, idx, w):
        m = ref()
        if m is not None and m.training and torch.is_grad_enabled() and (
                hidden.requires_grad or any(t.requires_grad for t in spec.weight_tensors())):
            if spec.cache.get("released"):
                raise RuntimeError(
                    "hi_na_moe: gradients are requested through an MoE block whose expert weights are packed for "
                    "the native kernels and released from the model; enable with keep_weights=True to train "
                    "(keeps both copies), or call hi_na_moe.disable_for_model(model) first"
                )
            return fallback(spec, hidden, idx, w)
        return run(spec, hidden, idx, w)

    return guarded


def _make_repr(match: adapters.BlockMatch, kernel: str, original: Any):
    def extra_repr(self) -> str:
        base = original() if callable(original) else ""
        tag = f"hi_na_moe={kernel}, adapter={match.adapter}"
        return f"{base}, {tag}" if base else tag

    return extra_repr


def _fast_first(runner: ops.NativeExperts, forward):
    """An experts-level forward that tries the runner's short path first (NativeExperts.fast:
    inference calls with plain inputs) and runs the full `forward` for everything else (training
    with autograd, conversions, errors)."""

    def fast_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            out = runner.fast(hidden_states, top_k_index, top_k_weights)
            if out is not None:
                return out
        return forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

    fast_forward.runner = runner  # hi_na_moe.fastpath.layers calls runner.fast itself
    return fast_forward


def _gated(gate: _Gate, forward):
    """The patched forward behind `gate` (see _Gate)."""

    def gated(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # traced once into a graph; a lock cannot be traced (compiled graphs are not gated)
            return forward(self, *args, **kwargs)
        gate.enter()
        try:
            if gate.active:
                return forward(self, *args, **kwargs)
        finally:
            gate.exit()
        # disabled while this call waited at the gate: the block's own forward, restored by now
        return self.forward(*args, **kwargs)

    gated.inner = forward  # what it runs (patched_runner)
    return gated


def _patch_block(match: adapters.BlockMatch, choice: ops.Choice, cfg: HinaConfig, gate: _Gate, patched: list,
                 prepare=None, holders: dict | None = None, holder: _TrimHolder | None = None) -> BlockReport:
    """Patch one block; it joins `patched` as soon as its forward is replaced, so that a failure
    after that point (releasing its weights) is undone with the others. `holders`
    (ops.storage_holders of the model, taken before any block was released): a block whose
    weights are held elsewhere in the model too keeps them."""
    m = match.module
    block = _block_report(match, "accelerated", choice)
    if isinstance(choice.runner, ops.NativeExperts):
        if prepare is not None:
            prepare(choice.runner)
        choice.runner.pack()
        block.packed_bytes = choice.runner.packed.nbytes
        block.sqnr_db = choice.runner.sqnr_db
        block.cache = choice.runner.cache_event
        block.memory = choice.runner.held
        runner = choice.runner
        if runner.format_note:  # stored in another format than the config's (lossless12 -> lossless)
            block.weights = ops.weights_label(runner.weights, runner.group_size, match.spec.weight_dtype)
            block.kernel = ops.kernel_label(runner.isa, match.spec.weight_dtype, runner.weights, runner.qdot)
            choice = replace(choice, kernel=block.kernel)
            block.reason = f"{block.reason}; {runner.format_note}" if block.reason else runner.format_note
    state = _PatchState(m.__dict__.get("forward", _MISSING), m.__dict__.get("extra_repr", _MISSING))
    new_forward = match.make_forward(match, _guarded(choice.runner, m, holder))
    if isinstance(choice.runner, ops.NativeExperts) and match.make_forward is adapters.experts_forward_factory:
        new_forward = _fast_first(choice.runner, new_forward)
    m.forward = types.MethodType(_gated(gate, new_forward), m)
    m.extra_repr = types.MethodType(_make_repr(match, choice.kernel, m.extra_repr), m)
    _PATCHED[m] = state
    patched.append((m, match, choice))
    if isinstance(choice.runner, ops.NativeExperts) and not cfg.keep_weights:
        # Released right after packing (their memory goes once the next block is packed, for a
        # kernel still reading them: NativeExperts.bury): peak memory grows by two blocks, not by
        # the model. Forwards that reach the block from now on wait at the gate; one that another
        # thread began before the patch runs the block's own code and is not waited for (its next
        # read of a released weight is an error naming it, never numbers). Finding such
        # forwards meant walking the other threads' frames (sys._current_frames(), f_back,
        # f_locals), which on CPython 3.11 with torch returned objects that are not frames,
        # corrupted the running threads and crashed the interpreter within a minute of racing
        # enable/disable against forwards (a CI run failed so); so enable does not look.
        block.released_bytes = choice.runner.release(m, match.rebuild, holders)
        if choice.runner.kept_note:
            note = choice.runner.kept_note
            block.reason = f"{block.reason}; {note}" if block.reason else note
        if choice.runner.origin is not None:
            note = "expert weights never loaded: streamed from the checkpoint into the store"
            block.reason = f"{block.reason}; {note}" if block.reason else note
        elif not choice.runner.lossless and choice.runner.store is None:
            note = "originals kept in memory (cache=False: no exact backup to restore them from)"
            block.reason = f"{block.reason}; {note}" if block.reason else note
    return block


def _unpatch(patched: list) -> list:
    """Restore every block of `patched`. Returns [(entry, exception)] for the blocks whose
    weights could not be restored: those stay patched (and keep running on their packed copy)."""
    failed = []
    for item in patched:
        m, match, choice = item
        if isinstance(choice.runner, ops.NativeExperts):
            try:
                choice.runner.restore(match.rebuild)
            except Exception as exc:
                failed.append((item, exc))
                continue
        state = _PATCHED.pop(m)
        for attr, old in (("forward", state.forward), ("extra_repr", state.extra_repr)):
            if old is _MISSING:
                m.__dict__.pop(attr, None)
            else:
                setattr(m, attr, old)
    return failed


def inspect_model(
    model: nn.Module, config: HinaConfig | None = None, router_name: str | None = None, **config_kwargs: Any
) -> EnableReport:
    """The report `enable_for_model` would return, changing nothing."""
    cfg = load_config(config, **config_kwargs)
    report = EnableReport(type(model).__name__, cfg.to_dict(), dry_run=True)
    matches = adapters.discover(model, router_name)
    for match in matches:
        if match.spec is None:
            report.blocks.append(_block_report(match, "native", None))
        else:
            report.blocks.append(_block_report(match, "accelerated", ops.choose(match.spec, cfg, dry_run=True, name=match.name)))
    if cfg.scope == Scope.ALL and native_module()[0] is not None:
        report.dense = linear.plan(model, cfg, [m.module for m in matches if m.spec is not None])
        # the small modules enable would probe (their forms are checked only then)
        devices = ("cpu", "meta")
        report.norms = [n for n, _ in norm.find_norms(model, cfg.dense_exclude, devices)]
        routers, report.routers_differ = find_routers(model, cfg.dense_exclude, devices)
        report.routers = [n for n, _ in routers]
        report.attention = [n for n, _ in find_attention(model, cfg.dense_exclude)]
        report.attention_latent = [n for n, _ in find_mla(model, cfg.dense_exclude)]
        report.mlps = [n for n, _ in find_mlps(model, cfg.dense_exclude)]
        report.layers = [n for n, _ in find_layers(model, cfg.dense_exclude)]
        report.stacks = [n for n, _ in find_stacks(model, cfg.dense_exclude, candidates=set(report.layers))]
        report.causal_lms = [n for n, _ in find_causal_lms(model, cfg.dense_exclude, candidates=set(report.stacks))]
    return report


def model_source(model: nn.Module) -> str:
    """What the store entries built from `model` record as their source: the path or name it was
    loaded from (transformers' config._name_or_path), else its class, built in memory."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if isinstance(name, (str, os.PathLike)) and str(name) else f"{type(model).__name__} (in memory)"


def enable_for_model(
    model: nn.Module, config: HinaConfig | None = None, router_name: str | None = None, *, _prepare=None,
    **config_kwargs: Any
) -> EnableReport:
    """Accelerate every MoE block in `model` (any nn.Module holding MoE blocks).

    Args:
        model: a transformers model, or any module holding MoE blocks.
        config: a HinaConfig; by default built from env vars (`HINA_MOE_*`) and the YAML file.
        router_name: dotted path of a router module, for custom models whose MoE blocks the
            discovery cannot find by itself; the experts module next to it is accelerated.
        **config_kwargs: config keys (backend, isa, threads, strict, keep_weights, weights,
            group_size, qdot, cache, cache_dir) overriding `config`.

    Returns:
        An EnableReport: per MoE block, accelerated or left native and why, and what runs it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_for_model expects a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(config, **config_kwargs)
    source = current_source() or model_source(model)  # from_pretrained set the checkpoint's path
    with _LOCK, recording_source(source):
        if model in _ROOTS:
            raise RuntimeError(
                f"hi_na_moe is already enabled on this {type(model).__name__}; call "
                "hi_na_moe.disable_for_model(model) first to change its configuration"
            )
        matches = adapters.discover(model, router_name)
        report = EnableReport(type(model).__name__, cfg.to_dict())
        switches = cfg.experimental_switches()
        for name, on in switches.items():  # process-wide, before any part is patched
            module, attr = EXPERIMENTAL[name]
            setattr(importlib.import_module(module), attr, on)
        report.experimental = ", ".join(f"{n}={'on' if v else 'off'}" for n, v in switches.items()) or None
        trim = trim_mod.from_config(cfg, model)
        trim_holder = _TrimHolder(trim)
        report.top_k = trim.describe() if trim is not None else None
        plans = []
        for match in matches:
            if match.spec is None:
                report.blocks.append(_block_report(match, "native", None))
                continue
            if match.module in _PATCHED:
                raise RuntimeError(
                    f"block {match.name!r} is already accelerated through another enable_for_model call "
                    "(on a parent or child module); disable that one first"
                )
            choice = ops.choose(match.spec, cfg, name=match.name)
            if isinstance(choice.runner, ops.NativeExperts):
                choice.runner.trim = trim
            else:  # (reads the holder at each call: set_top_k can change it)
                choice = replace(choice, runner=_trimmed_reference(trim_holder))
            plans.append((match, choice))
        if any(isinstance(c.runner, ops.NativeExperts) for _, c in plans):
            ops.apply_pool(cfg)  # process-wide: here, not in choose (which only decides)
        tier_state = tiering.setup(model, plans, cfg)
        if cfg.strict and report.native:
            names = ", ".join(f"{b.name} ({b.reason})" for b in report.native)
            raise RuntimeError(f"strict=True and some MoE blocks cannot be accelerated: {names}")
        patched: list = []
        # a bar on terminals only (disable=None), and only when there is real packing to wait for
        bar = tqdm(plans, desc=f"hi_na_moe: packing experts ({cfg.weights})", unit="block", leave=False,
                   disable=None if sum(isinstance(c.runner, ops.NativeExperts) for _, c in plans) > 1 else True)
        # held while weights are released: forwards reaching a patched block wait for the end
        gate = _Gate()
        gate.acquire_write(DRAIN_TIMEOUT_S, "enable_for_model")
        dense_done: list = []
        try:
            holders = ops.storage_holders(model) if not cfg.keep_weights else None
            for match, choice in bar:
                report.blocks.append(_patch_block(match, choice, cfg, gate, patched, _prepare, holders, trim_holder))
                for _, _, done in patched[:-1]:  # the originals a block released, once the next is packed
                    if isinstance(done.runner, ops.NativeExperts):
                        done.runner.bury()
            tiering.finish(model, tier_state, plans)
            if cfg.scope == Scope.ALL:
                if native_module()[0] is None:
                    raise RuntimeError(f"hi_na_moe: scope='all' needs the native kernels: {native_module()[1]}")
                dense_done, report.dense, small = orchestrate.patch(model, cfg, gate, [m.module for m, _ in plans], _gated)
                report.norms, report.norms_differ = small["norms"]
                report.routers, report.routers_differ = small["routers"]
                mods = dict(model.named_modules())
                report.routers_select_pytorch = [n for n in report.routers
                                                 if getattr(patched_runner(mods[n]), "select", None) is None]
                report.attention, report.attention_differ = small["attention"]
                report.attention_latent, report.attention_latent_differ = small["attention_latent"]
                report.attention_latent_bytes = sum(patched_runner(mods[n]).extra_bytes()
                                                    for n in report.attention_latent)
                report.attention_latent_quant = sum(patched_runner(mods[n]).reads_codes()
                                                    for n in report.attention_latent)
                report.attention_latent_prefill = [n for n in report.attention_latent
                                                   if patched_runner(mods[n]).prefill]
                report.mlps, report.mlps_differ = small["mlps"]
                report.layers, report.layers_differ = small["layers"]
                report.stacks, report.stacks_differ = small["stacks"]
                report.causal_lms, report.causal_lms_differ = small["causal_lms"]
                for name in report.stacks:
                    runner = patched_runner(mods[name])
                    why = runner.one_call_blocker()
                    if why is not None:
                        report.stacks_loop_only[name] = why
                    why = runner.rope.blocker()
                    if why is not None:
                        report.stacks_rotary_module[name] = why
                if report.attention or report.attention_latent:
                    report.attention_math = math_kernel(ops._isa_name(cfg))
                    report.attention_prefill = [n for n in report.attention
                                                if getattr(patched_runner(mods[n]), "prefill", False)]
                    report.attention_prefill_math = prefill_math(ops._isa_name(cfg))
            tiering.settle(tier_state, plans, cfg)  # (after every probe forward)
            report.memory_tier = tiering.report_lines(tier_state)
        except BaseException:
            # leave the model exactly as it was (a block that cannot be restored stays enabled,
            # so that disable_for_model can be tried again)
            failed = _unpatch(patched)
            if failed:
                _ROOTS[model] = ([item for item, _ in failed], report)
                _GATES[model] = gate
            else:
                gate.active = False
                tiering.drop(model)
            raise
        finally:
            for _, _, done in patched:
                if isinstance(done.runner, ops.NativeExperts):
                    done.runner.bury()
            gate.release_write()
        # keep the module order of discovery in the report
        order = {match.name: i for i, match in enumerate(matches)}
        report.blocks.sort(key=lambda b: order[b.name])
        if any(isinstance(c.runner, ops.NativeExperts) for _, c in plans):
            native = native_module()[0]
            report.pool = native.pool_backend()
            if report.pool.startswith("own") and native.pool_hosting() and native.openmp_runtime():
                report.pool_hosted = native.openmp_runtime()
        if report.accelerated or report.dense:
            report.embeddings_read, report.embeddings_read_bytes, report.embeddings_read_s = read_in_embeddings(model)
        for _, _, choice in patched:  # the counts start at the user's first call, not enable's probes
            if isinstance(choice.runner, ops.NativeExperts) and choice.runner.packed is not None:
                choice.runner.packed.routing_counts(reset=True)
        _ROOTS[model] = (patched, report)
        _GATES[model] = gate
        _DENSE[model] = dense_done
        _TRIMS[model] = trim_holder
    return report


def set_top_k(model: nn.Module, top_k: int | str = "model", *, threshold: float | None = None,
              min_k: int | None = None, renorm: str | None = None) -> str:
    """Change how many experts a token uses (HinaConfig's top_k, top_k_threshold, top_k_min,
    top_k_renorm; unset keyword: the enable's value) on an enabled model, without re-enabling:
    every block's trim is switched between forwards (they wait at the model's gate meanwhile), and
    the routing counts behind stats()'s experts_per_token start again at zero. Returns what the
    trim now does. ConfigError for a bad value; RuntimeError when the model is not enabled."""
    with _LOCK:
        if model not in _ROOTS:
            raise RuntimeError(f"hi_na_moe is not enabled on this {type(model).__name__}: set_top_k changes an "
                               "enabled model (enable_for_model(model, top_k=...) enables with one)")
        patched, report = _ROOTS[model]
        keys = {k: v for k, v in (("top_k", top_k), ("top_k_threshold", threshold), ("top_k_min", min_k),
                                  ("top_k_renorm", renorm)) if v is not None}
        cfg = HinaConfig(**{**{k: report.config[k] for k in ("top_k", "top_k_threshold", "top_k_min", "top_k_renorm")},
                            **keys})
        trim = trim_mod.from_config(cfg, model)
        gate = _GATES[model]
        gate.acquire_write(DRAIN_TIMEOUT_S, "set_top_k")
        try:
            for _, _, choice in patched:
                r = choice.runner
                if isinstance(r, ops.NativeExperts):
                    r.trim = trim
                    if r.packed is not None and not r.spec.n_identity:
                        r.packed.set_trim(*(trim.native_args() if trim is not None else ("full",)))
                    if r.packed is not None:
                        r.packed.routing_counts(reset=True)
            holder = _TRIMS.get(model)
            if holder is not None:
                holder.trim = trim
            report.config.update({k: getattr(cfg, k) for k in ("top_k", "top_k_threshold", "top_k_min", "top_k_renorm")})
            report.top_k = trim.describe() if trim is not None else None
        finally:
            gate.release_write()
    return report.top_k or "top_k='model': every expert the router chose"


def native_runners(model: nn.Module) -> list[tuple[str, ops.NativeExperts]]:
    """(block name, runner) of the enabled model's blocks packed for the native kernels, in
    discovery order; [] when the model is not enabled."""
    entry = _ROOTS.get(model)
    if entry is None:
        return []
    return [(match.name, c.runner) for _, match, c in entry[0]
            if isinstance(c.runner, ops.NativeExperts) and c.runner.packed is not None]


def stats(model: nn.Module) -> dict[str, Any]:
    """hi_na_moe.stats(model): what the enabled model's experts have run.

    - "experts_per_token": the expert slots the native kernels ran per token, over every call of
      every natively run block since enable (after HinaConfig.top_k's trim; the model's k when
      top_k="model"), or None before any call; "routing": the same per block, with its tokens and
      slots. Blocks on the PyTorch reference path are not counted.
    - "top_k": the config's top_k.
    - the memory tier's counters (hits, misses, bytes_read, prefetch_precision, prefetch_recall,
      io_wait_s, ...; per layer under "layers") with "memory_tier": True, or "memory_tier": False
      and "why" when the model runs without one.
    """
    out = tiering.tier_stats(model)
    entry = _ROOTS.get(model)
    routing = {}
    for name, runner in native_runners(model):
        tokens, slots = runner.routing_counts()
        routing[name] = {"tokens": tokens, "slots": slots, "experts_per_token": slots / tokens if tokens else None}
    tokens = sum(r["tokens"] for r in routing.values())
    out["experts_per_token"] = sum(r["slots"] for r in routing.values()) / tokens if tokens else None
    out["routing"] = routing
    out["top_k"] = entry[1].config.get("top_k") if entry is not None else None
    return out


def disable_for_model(model: nn.Module) -> EnableReport:
    """Undo enable_for_model exactly: every patched block gets back its own forward. Returns the
    report of the enable being undone.

    Forwards running on other threads are waited for (up to DRAIN_TIMEOUT_S, then a
    RuntimeError, the model still enabled); forwards starting meanwhile wait, then run the
    blocks' own code. Called from inside a forward of the same model: a RuntimeError."""
    with _LOCK:
        if model not in _ROOTS:
            raise RuntimeError(
                f"hi_na_moe is not enabled on this {type(model).__name__} (call disable_for_model on the "
                "same module that was passed to enable_for_model)"
            )
        patched, report = _ROOTS[model]
        gate = _GATES[model]
        gate.acquire_write(DRAIN_TIMEOUT_S, "disable_for_model")
        try:
            if _DENSE.get(model):
                dense_failed = orchestrate.unpatch(_DENSE[model])
                _DENSE[model] = [item for item, _ in dense_failed]
                if dense_failed:
                    (_, runner, _), exc = dense_failed[0]
                    raise RuntimeError(
                        f"hi_na_moe: disable_for_model could not restore {len(dense_failed)} dense linear layer(s), "
                        f"first {runner.name!r}: {exc}. Those stay enabled and working (the other dense layers are "
                        "restored, the MoE blocks not yet); disable_for_model can be called again"
                    ) from exc
            failed = _unpatch(patched)
            if failed:
                # those blocks still run on their packed copy; disable can be tried again
                _ROOTS[model] = ([item for item, _ in failed], report)
                (_, match, _), exc = failed[0]
                raise RuntimeError(
                    f"hi_na_moe: disable_for_model restored {len(patched) - len(failed)} of {len(patched)} MoE "
                    f"block(s); {match.name!r} could not be restored ({exc}); the block(s) not restored stay "
                    "enabled and working, and disable_for_model can be called again"
                ) from exc
            del _ROOTS[model]
            del _GATES[model]
            _DENSE.pop(model, None)
            _TRIMS.pop(model, None)
            tiering.drop(model)
            gate.active = False
        finally:
            gate.release_write()
    return report


def is_enabled(model: nn.Module) -> bool:
    return model in _ROOTS


def report_for(model: nn.Module) -> EnableReport | None:
    """The EnableReport of the enable currently active on `model` (None if not enabled)."""
    entry = _ROOTS.get(model)
    return entry[1] if entry is not None else None


