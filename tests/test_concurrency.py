"""Threads: forwards and greedy generation from several threads on one enabled model and on two
enabled models at once give the serial outputs; enable/disable racing forwards is serialised
(README, "Guarantees"): disable waits for forwards inside patched blocks, forwards arriving
while enable or disable works wait at the gate; a wait beyond DRAIN_TIMEOUT_S is a
RuntimeError leaving the model as it was. enable does not look for forwards already inside a
block's own code on other threads (CPython 3.11 cannot show another thread's frames safely):
with keep_weights=True it leaves them alone, and it never reads the other threads' frames.

Every thread is joined with a timeout, so a deadlock fails the test instead of hanging the run.
The only waits on the clock are "this thread is still blocked" checks, which a correct
implementation passes however slow the machine is.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import hi_na_moe
from hi_na_moe.core import ops
from hi_na_moe.integrate import patching
from tiny_models import build_tiny

JOIN_S = 60.0  # a deadlock fails the test after this long
BLOCKED_S = 0.3  # "still blocked after this long" checks


def _tiny(model_type="olmoe", seed=0):
    tiny = build_tiny(model_type, seed=seed)
    return tiny.model, tiny.vocab_size


def _prompts(vocab, n=4, length=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 200), (1, length + i), generator=g) for i in range(n)]


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


class Worker(threading.Thread):
    """Runs fn() `repeat` times (or until `stop` is set), keeping results or the exception."""

    def __init__(self, fn, repeat=1, stop: threading.Event | None = None, start_barrier=None):
        super().__init__(daemon=True)
        self.fn, self.repeat, self.stop, self.barrier = fn, repeat, stop, start_barrier
        self.results, self.error = [], None

    def run(self):
        try:
            if self.barrier is not None:
                self.barrier.wait(JOIN_S)
            n = 0
            while (self.stop is None and n < self.repeat) or (self.stop is not None and not self.stop.is_set()):
                self.results.append(self.fn())
                n += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _join(*threads):
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), f"{t} still running after {JOIN_S} s: deadlock"
    for t in threads:
        if getattr(t, "error", None) is not None:
            raise t.error


def test_generate_from_several_threads_on_one_enabled_model():
    model, vocab = _tiny()
    prompts = _prompts(vocab)
    hi_na_moe.enable_for_model(model)
    try:
        serial = [_generate(model, ids) for ids in prompts]
        barrier = threading.Barrier(len(prompts))
        workers = [Worker(lambda ids=ids: _generate(model, ids), repeat=3, start_barrier=barrier) for ids in prompts]
        for w in workers:
            w.start()
        _join(*workers)
    finally:
        hi_na_moe.disable_for_model(model)
    for w, want in zip(workers, serial):
        assert len(w.results) == 3 and all(torch.equal(r, want) for r in w.results)


def test_one_native_call_decode_steps_from_several_threads(monkeypatch):
    """scope="all": the stack's one native call for every layer (a StepPlan shared by the
    threads, their own caches and scratch), the same tokens as one thread alone; and while the
    threads run, plans replaced by steps of another batch size."""
    from hi_na_moe.fastpath import linear
    from hi_na_moe.core.registry import patched_runner
    from tiny_models import olmoe

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)  # the tiny projections packed: the native calls take them
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    prompts = [torch.tensor([[5 + i, 6, 7, 8 + i]]) for i in range(3)] + [torch.tensor([[1, 2, 3], [4, 5, 6]])]
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        stack = patched_runner(model.model)
        calls = []
        one_call = stack._one_call
        def counted(*a):
            out = one_call(*a)
            calls.append(out is not None)
            return out

        stack._one_call = counted
        serial = [_generate(model, ids) for ids in prompts]
        assert calls == [True] * 3 * len(prompts)  # every decode step of every prompt
        barrier = threading.Barrier(len(prompts))
        workers = [Worker(lambda ids=ids: _generate(model, ids), repeat=4, start_barrier=barrier) for ids in prompts]
        native = ops.native_module()[0]
        native._pool_host_reset_for_test()  # (a backoff an earlier test started ends here)
        hosted = native.pool_stats()["hosted_calls"]
        for w in workers:
            w.start()
        _join(*workers)
        assert all(calls) and len(calls) == 3 * len(prompts) * 5
        # one thread's step at a time runs hosted on OpenMP's team (ThreadPool::host), the
        # others' regions beside it on the same claims (one kernel thread: no team to host on)
        if torch.get_num_threads() > 1:
            assert native.pool_stats()["hosted_calls"] > hosted
    finally:
        hi_na_moe.disable_for_model(model)
    for w, want in zip(workers, serial):
        assert len(w.results) == 4 and all(torch.equal(r, want) for r in w.results)


def test_two_enabled_models_at_once():
    a, vocab_a = _tiny("olmoe")
    b, vocab_b = _tiny("qwen3_moe", seed=3)
    pa, pb = _prompts(vocab_a, n=2), _prompts(vocab_b, n=2, seed=2)
    hi_na_moe.enable_for_model(a)
    hi_na_moe.enable_for_model(b, weights="int8")  # a quantised one, mapped from the store
    try:
        serial = [_generate(a, ids) for ids in pa] + [_generate(b, ids) for ids in pb]
        jobs = [(a, ids) for ids in pa] + [(b, ids) for ids in pb]
        barrier = threading.Barrier(len(jobs))
        workers = [Worker(lambda m=m, ids=ids: _generate(m, ids), repeat=2, start_barrier=barrier) for m, ids in jobs]
        for w in workers:
            w.start()
        _join(*workers)
    finally:
        hi_na_moe.disable_for_model(a)
        hi_na_moe.disable_for_model(b)
    for w, want in zip(workers, serial):
        assert all(torch.equal(r, want) for r in w.results)


@pytest.mark.parametrize("pool", ["own", "openmp"])
def test_packed_forward_from_threads_on_both_pools(pool):
    # big enough for the kernels to open parallel regions (num_threads=2): concurrent callers
    # share the process-wide pool and each keeps its own scratch
    native = pytest.importorskip("hi_na_moe._native")
    E, I, H, T, K = 8, 96, 160, 48, 2
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(E, I, H, generator=g) * 0.05, torch.randn(E, I, H, generator=g) * 0.05,
         torch.randn(E, H, I, generator=g) * 0.05]
    pe = native.PackedExperts(*w)
    problems = []
    for s in range(4):
        gs = torch.Generator().manual_seed(10 + s)
        x = torch.randn(T - s, H, generator=gs)
        idx = torch.stack([torch.randperm(E, generator=gs)[:K] for _ in range(T - s)]).int()
        problems.append((x, idx, torch.rand(T - s, K, generator=gs)))

    def run(p):
        out = torch.empty_like(p[0])
        pe.forward(*p, out, num_threads=2)
        return out

    native.set_pool_backend(pool)
    try:
        serial = [run(p) for p in problems]
        barrier = threading.Barrier(len(problems))
        workers = [Worker(lambda p=p: run(p), repeat=20, start_barrier=barrier) for p in problems]
        for wk in workers:
            wk.start()
        _join(*workers)
    finally:
        native.set_pool_backend("auto")
    for wk, want in zip(workers, serial):
        assert all(torch.equal(r, want) for r in wk.results)


class _HeldKernel:
    """Replaces the kernel call of enabled blocks: the first call blocks (inside the block's
    forward, past the gate) until released."""

    def __init__(self, monkeypatch):
        self.real = ops.torch_ops.call
        self.entered, self.go = threading.Event(), threading.Event()
        self.calls = 0
        monkeypatch.setattr(ops.torch_ops, "call", self)
        monkeypatch.setattr(ops.NativeExperts, "fast", lambda *_: None)  # every call through `call`

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(JOIN_S)
        return self.real(*args, **kwargs)


def test_disable_waits_for_a_forward_in_flight(monkeypatch):
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    hi_na_moe.enable_for_model(model)
    held = _HeldKernel(monkeypatch)
    fwd = Worker(lambda: _logits(model, ids))
    fwd.start()
    assert held.entered.wait(JOIN_S)
    dis = Worker(lambda: hi_na_moe.disable_for_model(model))
    dis.start()
    dis.join(BLOCKED_S)
    assert dis.is_alive(), "disable_for_model did not wait for the forward in flight"
    assert hi_na_moe.is_enabled(model)
    held.go.set()
    _join(fwd, dis)
    # its first MoE layer ran on the packed experts, the next ones (after disable) natively
    torch.testing.assert_close(fwd.results[0], native, rtol=1e-4, atol=1e-5)
    assert not hi_na_moe.is_enabled(model) and "hi_na_moe=" not in repr(model)
    assert torch.equal(_logits(model, ids), native)  # restored exactly


def test_a_forward_arriving_during_disable_runs_the_restored_block(monkeypatch):
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    hi_na_moe.enable_for_model(model)
    held = _HeldKernel(monkeypatch)
    first = Worker(lambda: _logits(model, ids))
    first.start()
    assert held.entered.wait(JOIN_S)
    dis = Worker(lambda: hi_na_moe.disable_for_model(model))
    dis.start()
    gate = patching._GATES[model]
    for _ in range(int(JOIN_S * 100)):  # the writer is queued: new forwards park at the gate
        with gate._cond:
            if gate._writers_waiting:
                break
        threading.Event().wait(0.01)
    second = Worker(lambda: _logits(model, ids))
    second.start()
    for _ in range(int(JOIN_S * 100)):
        with gate._cond:
            if gate.parked:
                break
        threading.Event().wait(0.01)
    assert gate.parked, "the second forward did not wait at the gate"
    held.go.set()
    _join(first, dis, second)
    # the second forward waited for disable, then ran the model's own code on its own weights
    assert torch.equal(second.results[0], native)


def _paused_native_forward(model, ids):
    """A forward on another thread, held inside layer 0's experts (their own code) between the
    gate_up and down projections, where it still has weights to read. Returns (worker, go, hook)."""
    experts = model.model.layers[0].mlp.experts
    entered, go = threading.Event(), threading.Event()

    def pause(module, args):
        if not entered.is_set():
            entered.set()
            assert go.wait(JOIN_S)

    hook = experts.act_fn.register_forward_pre_hook(pause)
    fwd = Worker(lambda: _logits(model, ids))
    fwd.start()
    assert entered.wait(JOIN_S)
    return fwd, go, hook


def test_enable_keeping_weights_leaves_a_native_forward_in_flight_alone():
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    fwd, go, hook = _paused_native_forward(model, ids)
    try:
        # nothing to wait for: the weights the paused forward still reads stay where they are
        report = hi_na_moe.enable_for_model(model, keep_weights=True)
        assert report.accelerated
    finally:
        go.set()
        _join(fwd)
        hook.remove()
    try:
        # its first MoE layer ran natively on intact weights, the next ones accelerated
        torch.testing.assert_close(fwd.results[0], native, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(_logits(model, ids), native, rtol=1e-4, atol=1e-5)
    finally:
        hi_na_moe.disable_for_model(model)


# transformers' experts implementations: each reads the weights its own way (eager per expert,
# batched_mm indexing the parameter itself, grouped_mm through a transposed view)
EXPERTS_IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]


@pytest.mark.parametrize("impl", EXPERTS_IMPLEMENTATIONS)
def test_a_forward_inside_a_block_when_enable_releases_it_fails_loudly(impl):
    # The caller's race (README, "Threads"): a forward running a block's own code when enable
    # releases that block's weights. It may fail, but never with numbers: reading a released
    # weight is an error naming it (its placeholder once gave zeros: wrong logits, no error)
    model, vocab = _tiny()
    model.set_experts_implementation(impl)
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    fwd, go, hook = _paused_native_forward(model, ids)  # between layer 0's gate_up and down projections
    try:
        hi_na_moe.enable_for_model(model)  # releases the down projection the paused forward reads next
    finally:
        go.set()
        fwd.join(JOIN_S)
        hook.remove()
    try:
        assert not fwd.is_alive()
        assert isinstance(fwd.error, RuntimeError), f"the forward returned {fwd.results} instead of an error"
        assert "'model.layers.0.mlp.experts.down_proj' is released" in str(fwd.error)
        torch.testing.assert_close(_logits(model, ids), native, rtol=1e-4, atol=1e-5)
    finally:
        hi_na_moe.disable_for_model(model)
    assert torch.equal(_logits(model, ids), native)


def test_a_read_while_disable_restores_sees_an_error_or_the_whole_weights(monkeypatch):
    # disable fills the weights back while a forward begun before enable may still read them:
    # it must never see a tensor half written (or not yet written)
    model, _ = _tiny()
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(5)
    x, idx, w = torch.randn(5, experts.hidden_dim, generator=g), torch.randint(0, 4, (5, 2), generator=g), torch.rand(5, 2)
    with torch.no_grad():
        want = type(experts).forward(experts, x, idx, w)
    hi_na_moe.enable_for_model(model)
    seen = []
    real = ops.NativeExperts._copy_into

    def read_then_copy(self, spec, arrays):  # another thread's read, at the moment the copy starts
        try:
            with torch.no_grad():
                seen.append(type(experts).forward(experts, x, idx, w))
        except RuntimeError as exc:
            seen.append(exc)
        real(self, spec, arrays)

    monkeypatch.setattr(ops.NativeExperts, "_copy_into", read_then_copy)
    hi_na_moe.disable_for_model(model)
    assert len(seen) == 2  # during each block's restore (layer 0's, then layer 1's)
    for got in seen:
        if isinstance(got, RuntimeError):
            assert "'model.layers.0.mlp.experts." in str(got) and "is released" in str(got)
        else:
            assert torch.equal(got, want), "a read during restore saw weights not yet (or half) written"
    assert isinstance(seen[0], RuntimeError)  # layer 0's own restore: not written yet
    assert torch.equal(seen[1], want)  # layer 1's: layer 0 whole again


def test_forwards_racing_enable_and_disable_never_return_wrong_numbers():
    # the caller's race, as a user ran it: forwards on two threads while the main thread enables
    # (releasing the weights) and disables, a fixed number of times. A forward may fail; every
    # forward that returns has the model's logits. With the placeholders' zeros readable, the
    # eager experts returned wrong logits without an error in about 1 forward of 20 here
    model, vocab = _tiny()
    model.set_experts_implementation("eager")
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    stop = threading.Event()
    outcomes: list = []

    def forwards():
        while not stop.is_set():
            try:
                outcomes.append(_logits(model, ids))
            except RuntimeError as exc:
                outcomes.append(exc)

    workers = [threading.Thread(target=forwards, daemon=True) for _ in range(2)]
    for t in workers:
        t.start()
    try:
        for _ in range(60):
            hi_na_moe.enable_for_model(model)
            hi_na_moe.disable_for_model(model)
    finally:
        stop.set()
        _join(*workers)
    returned = [o for o in outcomes if isinstance(o, torch.Tensor)]
    assert returned
    wrong = [o for o in returned if not torch.allclose(o, native, rtol=1e-4, atol=1e-5)]
    assert len(wrong) == 0, f"{len(wrong)} of {len(outcomes)} forwards returned wrong logits without an error"
    assert torch.equal(_logits(model, ids), native)


def test_enable_and_disable_never_read_other_threads_frames(monkeypatch):
    # Walking the other threads' frames (sys._current_frames, f_back, f_locals) while they run
    # forwards met objects that were not frames and crashed CPython 3.11 within a minute of this
    # race (a CI run failed with an ImportError raised inside torch.jit.is_scripting); enable
    # once did so to find native forwards in flight. It must not come back.
    def refuse():
        raise AssertionError("hi_na_moe read the frames of other threads")

    monkeypatch.setattr(sys, "_current_frames", refuse)
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    fwd, go, hook = _paused_native_forward(model, ids)
    try:
        hi_na_moe.enable_for_model(model, keep_weights=True)
        hi_na_moe.disable_for_model(model)
    finally:
        go.set()
        _join(fwd)
        hook.remove()
    torch.testing.assert_close(fwd.results[0], native, rtol=1e-4, atol=1e-5)
    hi_na_moe.enable_for_model(model)  # releases the weights (the old code looked for forwards here)
    try:
        torch.testing.assert_close(_logits(model, ids), native, rtol=1e-4, atol=1e-5)
    finally:
        hi_na_moe.disable_for_model(model)
    assert torch.equal(_logits(model, ids), native)


def test_forwards_through_repeated_enable_and_disable():
    # forwards on two threads while the main thread enables and disables the model again and
    # again: every forward computes the model (native or accelerated), never a half-swapped one.
    # keep_weights=True: a forward between a disable and the next enable runs the blocks' own
    # code, which enable does not wait for (module docstring); releasing under it would be the
    # caller's race, not the gate's
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    native = _logits(model, ids)
    stop = threading.Event()
    workers = [Worker(lambda: _logits(model, ids), stop=stop) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for _ in range(12):
            hi_na_moe.enable_for_model(model, keep_weights=True)
            hi_na_moe.disable_for_model(model)
    finally:
        stop.set()
        _join(*workers)
    results = [r for w in workers for r in w.results]
    assert results
    for r in results:
        torch.testing.assert_close(r, native, rtol=1e-4, atol=1e-5)
    assert torch.equal(_logits(model, ids), native)


def test_disable_from_inside_a_forward_is_a_clear_error():
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    report = hi_na_moe.enable_for_model(model)
    runner = next(iter(patching._ROOTS[model][0]))[2].runner
    assert isinstance(runner, ops.NativeExperts) and report.accelerated

    def recorder(*args):
        hi_na_moe.disable_for_model(model)

    runner.recorder = recorder
    try:
        with pytest.raises(RuntimeError, match="from inside a forward of the same model"):
            _logits(model, ids)
        assert hi_na_moe.is_enabled(model)
    finally:
        runner.recorder = None
        hi_na_moe.disable_for_model(model)


def test_disable_gives_up_after_the_timeout_and_leaves_the_model_enabled(monkeypatch):
    model, vocab = _tiny()
    ids = _prompts(vocab, n=1)[0]
    hi_na_moe.enable_for_model(model)
    enabled = _logits(model, ids)
    held = _HeldKernel(monkeypatch)
    fwd = Worker(lambda: _logits(model, ids))
    fwd.start()
    assert held.entered.wait(JOIN_S)
    monkeypatch.setattr(patching, "DRAIN_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(RuntimeError, match=r"disable_for_model waited 0.2 s for 1 forward\(s\).*unchanged"):
            hi_na_moe.disable_for_model(model)
        assert hi_na_moe.is_enabled(model)
    finally:
        held.go.set()
        _join(fwd)
    assert torch.equal(fwd.results[0], enabled) and torch.equal(_logits(model, ids), enabled)
    hi_na_moe.disable_for_model(model)


def test_state_dict_from_threads_while_enabled():
    # state_dict() fills fresh copies of the released weights, never attached to the model;
    # concurrent calls must neither see each other's half-filled tensors nor leave them behind
    model, _ = _tiny()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    hi_na_moe.enable_for_model(model)
    try:
        barrier = threading.Barrier(4)
        workers = [Worker(model.state_dict, repeat=10, start_barrier=barrier) for _ in range(4)]
        for w in workers:
            w.start()
        _join(*workers)
        for w in workers:
            for sd in w.results:
                assert all(torch.equal(sd[k], want[k]) for k in want)
        experts = model.model.layers[0].mlp.experts
        assert ops.is_released(experts.gate_up_proj) and experts.gate_up_proj.untyped_storage().nbytes() == 0
    finally:
        hi_na_moe.disable_for_model(model)
