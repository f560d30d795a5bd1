"""Routing replay: a model's routers choose the experts of a recorded routing trace instead of
their own. For benchmarks and tests only (issue 42: caching judged on real routing at a shape no
trained model here has); not a user feature, and not thread-safe.

    with replay_routing(model, "trace.npz", cycle_layers=True) as rp:
        model(ids)  # every MoE layer selects the trace's experts
    rp.accesses     # per forward and MoE layer, the experts it asked for

How. Each router's logits are replaced, right after its linear, by 0.125 (k - j) at the j-th
replayed expert of each row and -1e4 elsewhere: every rule after them (softmax, top-k,
renormalisation, the memory tier's acquire, a batch's union) runs unchanged and selects exactly
the replayed experts, in that order. The weights are those graded logits' (the softmax of 1.0,
0.875, ... for k = 8), not the trace model's. Three places compute logits, all covered:
- the native decode step (scope="all": csrc/moe/layer_step.cpp, hina::set_route_replay): the
  replayed ids of the forward [MoE layers, rows, k] sit in one buffer; each router the native
  step runs takes the next layer (a cursor) and records what router_select chose (`chosen`);
- a router patched by hi_na_moe (fastpath.routers.NativeRouter), called from Python or by its
  module: NativeRouter.replay runs the router's form on the replayed logits;
- a router left to PyTorch (scope="experts", or a plain model): a forward hook replaces its
  output with the same form (found by NativeRouter.matches, which checks it reproduces the
  module bit for bit) on the replayed logits.
Each of the last two sets the native cursor past its layer, so the layers of one forward may mix
the three. After every forward the replay checks each MoE layer took the replayed routing exactly
once (else RuntimeError: a path computed routing elsewhere).

The trace: `top_k_index` [layers, tokens, k] (an .npz as benchmarks/studies/study_expert_cache.py
writes it, with `num_experts` and `seq_len`, or an array). MoE layer l of the model replays trace
layer l; a trace with fewer layers is refused unless cycle_layers=True, which gives MoE layer l
trace layer l mod (trace layers). Every layer's expert ids go through a fixed permutation of its
own (seeded; permute=False: none) so that layers reading one trace layer do not share one id
pattern. Token positions: row b of a forward of S tokens per row replays trace tokens
[offset_b + t, offset_b + t + S), t counting the tokens the replay has seen per row so far;
offset_b = b x seq_len (the trace's windows; else tokens // 64) unless `row_offsets` is given.
A position past the trace's end is an error naming it, or wraps to its start with wrap=True.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..core.native import native_module
from ..core.registry import patched_runner
from .routers import NativeRouter, find_routers


class ReplayError(ValueError):
    """A trace that cannot drive this model's routing."""


def load_trace(trace) -> tuple[np.ndarray, int | None, int | None]:
    """(ids [layers, tokens, k] int64, num_experts or None, seq_len or None) of an .npz path or an array."""
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        if not path.is_file():
            raise ReplayError(f"routing trace {str(path)!r}: no such file (an .npz with top_k_index [layers, tokens, k])")
        with np.load(path) as z:
            if "top_k_index" not in z.files:
                raise ReplayError(f"routing trace {str(path)!r} has no top_k_index array (it has {', '.join(z.files)})")
            ids = z["top_k_index"].astype(np.int64)
            E = int(z["num_experts"]) if "num_experts" in z.files else None
            seq = int(z["seq_len"]) if "seq_len" in z.files else None
    else:
        ids, E, seq = np.asarray(trace.detach().cpu() if hasattr(trace, "detach") else trace).astype(np.int64), None, None
    if ids.ndim != 3 or 0 in ids.shape:
        raise ReplayError(f"a routing trace is [layers, tokens, k] expert ids, got shape {tuple(ids.shape)}")
    if ids.min() < 0:
        raise ReplayError("the routing trace has negative expert ids: every token must route to k experts")
    return ids, E, seq


