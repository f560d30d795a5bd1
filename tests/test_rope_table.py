"""hi_na_moe.fastpath.rope_table: a rotary module's cos/sin for one position read from a table of its own
outputs. Against the module called on that position alone: the same bits at every position of
two table sizes (and across a growth), per dtype and rope type; the module called instead as
soon as something could tell (a hook, a forward set on the object, a frequency-rewriting rope
type, inv_freq changed, a module whose rows differ); and the decode steps of a stack reading it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_decode, olmoe

import hi_na_moe
from hi_na_moe.fastpath import linear, rope_table
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner
from hi_na_moe.fastpath.rope_table import RopeTable


def _rotary(dtype=torch.bfloat16, rope_parameters=None, head_dim=64):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeRotaryEmbedding

    cfg = OlmoeConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096)
    if rope_parameters is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, **rope_parameters}
    return OlmoeRotaryEmbedding(cfg), torch.zeros(1, 1, head_dim * 4, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}])
def test_every_row_is_the_modules_own_output_for_that_position(dtype, rope, monkeypatch):
    monkeypatch.setattr(rope_table, "FIRST_ROWS", 64)
    rot, x = _rotary(dtype, rope)
    table = RopeTable(rot)
    with torch.no_grad():
        for p in list(range(200)) + [511, 1000]:  # the table grows 64 -> 128 -> 256 -> 512 -> 1024
            got = table.lookup(x, p)
            assert got is not None, table.broken
            want = rot(x, torch.tensor([[p]]))
            for g, w in zip(got, want):
                assert g.shape == w.shape == (1, 1, x.shape[-1] // 4) and g.dtype is w.dtype is dtype
                assert torch.equal(_bits(g), _bits(w)), p
    assert table.cos.shape[1] == 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_for_position_ids_are_the_modules_output_for_them(dtype, monkeypatch):
    monkeypatch.setattr(rope_table, "FIRST_ROWS", 64)
    rot, x = _rotary(dtype)
    table = RopeTable(rot)
    with torch.no_grad():
        for ids in ([[5]], [[3], [900], [0]], [[7], [7]], [[1], [2], [3], [4]]):
            for idt in (torch.int64, torch.int32):
                pos = torch.tensor(ids, dtype=idt)
                got = table.lookup_ids(x, pos)
                assert got is not None, table.broken
                want = rot(x, pos)
                for g, w in zip(got, want):
                    assert g.shape == w.shape == (len(ids), 1, x.shape[-1] // 4) and g.dtype is w.dtype is dtype
                    assert torch.equal(_bits(g), _bits(w)), ids
        assert table.cos.shape[1] == 1024  # grown to reach position 900
        assert table.lookup_ids(x, torch.tensor([[-1]])) is None
        assert table.lookup_ids(x, torch.tensor([[2], [-1]])) is None
        assert table.lookup_ids(x, torch.tensor([[2.0]])) is None  # float positions: the module's
        assert table.lookup_ids(x, torch.tensor([[1], [rope_table.MAX_ROWS]])) is None


def test_the_module_is_called_when_something_could_tell(monkeypatch):
    rot, x = _rotary()
    table = RopeTable(rot)
    assert table.lookup(x, 5) is not None
    handle = rot.register_forward_hook(lambda *a: None)
    assert table.lookup(x, 5) is None  # a hook would miss the call
    handle.remove()
    handle = rot.register_forward_pre_hook(lambda *a: None)
    assert table.lookup(x, 5) is None
    handle.remove()
    rot.forward = lambda *a: None  # a forward set on the object
    assert table.lookup(x, 5) is None
    del rot.forward
    assert table.lookup(x, 5) is not None
    assert table.lookup(x, rope_table.MAX_ROWS) is None  # beyond the largest table
    dyn, _ = _rotary(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert RopeTable(dyn).lookup(x, 5) is None  # frequencies rewritten as the sequence grows
    with torch.no_grad():  # inv_freq rewritten in place: a new table from the new frequencies
        before = table.lookup(x, 7)[0].clone()
        rot.inv_freq.mul_(0.5)
        after = table.lookup(x, 7)[0]
        assert not torch.equal(before, after)
        assert torch.equal(_bits(after), _bits(rot(x, torch.tensor([[7]]))[0]))
        rot.inv_freq = rot.inv_freq * 2  # replaced
        assert torch.equal(_bits(table.lookup(x, 7)[0]), _bits(before))
        rot.attention_scaling = 2.0
        assert torch.equal(_bits(table.lookup(x, 7)[0]), _bits(rot(x, torch.tensor([[7]]))[0]))


def test_a_module_whose_rows_differ_is_called_for_good():
    rot, x = _rotary()
    own = type(rot).forward

    class Odd(type(rot)):  # position-dependent output when called on several positions at once
        def forward(self, x, position_ids):
            cos, sin = own(self, x, position_ids)
            return (cos + 1, sin) if position_ids.shape[-1] > 1 else (cos, sin)

    rot.__class__ = Odd
    table = RopeTable(rot)
    assert table.lookup(x, 3) is None
    assert table.broken is not None and "differs" in table.broken
    rot.__class__ = Odd.__mro__[1]
    assert table.lookup(x, 3) is None  # dropped for good


@pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
def test_a_stacks_decode_reads_the_table_and_gives_the_own_forwards_bits(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(rope_table, "FIRST_ROWS", 8)  # grows during the decode
    model = olmoe(layers=2)
    ids = torch.tensor([[3, 9, 4, 7, 5, 6]])
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        stack = patched_runner(model.model)
        patched = model.model.__dict__.pop("forward")  # the stack's own forward: the module called
        try:
            want, _ = greedy_decode(model, ids, 6)
        finally:
            model.model.forward = patched
        got, _ = greedy_decode(model, ids, 6)
        assert stack.rope.broken is None and stack.rope.cos.shape[1] == 16
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        # a hook on the rotary module: it is called at every step again, same bits
        calls = []
        handle = model.model.rotary_emb.register_forward_hook(lambda *a: calls.append(1))
        try:
            again, _ = greedy_decode(model, ids, 6)
        finally:
            handle.remove()
        assert len(calls) == 1 + 6 and all(torch.equal(g, w) for g, w in zip(again, want))
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
def test_generate_reads_the_table_for_the_position_ids_it_passes(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # a left-padded row: positions differ
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        read, own = [], RopeTable.lookup_ids

        def counted(self, x, position_ids):
            out = own(self, x, position_ids)
            read.append((tuple(position_ids.reshape(-1).tolist()), out is not None))
            return out

        monkeypatch.setattr(RopeTable, "lookup_ids", counted)
        with torch.inference_mode():
            got = model.generate(ids, attention_mask=mask, **kw)
        # generate passes position_ids at every decode step; the padded row is 2 positions behind
        assert read == [((4 + i, 6 + i), True) for i in range(4)]
        patched = model.model.__dict__.pop("forward")  # the stack's own forward: the module called
        try:
            with torch.inference_mode():
                want = model.generate(ids, attention_mask=mask, **kw)
        finally:
            model.model.forward = patched
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
def test_a_dynamic_rope_stack_calls_its_module_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = olmoe(layers=2)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    from transformers.models.olmoe.modeling_olmoe import OlmoeRotaryEmbedding

    model.model.rotary_emb = OlmoeRotaryEmbedding(model.config)
    ids = torch.tensor([[3, 9, 4, 7]])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.stacks == ["model"]
        why = rep.stacks_rotary_module["model"]
        assert "'dynamic'" in why and "calls its rotary module at every step" in str(rep)
        patched = model.model.__dict__.pop("forward")
        try:
            want, _ = greedy_decode(model, ids, 3)
        finally:
            model.model.forward = patched
        got, _ = greedy_decode(model, ids, 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert patched_runner(model.model).rope.cos is None  # never built
    finally:
        hi_na_moe.disable_for_model(model)
