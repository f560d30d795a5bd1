"""Routing replay (hi_na_moe.fastpath.replay; hina::set_route_replay in csrc/moe/layer_step.cpp),
the test-only hook that makes a model's routers choose a recorded trace's experts (issue 42).

What must hold: with the replay on, every MoE layer selects the trace's experts for every token,
in the one-call native decode step (scope="all"), in the per-block path (scope="experts", and
prefill) and for batched rows with their own offsets; the outputs equal a plain transformers
model whose routers get the same logits from a forward hook of the test's own; with the replay
off the model routes as before, bit for bit; a trace that cannot drive the model is refused
naming what does not fit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import olmoe
from transformers import DynamicCache

import hi_na_moe
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.fastpath.replay import ReplayError, replay_routing

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="the replay's decode step is native")

LAYERS, E, K = 3, 16, 4
TRACE_LAYERS, TRACE_TOKENS = 2, 64
OFFSETS = [0, 37]  # the two rows' first trace tokens


def _trace(seed: int = 1) -> np.ndarray:
    """[TRACE_LAYERS, TRACE_TOKENS, K] distinct random experts a token (fewer layers than the model)."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(TRACE_TOKENS)])
                     for _ in range(TRACE_LAYERS)])


@pytest.fixture(scope="module")
def _plain():
    return olmoe(layers=LAYERS, experts=E, top_k=K, dtype=torch.float32)


def _inputs(rows: int):
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, 500, (rows, 6), generator=g), torch.randint(3, 500, (rows, 4), generator=g)


