"""The memory tier (issue 42; csrc/include/hina_moe/tier.h, hi_na_moe.core.tier,
hi_na_moe.integrate.tiering): experts that exceed memory_limit live in the packed-expert store and
are read into a pool of slots when routed to.

What must hold: a model run through the tier gives the all-in-memory block's outputs bit for bit
(every weights format, both scopes, a prefill whose experts exceed the pool, batched decode); a
limit that cannot hold one token's experts is refused naming the limit and the minimum; the
native tier counts hits, misses and evictions as its policy says, reads what its routers predict,
checks every read against its CRC-32C and says which file and expert failed, recovers after a
failed call, and takes concurrent callers without deadlock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import build_tiny

import hi_na_moe
from hi_na_moe.core import limits
from hi_na_moe.core import tier as tier_mod
from hi_na_moe.core.native import native_kernels_available, native_module
from hi_na_moe.core.registry import patched_experts
from hi_na_moe.core.tier import TierConfigError
from hi_na_moe.integrate import tiering

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="the memory tier is native")

TESTS = Path(__file__).resolve().parent
E_MODEL, K_MODEL, LAYERS = 16, 4, 3
TINY = dict(dtype=torch.bfloat16, num_experts=E_MODEL, num_experts_per_tok=K_MODEL, num_hidden_layers=LAYERS,
            hidden_size=128, intermediate_size=64)


def _native():
    return native_module()[0]


# ---- the model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def _model():
    m = build_tiny("olmoe", **TINY).model
    return m, {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture
def model(_model):
    yield _model
    if hi_na_moe.is_enabled(_model[0]):  # an enable a failed test left: not the next test's
        hi_na_moe.disable_for_model(_model[0])


@contextlib.contextmanager
def _enabled(m, **kw):
    kw["cache_dir"] = str(kw["cache_dir"])
    report = hi_na_moe.enable_for_model(m, **kw)
    try:
        yield report
    finally:
        hi_na_moe.disable_for_model(m)


def _blocks(m):
    return [patched_experts(layer.mlp.experts) for layer in m.model.layers]


def _slot_bytes(m) -> int:
    """Bytes of one slot for the enabled model's experts (all its layers are alike)."""
    native = _native()
    info = native.header_info(_blocks(m)[0].packed.header)
    return int(native.tier_slot_bytes(info["gu_expert_bytes"], info["down_expert_bytes"]))


def _expert_bytes(m) -> int:
    info = _native().header_info(_blocks(m)[0].packed.header)
    return int(info["gu_expert_bytes"]) + int(info["down_expert_bytes"])


def _prompts():
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 256, (1, 12), generator=g), torch.randint(3, 256, (2, 10), generator=g)


def _outputs(m):
    """Prefill logits of 12 tokens; greedy generate of 8 tokens (ids and each step's logits) of one
    sequence and of two (batched decode)."""
    one, two = _prompts()
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        prefill = m(one).logits
        g1 = m.generate(one, max_new_tokens=8, **kw)
        g2 = m.generate(two, attention_mask=torch.ones_like(two), max_new_tokens=8, **kw)
    return [prefill, g1.sequences, *g1.logits, g2.sequences, *g2.logits]


def _assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs from the all-in-memory model's"


def _check_counters(s, expert_bytes):
    assert s["memory_tier"] is True
    assert s["hits"] + s["misses"] == s["demanded"] > 0
    assert s["misses"] > 0 and s["evictions"] > 0  # the pool was too small to hold the routed experts
    assert s["bytes_read"] == s["reads"] * expert_bytes
    assert s["retries"] == 0
    assert [l["name"] for l in s["layers"]] == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]


FORMATS_SCOPES = [(f, s) for f in ("int4", "int8", "lossless", "lossless12") for s in ("experts", "all")]


@pytest.mark.parametrize("weights,scope", FORMATS_SCOPES)
def test_outputs_through_the_tier_equal_the_all_in_memory_model(model, weights, scope, tmp_path):
    m, original = model
    with _enabled(m, weights=weights, scope=scope, cache_dir=tmp_path):
        assert _native().header_info(_blocks(m)[0].packed.header)["weights"] == weights  # (lossless12 not fallen back)
        want = _outputs(m)
        slot, expert_bytes = _slot_bytes(m), _expert_bytes(m)
    with _enabled(m, weights=weights, scope=scope, cache_dir=tmp_path, memory_limit=10 * slot) as report:
        assert all(b.held == "tiered" for b in _blocks(m))
        text = str(report)
        assert "memory tier: the packed experts" in text and "10 expert slots" in text
        assert f"eviction {tier_mod.DEFAULT_POLICY}" in text and f"prediction for {LAYERS} of {LAYERS} layers" in text
        assert hi_na_moe.stats(m)["acquires"] == 0  # (enable's own probe forwards are not counted)
        got = _outputs(m)
        s = hi_na_moe.stats(m)
    _assert_equal(got, want)
    _check_counters(s, expert_bytes)
    # decode steps (one row, and two) predicted the next layers' experts, at acquire and, with
    # scope="experts", again from each layer's output (a hook on the decoder layer); this model's
    # layers are too small for scope="all"'s native layer step, which would do it there
    assert s["predicted"] > 0 and s["prefetch_issued"] > 0
    assert all(l["predicted"] > 0 for l in s["layers"][1:])
    refined = LAYERS - 1 if scope == "experts" else 0
    assert (s["refined"] > 0) == (refined > 0)
    assert f"refined from the layer before's output for {refined} of {LAYERS} layers" in text
    # disable gives the model's own weights back, bit for bit
    assert not hi_na_moe.is_enabled(m)
    assert all(torch.equal(v, original[k]) for k, v in m.state_dict().items())
    assert hi_na_moe.stats(m)["memory_tier"] is False


@pytest.mark.parametrize("eviction", ["lru", "lfu", "lru-2", "freq-decay"])
def test_the_eviction_key_chooses_the_policy_and_never_the_outputs(model, eviction, tmp_path):
    """A policy decides which experts stay resident, never what a step computes."""
    m, _ = model
    with _enabled(m, weights="int4", scope="all", cache_dir=tmp_path):
        want = _outputs(m)
        slot = _slot_bytes(m)
    with _enabled(m, weights="int4", scope="all", cache_dir=tmp_path, memory_limit=10 * slot,
                  eviction=eviction) as report:
        assert f"eviction {eviction};" in str(report)
        got = _outputs(m)
        s = hi_na_moe.stats(m)
    _assert_equal(got, want)
    assert s["evictions"] > 0  # (the pool was too small to keep everything: the policy chose)


