"""The raw entry points' checking mode (csrc/binding/raw.cpp): on in the tests (conftest.py sets
HINA_CHECK_RAW=1), a raw call whose address, size or stride is wrong raises a ValueError naming
the entry point and the argument instead of crashing the process."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

_native = pytest.importorskip("hi_na_moe._native", reason="native extension not built")

_F32 = 0


def test_checks_are_on_in_the_tests():
    assert _native.raw_checks()


def test_a_good_raw_call_still_runs_and_matches_the_checked_op():
    x = torch.randn(3, 64)
    w = torch.randn(64)
    out, ref = torch.empty_like(x), torch.empty_like(x)
    _native.rms_norm_raw(x.data_ptr(), 3, 64, w.data_ptr(), 1e-6, out.data_ptr(), _F32)
    _native.rms_norm(x, w, 1e-6, ref)
    assert torch.equal(out, ref)


def test_an_unmapped_address_raises_naming_the_entry_point_and_argument():
    w = torch.randn(64)
    out = torch.empty(3, 64)
    with pytest.raises(ValueError, match=r"rms_norm_raw: x = 0x40 for 768 bytes is not mapped memory"):
        _native.rms_norm_raw(0x40, 3, 64, w.data_ptr(), 1e-6, out.data_ptr(), _F32)


def test_a_null_address_raises():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"rms_norm_raw: out is a null address for 768 bytes"):
        _native.rms_norm_raw(x.data_ptr(), 3, 64, x.data_ptr(), 1e-6, 0, _F32)


def test_a_size_far_past_the_buffer_raises():
    a, b, s = torch.zeros(16), torch.zeros(16), torch.zeros(16)
    with pytest.raises(ValueError, match=r"add_raw: a = 0x[0-9a-f]+ for \d+ bytes is not mapped memory"):
        _native.add_raw(a.data_ptr(), b.data_ptr(), 1 << 44, s.data_ptr(), _F32)


def test_a_bad_dtype_code_and_a_negative_size_raise():
    x = torch.zeros(16)
    with pytest.raises(ValueError, match=r"add_raw: dtype = 7 is not a dtype code"):
        _native.add_raw(x.data_ptr(), x.data_ptr(), 16, x.data_ptr(), 7)
    with pytest.raises(ValueError, match=r"rms_norm_raw: rows = -1 is negative"):
        _native.rms_norm_raw(x.data_ptr(), -1, 16, x.data_ptr(), 1e-6, x.data_ptr(), _F32)


def test_an_output_overlapping_an_input_it_may_not_overlap_raises():
    x = torch.randn(5, 64)  # out = rows 1-4 of x, inside its buffer
    w = torch.randn(64)
    with pytest.raises(ValueError, match=r"rms_norm_raw: out \[0x[0-9a-f]+, \+1024\) overlaps x"):
        _native.rms_norm_raw(x.data_ptr(), 4, 64, w.data_ptr(), 1e-6, x[1:].data_ptr(), _F32)


def test_a_wrong_stride_raises_naming_the_strided_argument():
    B, Hq, Hkv, S, D = 1, 2, 1, 4, 16
    q = torch.randn(B, Hq, D)
    kv = torch.randn(B, Hkv, S, D)
    out = torch.empty(B, Hq, D)
    good = kv.stride()
    bad_s = (good[0], good[1], 1 << 40)  # a sequence stride of 2^40 elements
    args = dict(dtype=_F32, q=q.data_ptr(), B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, scale=0.25, out=out.data_ptr(),
                num_threads=1, isa="generic", mask=0, mask_bstride=0, sinks=0)
    _native.attention_decode_raw(*_attn(args, kv, good, kv, good))
    with pytest.raises(ValueError, match=r"attention_decode_raw: v = 0x[0-9a-f]+ for \d+ bytes is not mapped"):
        _native.attention_decode_raw(*_attn(args, kv, good, kv, bad_s))


def _attn(args, k, ks, v, vs):
    order = ["dtype", "q", "B", "Hq", "Hkv", "S", "D", "k", "ks0", "ks1", "ks2", "v", "vs0", "vs1", "vs2", "scale",
             "out", "num_threads", "isa", "mask", "mask_bstride", "sinks"]
    a = dict(args, k=k.data_ptr(), ks0=ks[0], ks1=ks[1], ks2=ks[2], v=v.data_ptr(), vs0=vs[0], vs1=vs[1], vs2=vs[2])
    return [a[name] for name in order]  # (positional: the binding names no arguments)


def test_without_checks_the_same_bad_call_crashes_the_process():
    # what the checking mode prevents (and why it is on in the tests): the unchecked call faults
    code = (
        "import torch\n"
        "from hi_na_moe import _native\n"
        "assert not _native.raw_checks()\n"
        "w = torch.randn(64); out = torch.empty(3, 64)\n"
        "_native.rms_norm_raw(0x40, 3, 64, w.data_ptr(), 1e-6, out.data_ptr(), 0)\n"
    )
    env = dict(os.environ, HINA_CHECK_RAW="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    assert r.returncode < 0, (r.returncode, r.stderr[-2000:])