def _run(model, prompt, steps):
    """Logits of the prompt and of each decode step, its tokens fed one at a time (teacher forced:
    both models see the same tokens)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = [model(prompt, past_key_values=cache, use_cache=True).logits]
        for t in range(steps.shape[1]):
            out.append(model(steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return out


class _Reference:
    """The plain model's routers given the replayed logits by a gate forward hook: OLMoE's router
    (softmax in float32, top k, renormalised, cast to the logits' dtype) on 0.125 (k - j) at the
    j-th replayed expert and -1e4 elsewhere. Positions: row b at offsets[b] + the tokens seen."""

    def __init__(self, model, table, offsets):
        self.table, self.offsets, self.seen, self.shape = table, offsets, 0, None
        self.hooks = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                      model.register_forward_hook(self.after)]
        for l, layer in enumerate(model.model.layers):
            self.hooks.append(layer.mlp.gate.register_forward_hook(self.gate_hook(l)))

    def before(self, module, args, kwargs):
        self.shape = args[0].shape if args else kwargs["input_ids"].shape

    def after(self, module, args, output):
        self.seen += self.shape[1]

    def gate_hook(self, layer):
        def hook(module, args, output):
            B, S = self.shape
            pos = [self.offsets[b] + self.seen + s for b in range(B) for s in range(S)]
            ids = torch.from_numpy(self.table[layer, pos].astype(np.int64))
            logits = torch.full((B * S, E), -1e4, dtype=output[0].dtype)
            logits.scatter_(1, ids, (0.125 * torch.arange(K, 0, -1, dtype=torch.float32)).to(logits.dtype).expand(B * S, K))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, K, dim=-1)
            top = (top / top.sum(-1, keepdim=True)).to(logits.dtype)
            assert torch.equal(idx, ids)  # the graded logits order the top k as replayed
            return logits, top, idx
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def _expected(table, forwards):
    """Per forward (rows, tokens) and layer: the experts of each row's tokens, rows then tokens."""
    out, seen = [], 0
    for B, S in forwards:
        pos = [OFFSETS[b] + seen + s for b in range(B) for s in range(S)]
        out.append([table[l, pos] for l in range(LAYERS)])
        seen += S
    return out


def test_the_table_gives_each_layer_a_permutation_of_its_trace_layer(_plain):
    from hi_na_moe.fastpath.replay import RoutingReplay
    trace = _trace()
    rp = RoutingReplay(_plain, trace, cycle_layers=True, seed=3)
    assert rp.table.shape == (LAYERS, TRACE_TOKENS, K)
    maps = []
    for l in range(LAYERS):
        pairs = set(zip(trace[l % TRACE_LAYERS].ravel().tolist(), rp.table[l].ravel().tolist()))
        f = dict(pairs)
        assert len(f) == len(pairs) and len(set(f.values())) == len(f)  # a bijection of the ids used
        maps.append(f)
    assert maps[0] != maps[2]  # layers 0 and 2 read trace layer 0 through different permutations
    same = RoutingReplay(_plain, trace, cycle_layers=True, permute=False)
    assert np.array_equal(same.table[2], trace[0])


@pytest.mark.parametrize("scope,weights", [("all", "lossless"), ("experts", "int4")])
@pytest.mark.parametrize("rows", [1, 2])
def test_every_layer_selects_the_replayed_experts(_plain, scope, weights, rows, tmp_path):
    model = copy.deepcopy(_plain)
    prompt, steps = _inputs(rows)
    hi_na_moe.enable_for_model(model, weights=weights, scope=scope, cache_dir=str(tmp_path))
    try:
        with replay_routing(model, _trace(), cycle_layers=True, seed=3, row_offsets=OFFSETS) as rp:
            _run(model, prompt, steps)
    finally:
        hi_na_moe.disable_for_model(model)
    forwards = [(rows, prompt.shape[1])] + [(rows, 1)] * steps.shape[1]
    want = _expected(rp.table, forwards)
    assert len(rp.chosen) == len(forwards)
    for f, (got_f, want_f) in enumerate(zip(rp.chosen, want)):
        for l in range(LAYERS):
            assert got_f[l] is not None, f"forward {f} layer {l}: its selection was not seen"
            assert np.array_equal(got_f[l], want_f[l]), f"forward {f} layer {l}"
            assert rp.accesses[f][l] == tuple(np.unique(want_f[l]))
    # where the decode steps' routing ran: scope="all" takes the one-call native step
    decode = {s for f in rp.served_by[1:] for s in f}
    assert decode == ({"native"} if scope == "all" else {"python"})


@pytest.mark.parametrize("scope", ["all", "experts"])
def test_outputs_with_the_replay_equal_the_plain_model_given_the_same_logits(_plain, scope, tmp_path):
    prompt, steps = _inputs(2)
    model = copy.deepcopy(_plain)
    hi_na_moe.enable_for_model(model, weights="lossless", scope=scope, cache_dir=str(tmp_path))
    try:
        with replay_routing(model, _trace(), cycle_layers=True, seed=3, row_offsets=OFFSETS) as rp:
            got = _run(model, prompt, steps)
    finally:
        hi_na_moe.disable_for_model(model)
    ref = _Reference(_plain, rp.table, OFFSETS)
    try:
        want = _run(_plain, prompt, steps)
    finally:
        ref.remove()
    plain = _run(_plain, prompt, steps)
    for i, (a, b, c) in enumerate(zip(got, want, plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"output {i}: {m}")
        assert not torch.allclose(b, c, rtol=1e-2, atol=1e-3), f"output {i}: the replay changed nothing"


def test_the_replay_off_restores_the_models_own_routing(_plain, tmp_path):
    prompt, steps = _inputs(2)
    model = copy.deepcopy(_plain)
    hi_na_moe.enable_for_model(model, weights="lossless", scope="all", cache_dir=str(tmp_path))
    try:
        before = _run(model, prompt, steps)
        with replay_routing(model, _trace(), cycle_layers=True, row_offsets=OFFSETS):
            during = _run(model, prompt, steps)
        after = _run(model, prompt, steps)
    finally:
        hi_na_moe.disable_for_model(model)
    for a, b, c in zip(before, during, after):
        assert torch.equal(a, c)
    assert not all(torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(before, during))


@pytest.mark.parametrize("case,want", [
    ("layers", r"trace has 2 layers and the model 3 MoE layers: pass cycle_layers=True"),
    ("k", r"chooses k=3 experts a token and router model\.layers\.0\.mlp\.gate 4"),
    ("experts", r"trace is of 32 experts and the model's routers choose among 16"),
    ("end", r"row 1 would replay trace token 64 and the trace has 64: .*wrap=True"),
    ("rows", r"a row 1 and row_offsets names 1 rows"),
    ("file", r"no such file"),
    ("shape", r"\[layers, tokens, k\] expert ids, got shape \(64, 4\)"),
])
def test_a_trace_that_cannot_drive_the_model_is_refused_naming_why(_plain, case, want, tmp_path):
    trace, kw = _trace(), dict(cycle_layers=True, row_offsets=OFFSETS)
    if case == "layers":
        kw.pop("cycle_layers")
    elif case == "k":
        trace = trace[:, :, :3]
    elif case == "experts":
        path = tmp_path / "t.npz"
        np.savez(path, top_k_index=trace.astype(np.int16), num_experts=np.int32(32), seq_len=np.int32(16))
        trace = str(path)
    elif case == "end":
        kw["row_offsets"] = [0, 60]
    elif case == "rows":
        kw["row_offsets"] = [0]
    elif case == "file":
        trace = str(tmp_path / "none.npz")
    elif case == "shape":
        trace = trace[0]
    prompt, _ = _inputs(2)
    with pytest.raises(ReplayError, match=want):
        with replay_routing(_plain, trace, **kw), torch.inference_mode():
            _plain(prompt)


def test_wrap_continues_from_the_traces_start(_plain):
    prompt, _ = _inputs(2)
    with replay_routing(_plain, _trace(), cycle_layers=True, row_offsets=[0, 60], wrap=True) as rp, \
            torch.inference_mode():
        _plain(prompt)
    pos = [0, 1, 2, 3, 4, 5, 60, 61, 62, 63, 0, 1]
    for l in range(LAYERS):
        assert np.array_equal(rp.chosen[0][l], rp.table[l, pos])


def test_an_npz_trace_maps_its_windows_to_the_rows(_plain, tmp_path):
    path = tmp_path / "trace.npz"
    np.savez(path, top_k_index=_trace().astype(np.int16), num_experts=np.int32(E), seq_len=np.int32(16))
    prompt, _ = _inputs(2)
    with replay_routing(_plain, str(path), cycle_layers=True) as rp, torch.inference_mode():
        _plain(prompt)
    pos = [0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21]  # row b from window b (seq_len 16)
    for l in range(LAYERS):
        assert np.array_equal(rp.chosen[0][l], rp.table[l, pos])