@pytest.mark.parametrize("weights,scope", [("int4", "experts"), ("lossless12", "all")])
def test_the_minimum_limit_holds_one_tokens_experts_and_a_prefill_runs_in_pieces(model, weights, scope, tmp_path):
    m, _ = model
    with _enabled(m, weights=weights, scope=scope, cache_dir=tmp_path):
        want = _outputs(m)
        minimum = K_MODEL * _slot_bytes(m)  # OLMoE's experts have no biases
    with pytest.raises(TierConfigError) as err:
        hi_na_moe.enable_for_model(m, weights=weights, scope=scope, cache_dir=str(tmp_path),
                                   memory_limit=minimum - 1)
    msg = str(err.value)
    assert "memory_limit" in msg and f"{minimum - 1} bytes" in msg and "at least" in msg and f"{minimum} bytes" in msg
    assert not hi_na_moe.is_enabled(m)
    with _enabled(m, weights=weights, scope=scope, cache_dir=tmp_path, memory_limit=minimum) as report:
        assert f"{K_MODEL} expert slots" in str(report)
        one, _ = _prompts()
        with torch.no_grad():
            m(one)
        # 12 tokens route to more than 4 experts: each layer's call ran in several pieces
        assert hi_na_moe.stats(m)["acquires"] > LAYERS
        got = _outputs(m)
    _assert_equal(got, want)


def test_a_limit_the_experts_fit_makes_no_tier(model, tmp_path):
    m, _ = model
    with _enabled(m, weights="int4", cache_dir=tmp_path) as report:
        want = _outputs(m)
        packed = sum(b.packed.nbytes for b in _blocks(m))
        assert "memory tier" not in str(report)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=packed) as report:
        assert all(b.held != "tiered" for b in _blocks(m))
        s = hi_na_moe.stats(m)
        assert s["memory_tier"] is False and "fit memory_limit" in s["why"]
        assert "memory tier: the packed experts" in str(report) and "fit memory_limit" in str(report)
        got = _outputs(m)
    _assert_equal(got, want)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=packed - 1):
        assert hi_na_moe.stats(m)["memory_tier"] is True


def _prior(path, blocks, fmt="hi_na_moe.expert_prior"):
    path.write_text(json.dumps({"format": fmt, "version": 1, "blocks": [
        {"block": name, "layer": i, "num_experts": len(f), "top_k": K_MODEL, "counts": f, "frequency": f}
        for i, (name, f) in enumerate(blocks)]}))
    return path


def test_a_profile_fills_the_pool_with_its_most_frequent_experts(model, tmp_path):
    """profile=: the pool starts with the prior's most frequent experts over all layers, the
    counters start at zero, and the outputs stay the all-in-memory model's."""
    m, _ = model
    names = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    with _enabled(m, weights="int4", cache_dir=tmp_path):
        want = _outputs(m)
        slot = _slot_bytes(m)
    # layer 0 favours experts 3 and 9, layer 1 expert 15 above all, layer 2 nothing above 0.05
    freq = [[0.01] * E_MODEL for _ in range(LAYERS)]
    freq[0][3], freq[0][9], freq[1][15], freq[1][2] = 0.4, 0.3, 0.5, 0.2
    freq[2] = [0.05] * E_MODEL
    prior = _prior(tmp_path / "expert_prior.json", list(zip(names, freq)))
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=4 * slot, profile=str(tmp_path)) as report:
        tier = tiering._STATES[m].tier
        assert sorted(tier.resident(0)) == [3, 9] and sorted(tier.resident(1)) == [2, 15] and tier.resident(2) == []
        s = hi_na_moe.stats(m)
        assert s["reads"] == 0 and s["hits"] == 0 and s["misses"] == 0
        assert "the pool starts with the prior's 4 most frequent experts" in str(report)
        first = hi_na_moe.stats(m)
        got = _outputs(m)
        assert hi_na_moe.stats(m)["hits"] > first["hits"]
    _assert_equal(got, want)
    # the same file by name, and a real profile-router prior of this model
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=4 * slot, profile=str(prior)):
        assert sorted(tiering._STATES[m].tier.resident(0)) == [3, 9]
    from hi_na_moe.tools import profile_router as prm

    prm.profile_router(m, None, torch.randint(3, 256, (96,), generator=torch.Generator().manual_seed(2)),
                       seq_len=32).save(tmp_path / "prof", plots=False)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=6 * slot, profile=str(tmp_path / "prof")) as r:
        assert "the pool starts with the prior's 6 most frequent experts" in str(r)
        assert sum(len(tiering._STATES[m].tier.resident(i)) for i in range(LAYERS)) == 6


@pytest.mark.parametrize("case,want", [
    ("missing", "no such file"), ("dir", "no expert_prior.json in that directory"), ("json", "cannot be read as JSON"),
    ("format", "is not an expert prior"), ("model", "has no block 'model.layers.0.mlp.experts'"),
    ("experts", "has 8 experts there, 16 in this model"),
])
def test_a_profile_that_does_not_fit_the_model_is_refused_naming_it(model, tmp_path, case, want):
    m, _ = model
    with _enabled(m, weights="int4", cache_dir=tmp_path):
        slot = _slot_bytes(m)
    names = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    path = tmp_path / "p.json"
    if case == "missing":
        path = tmp_path / "nope.json"
    elif case == "dir":
        path = tmp_path / "d"
        path.mkdir()
    elif case == "json":
        path.write_text("{not json")
    elif case == "format":
        _prior(path, [(n, [0.1] * E_MODEL) for n in names], fmt="something.else")
    elif case == "model":
        _prior(path, [(f"other.{i}", [0.1] * E_MODEL) for i in range(LAYERS)])
    else:
        _prior(path, [(n, [0.1] * 8) for n in names])
    with pytest.raises(TierConfigError, match=re.escape(want)):
        hi_na_moe.enable_for_model(m, weights="int4", cache_dir=str(tmp_path), memory_limit=4 * slot, profile=str(path))
    assert not hi_na_moe.is_enabled(m)


