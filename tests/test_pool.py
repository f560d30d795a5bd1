"""The kernels' thread-pool backends (config key `pool`): the library's own workers, or the team
of the GNU OpenMP runtime PyTorch loaded. Same results on both, named in the report, safe from
several Python threads and in a forked child. (Their speed is a benchmark:
benchmarks/bench_native_paths.py, RESULTS.md "Thread pool backends".)"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

import hi_na_moe
from hi_na_moe.core.config import ConfigError
from hi_na_moe.core.native import native_module, pool_description

_native, _why = native_module()
pytestmark = pytest.mark.skipif(_native is None, reason=f"native library not loaded: {_why}")

E, H, I, K = 10, 96, 80, 3


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    _native.set_pool_backend("auto")


def _problem(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    tw = torch.rand(T, K, generator=g)
    return w, x, idx, tw


def _run(pe, x, idx, tw, threads=2):
    out = torch.empty_like(x)
    pe.forward(x, idx, tw, out, num_threads=threads)
    return out


def test_torch_brings_a_libgomp_and_auto_uses_it():
    runtime = _native.openmp_runtime()
    if not runtime:
        pytest.skip("this PyTorch build loads no GNU OpenMP runtime")
    assert "libgomp" in runtime
    _native.set_pool_backend("auto")
    assert _native.pool_backend() == f"openmp ({runtime})"
    _native.set_pool_backend("own")
    assert _native.pool_backend() == "own"
    assert pool_description("own") == "own"
    assert pool_description("auto") == f"openmp ({runtime})"


@pytest.mark.parametrize("T", [1, 9, 40])
def test_backends_give_bit_identical_results(T):
    """(T=40 is prefill-sized, kMixedTeamRows: "mixed" runs it on OpenMP's team, T=1 and 9 on the
    own workers.)"""
    (g, u, d), x, idx, tw = _problem(T)
    pe = _native.PackedExperts(g, u, d)
    outs = {}
    for backend in ("own", "openmp", "auto", "mixed"):
        _native.set_pool_backend(backend)
        outs[backend] = _run(pe, x, idx, tw)
    for backend in ("openmp", "auto", "mixed"):
        assert torch.equal(outs["own"], outs[backend]), backend


def test_bad_backend_names_the_choices():
    with pytest.raises(ValueError, match="'auto', 'own', 'openmp' or 'mixed'"):
        _native.set_pool_backend("gomp")
    with pytest.raises(ConfigError, match=r"config key 'pool'.*did you mean 'openmp'"):
        hi_na_moe.load_config(pool="opnmp")


def test_enable_applies_the_pool_and_reports_it(monkeypatch):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    model = OlmoeForCausalLM(cfg).eval()
    rep = hi_na_moe.enable_for_model(model, pool="own")
    try:
        assert rep.pool == "own" and _native.pool_backend() == "own"
        assert "kernel threads: own" in str(rep)
        assert rep.to_dict()["pool"] == "own"
    finally:
        hi_na_moe.disable_for_model(model)
    monkeypatch.setenv("HINA_MOE_POOL", "openmp")
    rep = hi_na_moe.enable_for_model(model)
    try:
        assert rep.config["pool"] == "openmp"
        assert rep.pool == pool_description("openmp") == _native.pool_backend()
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("scope", ["experts", "all"])
def test_auto_pool_is_the_own_workers_with_prefill_on_openmp_under_scope_all(scope):
    """scope="all" runs a decode step in one native call (hosted on OpenMP's team, with a
    backoff to the own workers): auto takes the own workers there with prefill-sized calls on
    OpenMP's team ("mixed"), OpenMP's team otherwise."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    model = OlmoeForCausalLM(cfg).eval()
    want = pool_description("mixed" if scope == "all" else "auto")
    assert hi_na_moe.load_config(scope=scope).kernel_pool() == ("mixed" if scope == "all" else "auto")
    assert pool_description("mixed") == f"own, prefill-sized calls on openmp ({_native.openmp_runtime()})"
    rep = hi_na_moe.enable_for_model(model, scope=scope)
    try:
        assert rep.config["pool"] == "auto"
        assert rep.pool == want == _native.pool_backend()
    finally:
        hi_na_moe.disable_for_model(model)
        _native.set_pool_backend("auto")
    assert hi_na_moe.load_config(scope=scope, pool="openmp").kernel_pool() == "openmp"


def test_a_scope_all_decode_step_is_hosted_on_openmps_team_with_the_same_bits(monkeypatch):
    """On the own workers, the one native call of a decode step runs its regions on the loaded
    libgomp's team (ThreadPool::host; its C++ tests are in csrc/tests/test_pool.cpp): the same
    logits and cache as on the own workers (set_pool_hosting(False))."""
    from tiny_models import greedy_decode, olmoe

    from hi_na_moe.fastpath import linear

    if torch.get_num_threads() < 2:
        pytest.skip("one kernel thread (OMP_NUM_THREADS=1 or one CPU): a step's regions have no team to be hosted on")
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert _native.pool_backend().startswith("own") and _native.pool_hosting()
        assert rep.pool_hosted == _native.openmp_runtime() != "" and rep.to_dict()["pool_hosted"] == rep.pool_hosted
        assert f"those calls' threads: {rep.pool_hosted}'s team, hosted" in str(rep)
        _native._pool_host_reset_for_test()  # (a backoff an earlier test started ends here)
        before = _native.pool_stats()
        got, cache = greedy_decode(model, ids, 8)
        after = _native.pool_stats()
        # (not every step: one that found the team held off its cores, this machine being
        # shared, keeps the next ones on the own workers)
        assert after["hosted_calls"] > before["hosted_calls"]
        _native.set_pool_hosting(False)
        try:
            want, want_cache = greedy_decode(model, ids, 8)
            assert _native.pool_stats()["hosted_calls"] == after["hosted_calls"]
        finally:
            _native.set_pool_hosting(True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for a, b in zip(cache.layers, want_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("backend", ["own", "openmp"])
def test_python_threads_at_once_match_serial(backend):
    _native.set_pool_backend(backend)
    problems = [_problem(T, seed) for seed, T in enumerate((1, 5, 1, 12))]
    packs = [_native.PackedExperts(*p[0]) for p in problems]
    serial = [_run(pe, p[1], p[2], p[3]) for pe, p in zip(packs, problems)]
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            for rep in range(20):
                j = (i + rep) % len(packs)  # the same PackedExperts from several threads too
                p = problems[j]
                results[(i, rep)] = (j, _run(packs[j], p[1], p[2], p[3]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for j, out in results.values():
        assert torch.equal(out, serial[j])


_FORK_PROBLEM: dict = {}


def _child(backend, q):
    # Only our op here: PyTorch's own parallel ops hang in a child forked after its OpenMP team
    # ran (a libgomp limitation), so the inputs were made in the parent.
    try:
        _native.set_pool_backend(backend)
        pe, x, idx, tw = _FORK_PROBLEM["args"]
        q.put(_run(pe, x, idx, tw).float().sum().item())
    except BaseException as exc:
        q.put(repr(exc))


@pytest.mark.parametrize("backend", ["own", "openmp"])
def test_forked_child_runs_the_op(backend):
    _native.set_pool_backend(backend)
    (g, u, d), x, idx, tw = _problem(7)
    pe = _native.PackedExperts(g, u, d)
    parent = _run(pe, x, idx, tw).float().sum().item()  # both pools now have threads
    _FORK_PROBLEM["args"] = (pe, x, idx, tw)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(backend, q))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
    assert proc.exitcode == 0, "forked child hung or crashed"
    assert q.get(timeout=5) == parent