class RoutingReplay:
    """The state of one replay_routing (module docstring). After each forward: `accesses` gains,
    per MoE layer, the sorted experts its rows asked for (their union: what a batched step
    acquires), `chosen` the experts each layer's selection returned where it was seen (the
    native step's router_select, the Python form; else None), `served_by` where each layer's
    routing ran ("native" or "python"), and `tokens` counts each row's tokens."""

    def __init__(self, model: nn.Module, trace, cycle_layers: bool = False, permute: bool = True, seed: int = 0,
                 row_offsets=None, wrap: bool = False):
        ids, E_trace, seq = load_trace(trace)
        found, _ = find_routers(model, exclude="")
        if not found:
            raise ReplayError(f"{type(model).__name__} has no router module to replay (a *Router with a weight)")
        self.routers: list[tuple[str, nn.Module, NativeRouter, bool]] = []  # (name, module, runner, patched)
        for name, m in found:
            runner = patched_runner(m)
            patched = isinstance(runner, NativeRouter)
            if not patched:
                runner = NativeRouter(name, m, m.forward)
                if not runner.matches():
                    raise ReplayError(f"router {name} ({type(m).__name__}) computes no form the replay knows "
                                      "(fastpath.routers): its logits cannot be replaced")
            self.routers.append((name, m, runner, patched))
        L, (Lt, T, k) = len(self.routers), ids.shape
        E = self.routers[0][2].experts
        if Lt < L and not cycle_layers:
            raise ReplayError(f"the routing trace has {Lt} layers and the model {L} MoE layers: pass "
                              f"cycle_layers=True to give MoE layer l trace layer l mod {Lt}, or a trace of {L} layers")
        for name, m, r, _ in self.routers:
            if r.experts != E:
                raise ReplayError(f"router {name} has {r.experts} experts and the first {E}: the replay takes one E")
            rk = self._top_k(r)
            if rk != k:
                raise ReplayError(f"the routing trace chooses k={k} experts a token and router {name} {rk}: "
                                  "record the trace from a model of the same top-k")
        if (E_trace is not None and E_trace != E) or int(ids.max()) >= E:
            raise ReplayError(f"the routing trace is of {E_trace or int(ids.max()) + 1} experts and the model's "
                              f"routers choose among {E}: record it from a model of the same number of experts")
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(E) if permute else np.arange(E) for _ in range(L)]
        # table[l, t] = MoE layer l's experts at trace token t
        self.table = np.stack([perms[l][ids[l % Lt]] for l in range(L)]).astype(np.int32)
        self.layers, self.tokens_in_trace, self.k, self.experts = L, T, k, E
        stride = seq if seq else max(1, T // 64)
        self._offsets = None if row_offsets is None else [int(o) for o in row_offsets]
        self._stride, self.wrap = stride, wrap
        self.tokens = 0
        self.accesses: list[list[tuple[int, ...]]] = []
        self.chosen: list[list[np.ndarray | None]] = []
        # per forward and MoE layer: where its routing ran ("native": the native decode step's router)
        self.served_by: list[list[str]] = []
        self._native = native_module()[0]
        self._index = {id(m): i for i, (_, m, _, _) in enumerate(self.routers)}
        self._ids: torch.Tensor | None = None
        self._chosen: torch.Tensor | None = None
        self._py_chosen: dict[int, np.ndarray] = {}
        self._hooks: list = []
        self._model = model

    @staticmethod
    def _top_k(r: NativeRouter) -> int:
        with torch.no_grad():
            h = torch.zeros(2, r.hidden, dtype=r.wdtype)
            bias = r._probe_bias if r.bias_arg else (r._bias() if r.biased else None)
            _, _, idx = r.form(lambda x: torch.zeros(x.shape[0], r.experts, dtype=x.dtype), h, bias)
        return int(idx.shape[-1])

    def offset(self, row: int) -> int:
        if self._offsets is None:
            return row * self._stride
        if row >= len(self._offsets):
            raise ReplayError(f"the forward has a row {row} and row_offsets names {len(self._offsets)} rows: "
                              "give an offset for every row")
        return self._offsets[row]

    def positions(self, B: int, S: int) -> np.ndarray:
        """[B, S] trace tokens the next forward of B rows of S tokens replays."""
        pos = np.array([[self.offset(b) + self.tokens + s for s in range(S)] for b in range(B)], dtype=np.int64)
        if self.wrap:
            return pos % self.tokens_in_trace
        if pos.size and pos.max() >= self.tokens_in_trace:
            b = int(np.argwhere(pos >= self.tokens_in_trace)[0][0])
            raise ReplayError(f"row {b} would replay trace token {int(pos[b][pos[b] >= self.tokens_in_trace][0])} "
                              f"and the trace has {self.tokens_in_trace}: decode fewer tokens or rows, give row_offsets, or pass "
                              "wrap=True to continue from the trace's start")
        return pos

    # ---- hooks ---------------------------------------------------------------------------------
    def _before(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ReplayError("the routing replay reads each forward's rows and tokens from input_ids or "
                              "inputs_embeds [batch, tokens, ...]; this call has neither")
        B, S = int(x.shape[0]), int(x.shape[1])
        pos = self.positions(B, S).reshape(-1)
        self._ids = torch.from_numpy(np.ascontiguousarray(self.table[:, pos, :]))  # [L, B S, k]
        self._chosen = torch.full(self._ids.shape, -1, dtype=torch.int64)
        self._py_chosen = {}
        self._native.set_route_replay(self._ids.data_ptr(), self.layers, B * S, self.k, self._chosen.data_ptr())
        self._shape = (B, S)

    def _after(self, module, args, kwargs, output):
        nat = self._native
        served, errors = nat.route_replay_cursor(), nat.route_replay_errors()
        nat.set_route_replay(0)
        if errors or served != self.layers:
            raise RuntimeError(f"routing replay: {served} router calls for {self.layers} MoE layers in this forward, "
                               f"{errors} of them unserved (more rows than the forward's, or a selection of another "
                               "k): a path computed routing outside the replay")
        ids, chosen = self._ids.numpy(), self._chosen.numpy()
        self.accesses.append([tuple(np.unique(ids[l])) for l in range(self.layers)])
        self.chosen.append([self._py_chosen.get(l, chosen[l] if (chosen[l] >= 0).all() else None)
                            for l in range(self.layers)])
        self.served_by.append(["python" if l in self._py_chosen else "native" for l in range(self.layers)])
        self.tokens += self._shape[1]

    def logits(self, layer: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The replayed logits of `layer` for the current forward's `rows` rows."""
        if self._ids is None or rows > self._ids.shape[1]:
            raise RuntimeError(f"routing replay: a router of {rows} rows outside a forward of the model "
                               f"({0 if self._ids is None else self._ids.shape[1]} rows)")
        ids = self._ids[layer, :rows].long()
        z = torch.full((rows, self.experts), -1e4, dtype=torch.float32)
        z.scatter_(1, ids, (0.125 * torch.arange(self.k, 0, -1, dtype=torch.float32)).expand(rows, -1))
        return z.to(dtype)

    def _route(self, layer: int, runner: NativeRouter, h: torch.Tensor, bias):
        h2 = h.reshape(-1, runner.hidden)
        out = runner.form(lambda x: self.logits(layer, x.shape[0], x.dtype), h2, bias)
        self._py_chosen[layer] = out[2].detach().numpy().copy()
        self._native.set_route_replay_cursor(layer + 1)
        return out

    def _patched_call(self, runner: NativeRouter, h, *rest):
        bias = runner._bias(rest[0] if rest else None) if runner.biased else None
        return self._route(self._index[id(runner.module)], runner, h, bias)

    def _hook_for(self, layer: int, runner: NativeRouter):
        def hook(module, args, output):
            rest = args[1:]
            bias = runner._bias(rest[0] if rest else None) if runner.biased else None
            return self._route(layer, runner, args[0], bias)
        return hook

    def start(self) -> "RoutingReplay":
        self._hooks.append(self._model.register_forward_pre_hook(self._before, with_kwargs=True))
        self._hooks.append(self._model.register_forward_hook(self._after, with_kwargs=True))
        for i, (_, m, runner, patched) in enumerate(self.routers):
            if patched:
                runner.replay = self._patched_call
            else:
                self._hooks.append(m.register_forward_hook(self._hook_for(i, runner)))
        return self

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for _, _, runner, patched in self.routers:
            if patched:
                runner.replay = None
        self._native.set_route_replay(0)


@contextlib.contextmanager
def replay_routing(model: nn.Module, trace, **kw):
    """While on, `model`'s MoE layers choose the experts of `trace` (module docstring); yields the
    RoutingReplay. For benchmarks and tests only."""
    rp = RoutingReplay(model, trace, **kw).start()
    try:
        yield rp
    finally:
        rp.stop()