def test_a_profile_without_a_tier_is_reported_unused(model, tmp_path):
    m, _ = model
    prior = _prior(tmp_path / "p.json", [(f"model.layers.{i}.mlp.experts", [0.1] * E_MODEL) for i in range(LAYERS)])
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit="100GiB", profile=str(prior)) as report:
        assert f"profile {str(prior)!r} not used: no memory tier" in str(report)


def test_a_percentage_is_of_the_memory_the_process_may_use(model, tmp_path, monkeypatch):
    m, _ = model
    with _enabled(m, weights="int4", cache_dir=tmp_path):
        slot = _slot_bytes(m)
    # "1%" of a machine whose MemTotal is 100 x (10 slots): exactly 10 slots
    monkeypatch.setattr(limits, "mem_total", lambda: 100 * 10 * slot)
    monkeypatch.setattr(limits, "cgroup_memory_limit", lambda: None)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit="1%") as report:
        assert "10 expert slots" in str(report)
        assert hi_na_moe.stats(m)["memory_tier"] is True
    # and of the cgroup's limit when that is smaller
    monkeypatch.setattr(limits, "cgroup_memory_limit", lambda: 100 * 6 * slot)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit="1%") as report:
        assert "6 expert slots" in str(report)


def _store_file(block):
    """(path, offset of the packed block in it) of a tiered block's store entry."""
    entry = block.store.open(block._key(block.weights), block.name, expect=block._expect(block.weights))
    try:
        return Path(entry.path), entry.offsets["block"]
    finally:
        entry.close()


def _flip(path: Path, offsets):
    with open(path, "r+b") as f:
        for o in offsets:
            f.seek(o)
            b = f.read(1)
            f.seek(o)
            f.write(bytes([b[0] ^ 0x01]))


def test_a_corrupt_store_entry_fails_the_forward_naming_it_and_the_model_recovers_once_it_is_repaired(model, tmp_path):
    m, _ = model
    one, _ = _prompts()
    with _enabled(m, weights="int4", cache_dir=tmp_path):
        with torch.no_grad():
            want = m(one).logits
        slot = _slot_bytes(m)
    with _enabled(m, weights="int4", cache_dir=tmp_path, memory_limit=10 * slot):
        block = _blocks(m)[0]
        info = _native().header_info(block.packed.header)
        path, off = _store_file(block)
        # one byte of every expert's gate/up panels of the first layer
        where = [off + e * int(info["gu_expert_bytes"]) + 5 for e in range(E_MODEL)]
        _flip(path, where)
        with pytest.raises(_native().TierError) as err:
            with torch.no_grad():
                m(one)
        msg = str(err.value)
        assert str(path) in msg and "expert " in msg and "gate/up" in msg and "checksum mismatch" in msg
        assert "hi-na-moe cache clear" in msg
        # reads the failed call queued go on after it: a read begun before the repair below fails,
        # and a call that finds it under way waits for it (and its error) rather than reading again
        tiering._STATES[m].tier.drain()
        _flip(path, where)  # repaired: the same experts read again
        with torch.no_grad():
            got = m(one).logits
    assert torch.equal(got, want)


# ---- the native tier on a hand-made store file ------------------------------------------------

def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_crc32c_gives_the_castagnoli_check_values():
    native = _native()

    def crc(b, c=0):
        return int(native.crc32c(np.frombuffer(b, np.uint8), c))

    assert crc(b"123456789") == 0xE3069283  # the CRC-32C check value
    # RFC 3720 (iSCSI), B.4
    assert crc(bytes(32)) == 0x8A9136AA
    assert crc(b"\xff" * 32) == 0x62A8AB43
    assert crc(bytes(range(32))) == 0x46DD794E
    assert crc(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc(b"") == 0
    data = np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes()
    for n in (1, 7, 8, 9, 15, 64, 300):  # tails the 8-byte steps leave
        assert crc(data[:n]) == _crc32c_reference(data[:n])
        # continuing from a CRC is the CRC of the concatenation
        assert crc(data[n // 3:n], crc(data[:n // 3])) == crc(data[:n])


@dataclass
class Block:
    """Experts packed in memory and the same bytes written to a file at `off`, with their CRCs."""
    pe: object
    path: Path
    off: int
    E: int
    gu: int
    dn: int
    crc_gu: list
    crc_dn: list
    rest: np.ndarray

    @property
    def slot_bytes(self) -> int:
        return int(_native().tier_slot_bytes(self.gu, self.dn))

    def register(self, tier) -> int:
        return tier.add_layer(str(self.path), self.E, self.off, self.gu, self.off + self.E * self.gu, self.dn,
                              self.crc_gu, self.crc_dn)

    def tiered(self, tier):
        layer = self.register(tier)
        return _native().packed_tiered(self.pe.header, tier, layer, self.rest), layer


H, I = 128, 64


def _block(path: Path, weights="int4", E=8, biases=False, off=8192, seed=0, dtype=torch.bfloat16) -> Block:
    native = _native()
    g = torch.Generator().manual_seed(seed)
    gate, up = ((torch.randn(E, I, H, generator=g) * 0.1).to(dtype) for _ in range(2))
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    b = [(torch.randn(E, n, generator=g) * 0.1).to(dtype) for n in (I, I, H)] if biases else [None] * 3
    pe = native.PackedExperts(gate, up, down, *b, weights=weights)
    data = torch.from_dlpack(pe.data).numpy()
    info = native.header_info(pe.header)
    gu, dn = int(info["gu_expert_bytes"]), int(info["down_expert_bytes"])
    with open(path, "wb") as f:
        f.write(b"\x5a" * off)  # bytes before the block that no read may take
        f.write(data.tobytes())
        f.write(b"\xa5" * 100)
    crc_gu = [int(native.crc32c(data[e * gu:(e + 1) * gu])) for e in range(E)]
    crc_dn = [int(native.crc32c(data[E * gu + e * dn:E * gu + (e + 1) * dn])) for e in range(E)]
    return Block(pe, path, off, E, gu, dn, crc_gu, crc_dn, data[E * (gu + dn):].copy())


def _tier(block: Block, num_slots: int, **kw):
    kw.setdefault("prediction_window", 0)
    return _native().ExpertTier(block.slot_bytes, num_slots, **kw)


def _problem(T, K, E, seed, dtype=torch.bfloat16, experts=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g)).to(dtype)
    if experts is None:
        rows = [torch.randperm(E, generator=g)[:K] for _ in range(T)]
        idx = (torch.stack(rows) if rows else torch.empty(0, K)).int()
    else:
        idx = torch.tensor(experts, dtype=torch.int32).reshape(T, K)
    return x, idx, torch.rand(T, K, generator=g)


def _fwd(pe, x, idx, w, **kw):
    out = torch.empty_like(x)
    pe.forward(x, idx, w, out, **kw)
    return out


@pytest.mark.parametrize("weights,biases,off,direct,threads,dtype", [
    ("int4", False, 8192, True, 1, torch.bfloat16),
    ("int8", True, 4096 + 3 * 64, False, 2, torch.bfloat16),  # offsets not 4096-aligned: O_DIRECT's lead
    ("int8", False, 4096 + 3 * 64, True, 1, torch.bfloat16),
    ("lossless", True, 12288, True, 2, torch.float32),
    ("lossless12", False, 4096, False, 1, torch.bfloat16),
])
def test_a_tiered_block_computes_what_the_block_in_memory_does(tmp_path, weights, biases, off, direct, threads, dtype):
    blk = _block(tmp_path / "block.hnm", weights, biases=biases, off=off, dtype=dtype)
    tier = _tier(blk, 3, direct_io=direct, io_threads=2)
    tp, layer = blk.tiered(tier)
    mode = tier.io_mode(layer)
    if direct:  # a file system without O_DIRECT (tmpfs on older kernels) is read buffered, and says why
        assert mode == "O_DIRECT" or mode.startswith("buffered reads: O_DIRECT refused ("), mode
    else:
        assert mode == "buffered reads: direct_io off"
    assert tier.num_slots == 3 and tier.num_layers == 1 and tier.pool_bytes == 3 * blk.slot_bytes
    for T, seed in ((1, 1), (2, 2), (5, 3), (9, 4), (0, 5)):
        x, idx, w = _problem(T, 2, blk.E, seed, dtype)
        for path in ("auto", "decode", "prefill"):
            assert torch.equal(_fwd(tp, x, idx, w, path=path, num_threads=threads),
                               _fwd(blk.pe, x, idx, w, path=path, num_threads=threads)), (T, path)
    # a skipped slot (index < 0) is no expert to read
    x, idx, w = _problem(3, 2, blk.E, 6, dtype)
    idx[1, 0] = -1
    assert torch.equal(_fwd(tp, x, idx, w), _fwd(blk.pe, x, idx, w))
    s = tier.stats()
    assert s["hits"] + s["misses"] == s["demanded"] and s["bytes_read"] == s["reads"] * (blk.gu + blk.dn)
    with pytest.raises(ValueError, match="memory tier"):
        tp.data


def _touch(tp, block, experts):
    """One call per expert, one row each."""
    for e in experts:
        x, idx, w = _problem(1, 1, block.E, 100 + e, experts=[e])
        _fwd(tp, x, idx, w)


def test_lru_counts_hits_misses_and_evictions_of_a_known_pattern(tmp_path):
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2)
    tp, layer = blk.tiered(tier)
    A, B, C = 3, 5, 6
    _touch(tp, blk, [A, B, A, C, A])  # miss, miss, hit, miss (evicts B, the least recent), hit
    s = tier.stats()
    assert (s["acquires"], s["hits"], s["misses"], s["evictions"], s["reads"], s["demanded"]) == (5, 2, 3, 1, 3, 5)
    assert s["bytes_read"] == 3 * (blk.gu + blk.dn)
    assert s["layers"][0]["hits"] == 2 and s["layers"][0]["misses"] == 3
    assert tier.resident(layer) == [A, C]
    _touch(tp, blk, [B])  # evicts C (A was used after it)
    assert tier.resident(layer) == [A, B]
    tier.reset_stats()
    s = tier.stats()
    assert s["hits"] == s["misses"] == s["reads"] == s["evictions"] == 0 and s["layers"][0]["demanded"] == 0


def test_warm_reads_in_order_and_drain_returns_after_a_dropped_prediction(tmp_path):
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2)
    tp, layer = blk.tiered(tier)
    tier.warm([layer, layer, layer], [1, 4, 6])  # the third evicts the least recently used, 1
    assert tier.resident(layer) == [4, 6]
    _touch(tp, blk, [7])  # evicts 4
    assert tier.resident(layer) == [6, 7]
    _fwd(tp, *_problem(1, 2, blk.E, 7, experts=[6, 7]))
    # both slots were used in the last acquire: a predicted read has no slot, is dropped, and
    # drain() still returns (it once waited forever for a request settled without a read)
    tier.reset_stats()
    done = threading.Event()

    def prefetch_and_drain():
        tier.prefetch(layer, [2])
        tier.drain()
        done.set()

    threading.Thread(target=prefetch_and_drain, daemon=True).start()
    assert done.wait(20), "drain() did not return after a dropped prediction"
    assert tier.stats()["prefetch_dropped"] == 1 and tier.resident(layer) == [6, 7]
    with pytest.raises(ValueError, match="no layer 5"):
        tier.warm([5], [0])
    with pytest.raises(ValueError, match="one length"):
        tier.warm([layer], [0, 1])


@pytest.mark.parametrize("policy,half_life,kept", [
    ("lru", 64.0, [5, 6]),          # A is the least recently used
    ("lru-2", 64.0, [3, 6]),        # B was used once (no second-to-last use)
    ("lfu", 64.0, [3, 6]),          # B was used once, A three times
    ("freq-decay", 64.0, [3, 6]),   # a long half-life counts like lfu
    ("freq-decay", 0.05, [5, 6]),   # a short one like lru
])
def test_the_eviction_policies_choose_their_victim(tmp_path, policy, half_life, kept):
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, policy=policy, half_life=half_life)
    assert tier.policy == policy
    tp, layer = blk.tiered(tier)
    _touch(tp, blk, [3, 3, 3, 5, 6])
    assert tier.resident(layer) == kept
    assert tier.stats()["evictions"] == 1


def test_forget_uses_keeps_the_pool_but_not_the_policys_record(tmp_path):
    """enable forgets its probe forwards' uses (tiering.settle): the experts stay resident, and
    the policy ranks them by the uses after it alone."""
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, policy="lfu")
    tp, layer = blk.tiered(tier)
    _touch(tp, blk, [3, 3, 3, 3, 5])
    tier.forget_uses()
    assert tier.resident(layer) == [3, 5]
    _touch(tp, blk, [5, 6])  # 5 used once since, 3 never: 3 goes (remembered, 5 would: 4 uses to 2)
    assert tier.resident(layer) == [5, 6]


def test_prediction_reads_the_next_layers_top_experts(tmp_path):
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 5, prediction_window=1, prediction_extra=1, prediction_max_rows=2)
    t0, _ = blk.tiered(tier)
    t1, l1 = blk.tiered(tier)  # a second layer over the same file
    x, idx, w = _problem(1, 1, blk.E, 9, experts=[0])
    g = torch.Generator().manual_seed(10)
    router = (torch.randn(blk.E, H, generator=g) * 0.01).bfloat16()
    router[6] = x[0]          # the largest logit by far: x . x
    router[2] = x[0] * 0.5    # the second
    tier.set_router(l1, router, None, 1)  # top-1, plus prediction_extra
    _fwd(t0, x, idx, w)
    tier.drain()
    # expert 0's demanded read was outstanding when the prediction ran (the disk behind): only
    # the next layer's top-k is read ahead then
    assert tier.resident(l1) == [6]
    _fwd(t0, x, idx, w)  # expert 0 resident now: top-k + prediction_extra
    tier.drain()
    assert tier.resident(l1) == [2, 6]
    s = tier.stats()
    assert s["prefetch_issued"] == 2 and s["layers"][1]["predicted"] == 2
    _touch(t1, blk, [6])
    s = tier.stats()
    assert s["layers"][1]["hits"] == 1 and s["layers"][1]["misses"] == 0 and s["layers"][1]["predicted_used"] == 1
    # more rows than prediction_max_rows predict nothing
    tier.reset_stats()
    x3, idx3, w3 = _problem(3, 1, blk.E, 11, experts=[0, 0, 0])
    x3[:] = x[0]
    _fwd(t0, x3, idx3, w3)
    assert tier.stats()["predicted"] == 0
    with pytest.raises(ValueError, match="router weight"):
        tier.set_router(l1, router[:4], None, 1)


def _rms(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _top(router, x, n):
    logits = (x.float() @ router.float().t()).reshape(-1)  # (one row)
    return sorted(torch.topk(logits, n).indices.tolist())


def test_refine_reads_the_experts_the_next_routers_pick_from_the_normed_output(tmp_path):
    """layer_done(l, residual): layer l+j's router on layer l's output through layer l+j's
    RMSNorm, top-k + 4 one layer ahead and + 8 two ahead; when layer l's acquire found the disk
    behind, only the next layer's top-k."""
    E = 16
    blk = _block(tmp_path / "block.hnm", E=E)
    tier = _tier(blk, 3 * E, prediction_window=2, prediction_max_rows=1, io_threads=4)
    (t0, l0), (_, l1), (_, l2) = (blk.tiered(tier) for _ in range(3))
    g = torch.Generator().manual_seed(21)
    routers = [(torch.randn(E, H, generator=g) * 0.1).bfloat16() for _ in range(2)]
    norms = [(torch.rand(H, generator=g) * 3 + 0.05).bfloat16() for _ in range(2)]
    eps = [1e-6, 1e-2]
    for layer, r, w, e in zip((l1, l2), routers, norms, eps):
        tier.set_router(layer, r, None, 1)  # top-1
        tier.set_norm(layer, w, e)
    res = (torch.randn(1, H, generator=g) * 2 + 0.3).bfloat16()
    want = [_top(r, _rms(res, w, e), 1 + m) for r, w, e, m in zip(routers, norms, eps, (4, 8))]
    # (the norm's weights matter: without them the routers would pick other experts)
    assert all(_top(r, res, len(p)) != p for r, p in zip(routers, want))
    tier.layer_done(l0, res)
    tier.drain()
    assert [tier.resident(l1), tier.resident(l2)] == want
    s = tier.stats()
    assert s["refined"] == s["predicted"] == 5 + 9 and s["prefetch_issued"] == 5 + 9
    assert [l["predicted"] for l in s["layers"]] == [0, 5, 9]
    # a prediction repeated before its layer's acquire is counted once
    tier.layer_done(l0, res)
    assert tier.stats()["refined"] == 5 + 9
    # more rows than prediction_max_rows: nothing
    tier.reset_stats()
    tier.layer_done(l0, torch.cat([res, res]))
    assert tier.stats()["predicted"] == 0

    # behind: layer 0's acquire had to read its expert; then only layer 1's top-1
    tier2 = _tier(blk, 3 * E, prediction_window=2, prediction_extra=0, prediction_max_rows=1)
    (t0, l0), (_, l1), (_, l2) = (blk.tiered(tier2) for _ in range(3))
    tier2.set_router(l1, routers[0], None, 1)
    tier2.set_norm(l1, norms[0], eps[0])
    x, idx, w = _problem(1, 1, E, 9, experts=[0])
    _fwd(t0, x, idx, w)  # (its own prediction: layer 1's top-1 from x; layer 2 has no router yet)
    tier2.drain()
    tier2.set_router(l2, routers[1], None, 1)
    tier2.set_norm(l2, norms[1], eps[1])
    tier2.layer_done(l0, res)
    tier2.drain()
    assert tier2.resident(l1) == sorted(set(_top(routers[0], x, 1) + _top(routers[0], _rms(res, norms[0], eps[0]), 1)))
    assert tier2.resident(l2) == []
    with pytest.raises(ValueError, match=r"norm weight must be \[H\]"):
        tier2.set_norm(l1, norms[0][:4].reshape(2, 2), 1e-6)
    with pytest.raises(ValueError, match="layer 1's norm weight has 4 values, its router's hidden size is 128"):
        tier2.set_norm(l1, norms[0][:4], 1e-6)
    with pytest.raises(ValueError, match="no router: set_router first"):
        tier2.set_norm(l0, norms[0], 1e-6)
    with pytest.raises(ValueError, match="layer_done residual has dtype int64"):
        tier2.layer_done(l0, torch.zeros(1, H, dtype=torch.int64))


def test_refine_off_predicts_only_at_acquire(tmp_path):
    E = 16
    blk = _block(tmp_path / "block.hnm", E=E)
    tier = _tier(blk, 3 * E, prediction_window=2, prediction_max_rows=1, refine=False)
    (_, l0), (_, l1), (_, l2) = (blk.tiered(tier) for _ in range(3))
    for layer in (l1, l2):
        tier.set_router(layer, torch.randn(E, H).bfloat16(), None, 1)
        tier.set_norm(layer, torch.ones(H).bfloat16(), 1e-6)
    tier.layer_done(l0, torch.randn(1, H).bfloat16())
    tier.drain()
    assert tier.stats()["predicted"] == 0 and tier.resident(l1) == tier.resident(l2) == []


def test_refine_applies_only_a_plain_rms_norm():
    m = build_tiny("olmoe", **TINY).model
    norm = m.model.layers[0].post_attention_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    got = tiering.rms_norm_of(norm, TINY["hidden_size"])
    assert got is not None and torch.equal(got[0], norm.weight) and got[1] == norm.variance_epsilon

    class OnePlus(torch.nn.Module):  # Gemma's: x / rms * (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.zeros(TINY["hidden_size"])), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    assert tiering.rms_norm_of(OnePlus(), TINY["hidden_size"]) is None
    ln = torch.nn.LayerNorm(TINY["hidden_size"], eps=1e-5)
    assert tiering.rms_norm_of(ln, TINY["hidden_size"]) is None
    assert tiering.rms_norm_of(norm, TINY["hidden_size"] * 2) is None


@pytest.mark.parametrize("scope", ["experts", "all"])
def test_the_refine_switch_turns_it_off_and_the_outputs_stay_exact(model, scope, tmp_path, monkeypatch):
    from hi_na_moe.fastpath import linear

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)  # scope="all": the layers' decode steps in the native calls
    m, _ = model
    with _enabled(m, weights="int4", scope=scope, cache_dir=tmp_path):
        want = _outputs(m)
        slot = _slot_bytes(m)
    layers = list(m.model.layers)
    for refine in (True, False):
        with _enabled(m, weights="int4", scope=scope, cache_dir=tmp_path, memory_limit=10 * slot,
                      experimental="" if refine else "tier.refine=off") as report:
            # scope="experts": a forward hook on each decoder layer; "all": the native step calls it
            assert sum(len(l._forward_hooks) for l in layers) == (LAYERS if refine and scope == "experts" else 0)
            got = _outputs(m)
            s = hi_na_moe.stats(m)
        _assert_equal(got, want)
        assert all(not l._forward_hooks for l in layers)  # (removed on disable)
        assert (s["refined"] > 0) == refine
        if refine:
            assert f"refined from the layer before's output for {LAYERS - 1} of {LAYERS} layers" in str(report)
        else:
            assert "refined from the layer before's output for none (experimental tier.refine=off)" in str(report)
    tier_mod.REFINE = True  # (the switch is process-wide)


@pytest.mark.parametrize("skip", [True, False])
def test_a_read_ahead_that_went_unused_is_not_repeated_until_the_expert_is_used(tmp_path, skip):
    """A router that keeps predicting an expert its layer does not choose must not make the tier
    read it again at every token (lfu ranks a never-used expert last and evicts it at once);
    skip_unused_reads=False (experimental tier.skip_unused_reads=off) reads it again."""
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, policy="lfu", prediction_window=1, prediction_extra=0, prediction_max_rows=1,
                 skip_unused_reads=skip)
    t0, _ = blk.tiered(tier)
    t1, l1 = blk.tiered(tier)
    x, idx, w = _problem(1, 1, blk.E, 9, experts=[0])
    router = (torch.randn(blk.E, H, generator=torch.Generator().manual_seed(10)) * 0.01).bfloat16()
    router[6] = x[0]  # layer 1's router picks 6 for x
    tier.set_router(l1, router, None, 1)
    _fwd(t0, x, idx, w)
    tier.drain()
    assert tier.resident(l1) == [6] and tier.stats()["prefetch_issued"] == 1
    _touch(t1, blk, [1, 2])  # layer 1 chooses others: 6 is evicted unused
    assert 6 not in tier.resident(l1)
    s = tier.stats()
    assert s["prefetch_unused"] == 1 and s["prefetch_skipped"] == 0
    _fwd(t0, x, idx, w)  # predicted again, not read again
    tier.drain()
    s = tier.stats()
    if not skip:
        assert 6 in tier.resident(l1) and s["prefetch_issued"] == 2 and s["prefetch_skipped"] == 0
        return
    assert 6 not in tier.resident(l1) and s["prefetch_issued"] == 1 and s["prefetch_skipped"] == 1
    assert s["layers"][1]["predicted"] == 2  # (recall and precision still count the prediction)
    _touch(t1, blk, [6, 3, 4])  # used once (which lifts the rule), then evicted
    assert 6 not in tier.resident(l1)
    _fwd(t0, x, idx, w)
    tier.drain()
    assert tier.stats()["prefetch_issued"] == 2 and 6 in tier.resident(l1)
    _touch(t1, blk, [1, 2])  # unused again
    tier.forget_uses()  # forgets that too
    _fwd(t0, x, idx, w)
    tier.drain()
    assert tier.stats()["prefetch_issued"] == 3 and 6 in tier.resident(l1)


def test_prefetch_queues_reads_and_bad_ids_are_refused(tmp_path):
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 3)
    tp, layer = blk.tiered(tier)
    tier.prefetch(layer, [4, 1])
    tier.drain()
    assert tier.resident(layer) == [1, 4]
    assert tier.stats()["prefetch_issued"] == 2 and tier.stats()["reads"] == 2
    _touch(tp, blk, [4])
    assert tier.stats()["hits"] == 1 and tier.stats()["misses"] == 0
    with pytest.raises(ValueError, match="expert 8 out of range"):
        tier.prefetch(layer, [8])
    with pytest.raises(ValueError, match="no layer 1"):
        tier.resident(1)
    x, idx, w = _problem(1, 1, blk.E, 0, experts=[8])
    with pytest.raises(ValueError, match="expert index 8 >= E = 8"):
        _fwd(tp, x, idx, w)
    # more experts a token than the pool holds
    x, idx, w = _problem(1, 4, blk.E, 0, experts=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="raise memory_limit"):
        _fwd(tp, x, idx, w)


def test_bad_tier_arguments_are_refused_naming_them(tmp_path):
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    with pytest.raises(ValueError, match="num_slots"):
        native.ExpertTier(blk.slot_bytes, 0)
    with pytest.raises(ValueError, match="slot_bytes must be a multiple of 4096"):
        native.ExpertTier(blk.slot_bytes + 1, 2)
    with pytest.raises(ValueError, match="eviction policy 'mru' is unknown"):
        native.ExpertTier(blk.slot_bytes, 2, policy="mru")
    with pytest.raises(ValueError, match="io_threads"):
        native.ExpertTier(blk.slot_bytes, 2, io_threads=0)
    tier = _tier(blk, 2)
    with pytest.raises(ValueError, match="one CRC per expert"):
        tier.add_layer(str(blk.path), blk.E, blk.off, blk.gu, blk.off + blk.E * blk.gu, blk.dn, blk.crc_gu[:-1],
                       blk.crc_dn)
    small = native.ExpertTier(8192, 2)
    with pytest.raises(ValueError, match="do not fit a slot of 8192 bytes"):
        blk.register(small)
    missing = tmp_path / "missing.hnm"
    with pytest.raises(native.TierError, match=f"cannot open {re.escape(str(missing))}"):
        tier.add_layer(str(missing), blk.E, 0, blk.gu, blk.E * blk.gu, blk.dn, blk.crc_gu, blk.crc_dn)
    layer = blk.register(tier)
    with pytest.raises(ValueError, match="bias region"):
        native.packed_tiered(blk.pe.header, tier, layer, np.zeros(64, np.uint8))
    other = _block(tmp_path / "other.hnm", E=4)
    with pytest.raises(ValueError, match="experts, the header 4"):
        native.packed_tiered(other.pe.header, tier, layer, other.rest)


def test_a_file_truncated_before_it_is_registered_is_refused(tmp_path):
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    os.truncate(blk.path, blk.off + blk.E * (blk.gu + blk.dn) - 1)
    path = re.escape(str(blk.path))
    with pytest.raises(native.TierError, match=rf"{path} is truncated: .* bytes, its experts end at"):
        blk.register(_tier(blk, 2))


def test_an_offset_the_kernels_cannot_take_is_refused_at_registration(tmp_path):
    blk = _block(tmp_path / "block.hnm", off=8192 + 100)
    with pytest.raises((ValueError, _native().TierError), match="offset"):
        blk.register(_tier(blk, 2))  # (not forwarded here: it crashes the process)


# ---- faults -------------------------------------------------------------------------------------

def _run_in_thread(fn, timeout=20.0):
    """fn() in a thread; fails (rather than hangs) when it does not return within `timeout`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"no return within {timeout} s: the tier is stuck"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize("fault,what", [
    (dict(fault_flip_every=1), "checksum mismatch (CRC-32C 0x"),
    (dict(fault_eio_every=1), "read error: Input/output error"),
    (dict(fault_short_every=1), "short read"),
])
def test_a_read_that_fails_twice_raises_naming_the_file_and_expert(tmp_path, fault, what):
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, io_threads=1, **fault)
    tp, _ = blk.tiered(tier)
    x, idx, w = _problem(1, 1, blk.E, 0, experts=[5])
    with pytest.raises(native.TierError) as err:
        _fwd(tp, x, idx, w)
    assert isinstance(err.value, OSError)
    msg = str(err.value)
    assert msg.startswith("hi_na_moe memory tier: layer 0, expert 5's gate/up panels")
    assert str(blk.path) in msg and what in msg and msg.endswith("(read twice)")
    s = tier.stats()
    assert s["retries"] == 1 and s["reads"] == 0 and tier.resident(0) == []


def test_a_short_read_is_read_again_and_the_outputs_stay_exact(tmp_path):
    blk = _block(tmp_path / "block.hnm")
    # every 3rd pread (two an expert) is cut short: each expert after the first is read twice
    tier = _tier(blk, 3, io_threads=1, fault_short_every=3)
    tp, _ = blk.tiered(tier)
    for T, seed in ((1, 1), (4, 2), (7, 3)):
        x, idx, w = _problem(T, 2, blk.E, seed)
        assert torch.equal(_fwd(tp, x, idx, w), _fwd(blk.pe, x, idx, w))
    s = tier.stats()
    assert s["retries"] > 0 and s["retries"] == s["reads"] - 1


def test_a_file_truncated_while_in_use_fails_that_expert_and_the_tier_keeps_working(tmp_path):
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, io_threads=2)
    tp, _ = blk.tiered(tier)
    last = blk.E - 1
    os.truncate(blk.path, blk.off + blk.E * blk.gu + last * blk.dn + blk.dn // 2)  # into the last down panels
    x, idx, w = _problem(1, 2, blk.E, 0, experts=[0, last])
    with pytest.raises(native.TierError) as err:
        _fwd(tp, x, idx, w)
    msg = str(err.value)
    assert f"expert {last}'s down panels ({blk.path}" in msg and "short read" in msg and "truncated" in msg
    # the step lock and the slots were given back: a later call on the experts left runs
    x, idx, w = _problem(3, 2, blk.E, 1, experts=[0, 1, 1, 2, 2, 0])
    assert torch.equal(_run_in_thread(lambda: _fwd(tp, x, idx, w)), _fwd(blk.pe, x, idx, w))


def test_a_corrupt_expert_on_disk_fails_until_it_is_repaired(tmp_path):
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    tier = _tier(blk, 2, io_threads=1)
    tp, _ = blk.tiered(tier)
    where = [blk.off + blk.E * blk.gu + 2 * blk.dn + 17]  # expert 2's down panels
    _flip(blk.path, where)
    x, idx, w = _problem(1, 2, blk.E, 0, experts=[1, 2])
    with pytest.raises(native.TierError, match=r"expert 2's down panels .*checksum mismatch"):
        _fwd(tp, x, idx, w)
    x1, idx1, w1 = _problem(1, 2, blk.E, 1, experts=[1, 3])
    assert torch.equal(_run_in_thread(lambda: _fwd(tp, x1, idx1, w1)), _fwd(blk.pe, x1, idx1, w1))
    _flip(blk.path, where)
    assert torch.equal(_run_in_thread(lambda: _fwd(tp, x, idx, w)), _fwd(blk.pe, x, idx, w))


def test_a_failed_call_gives_back_every_slot_it_asked_for(tmp_path):
    # Two slow predicted reads (8 MiB experts of another layer) hold two of the four slots while a
    # call demands four experts, the first corrupt: the call fails while some of its demanded reads
    # wait for a slot. Any that waits past the failure must not stay pinned.
    native = _native()
    blk = _block(tmp_path / "block.hnm")
    bad = Path(tmp_path / "bad.hnm")
    bad.write_bytes(blk.path.read_bytes())
    _flip(bad, [blk.off + 7])  # expert 0's gate/up panels
    big_bytes = 8 << 20
    big = np.random.default_rng(0).integers(0, 256, 2 * big_bytes + 2 * 4096, dtype=np.uint8)
    big_path = tmp_path / "big.hnm"
    big.tofile(big_path)
    big_crc_gu = [int(native.crc32c(big[e * big_bytes:(e + 1) * big_bytes])) for e in range(2)]
    big_crc_dn = [int(native.crc32c(big[2 * big_bytes + e * 4096:2 * big_bytes + (e + 1) * 4096])) for e in range(2)]
    for attempt in range(10):  # the slow reads must still be under way when the call fails
        tier = native.ExpertTier(int(native.tier_slot_bytes(big_bytes, 4096)), 4, io_threads=6, prediction_window=0)
        layer = tier.add_layer(str(bad), blk.E, blk.off, blk.gu, blk.off + blk.E * blk.gu, blk.dn, blk.crc_gu,
                               blk.crc_dn)
        tp = native.packed_tiered(blk.pe.header, tier, layer, blk.rest)
        slow = tier.add_layer(str(big_path), 2, 0, big_bytes, 2 * big_bytes, 4096, big_crc_gu, big_crc_dn)
        tier.prefetch(slow, [0, 1])
        time.sleep(0.002)
        x, idx, w = _problem(1, 4, blk.E, attempt, experts=[0, 1, 2, 3])
        with pytest.raises(native.TierError, match="expert 0's gate/up panels"):
            _fwd(tp, x, idx, w)
        x, idx, w = _problem(1, 4, blk.E, attempt, experts=[4, 5, 6, 7])
        assert torch.equal(_run_in_thread(lambda: _fwd(tp, x, idx, w), timeout=3), _fwd(blk.pe, x, idx, w))
        tier.drain()


# ---- concurrency --------------------------------------------------------------------------------

def test_threads_on_tiered_blocks_get_the_single_thread_outputs(tmp_path):
    a = _block(tmp_path / "a.hnm", seed=1)
    b = _block(tmp_path / "b.hnm", seed=2)
    tier = _tier(a, 3, io_threads=2, prediction_window=1)
    ta, _ = a.tiered(tier)
    tb, lb = b.tiered(tier)
    router = (torch.randn(b.E, H, generator=torch.Generator().manual_seed(3)) * 0.1).bfloat16()
    tier.set_router(lb, router, None, 2)  # predicted reads of b run beside the calls on a
    own = _native().ExpertTier(a.slot_bytes, 2, io_threads=1, prediction_window=0)
    ta_own, _ = a.tiered(own)  # the same experts again, alone in a pool of two slots
    jobs = []
    for j in range(4):
        blocks = [(ta, a), (tb, b), (ta_own, a)]
        for i in range(20):
            tp, blk = blocks[(i + j) % 3]
            x, idx, w = _problem(1 + (3 * i + j) % 7, 2, blk.E, 1000 * j + i)
            jobs.append((j, tp, blk.pe, x, idx, w))
    want = [_fwd(pe, x, idx, w) for _, _, pe, x, idx, w in jobs]
    got = [None] * len(jobs)
    errors = []

    def worker(j):
        try:
            for n, (jj, tp, _, x, idx, w) in enumerate(jobs):
                if jj == j:
                    got[n] = _fwd(tp, x, idx, w)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 60 s: deadlock"
    assert not errors, errors
    for n, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"call {n} differs from its single-thread output"
    s = tier.stats()
    assert s["hits"] + s["misses"] == s["demanded"] and s["evictions"] > 0


# ---- a cgroup -----------------------------------------------------------------------------------

_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import hi_na_moe
from hi_na_moe.core import limits
from hi_na_moe.core import tier as tier_mod
from hi_na_moe.integrate import tiering
from tiny_models import build_tiny
kw = json.loads(sys.argv[3])
kw["dtype"] = torch.bfloat16
m = build_tiny("olmoe", **kw).model
ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
hi_na_moe.enable_for_model(m, weights="int4", cache_dir=sys.argv[2])
with torch.no_grad():
    want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
hi_na_moe.disable_for_model(m)
report = hi_na_moe.enable_for_model(m, weights="int4", cache_dir=sys.argv[2], memory_limit=sys.argv[4])
with torch.no_grad():
    got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
plan = tiering._STATES[m].plan
print(json.dumps(dict(process_memory=limits.process_memory(), tier=hi_na_moe.stats(m)["memory_tier"],
                      slot_bytes=plan.slot_bytes, num_slots=plan.num_slots, equal=torch.equal(got, want),
                      report=str(report))))
"""


def _memory_cgroup_v1() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            d = Path("/sys/fs/cgroup/memory") / parts[2].strip("/")
            return d if (d / "memory.limit_in_bytes").exists() else None
    return None


def test_in_a_memory_cgroup_a_percentage_is_of_its_limit_and_decode_stays_within_it(tmp_path):
    parent = _memory_cgroup_v1()
    if parent is None:
        pytest.skip("no cgroup v1 memory controller for this process")
    group = parent / f"hina-moe-tier-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
    limit = 1 << 30  # the child's peak: 0.28 GiB (memory.max_usage_in_bytes, 2026-12-07)
    pct = "0.02%"
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        assert int((group / "memory.limit_in_bytes").read_text()) == limit
        script = tmp_path / "child.py"
        script.write_text(_CHILD)
        tiny = {k: v for k, v in TINY.items() if k != "dtype"}
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"), sys.executable, str(script),
               str(TESTS), str(tmp_path / "store"), json.dumps(tiny), pct]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert int((group / "memory.failcnt").read_text()) == 0
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert out["process_memory"] == limit  # the cgroup's limit, not MemTotal
    expected = (limit * 2 // 10000) // out["slot_bytes"]
    assert out["tier"] is True and out["num_slots"] == expected >= K_MODEL
    assert f"{expected} expert slots" in out["report"]
    assert out["equal"] is True
