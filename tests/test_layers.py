"""scope="all" (hi_na_moe.fastpath.layers): a pre-norm decoder layer's decode step in few native calls.
The residual-add kernels against PyTorch's add (bit for bit); the short path against the same
enabled model with its layers on their own forward (the same logits and cache, bit for bit) on
the families the tiny models cover; and every call that must stay the layer's own (prefill,
hooks on the modules it skips, a module replaced after enable, a layer of another shape)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import UNBUILDABLE, build_tiny, greedy_decode, olmoe
from transformers import DynamicCache

import hi_na_moe
from hi_na_moe.fastpath import linear
from hi_na_moe.core import torch_ops
from hi_na_moe.integrate.families import moe_families
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native():
    from hi_na_moe import _native

    return _native


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_add_and_add_rms_norm_are_pytorchs_add_and_the_norm_kernel_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    n = _native()
    for rows, width in ((1, 2048), (3, 17)):
        a = (torch.randn(rows, width, generator=gen) * 8).to(dtype)
        b = (torch.randn(rows, width, generator=gen) * 8).to(dtype)
        w = torch.randn(width, generator=gen).to(dtype)
        s = torch.empty_like(a)
        n.add_raw(a.data_ptr(), b.data_ptr(), a.numel(), s.data_ptr(), DTYPES[dtype])
        assert torch.equal(s, a + b)
        want = torch.empty_like(a)
        n.rms_norm_raw(s.data_ptr(), rows, width, w.data_ptr(), 1e-5, want.data_ptr(), DTYPES[dtype])
        s2, out = torch.full_like(a, 7), torch.full_like(a, 7)
        n.add_rms_norm_raw(a.data_ptr(), b.data_ptr(), rows, width, w.data_ptr(), 1e-5, s2.data_ptr(),
                           out.data_ptr(), DTYPES[dtype])
        assert torch.equal(s2, a + b) and torch.equal(out, want)


class _Count:
    """Counts the decode calls the layers take on their short path (calls), those of them run in
    the two native calls (native), and those whose experts ran inside the second (fused);
    fusable: the layers whose MoE block can (its short path; a shared expert on the native MLP
    call with its gate on the dense kernel); shared: those of them with a shared expert."""

    def __init__(self, model):
        self.calls = self.native = self.fused = self.fusable = self.shared = 0
        rep = hi_na_moe.report_for(model)
        mods = dict(model.named_modules())
        for name in rep.layers:
            runner = patched_runner(mods[name])
            fast, native_fast = runner._fast, runner._native_fast
            if runner.moe is not None and (not runner.moe.shared or runner.moe.shared_native is not None):
                self.fusable += 1
                self.shared += runner.moe.shared
                experts = runner.moe.experts

                def bound_for(*args, _bound_for=experts.bound_for):
                    out = _bound_for(*args)
                    self.fused += out is not None
                    return out

                experts.bound_for = bound_for

            def counted(*args, _fast=fast, **kwargs):
                self.calls += 1
                return _fast(*args, **kwargs)

            def counted_native(*args, _native_fast=native_fast, **kwargs):
                out = _native_fast(*args, **kwargs)
                self.native += out is not None
                return out

            runner._fast, runner._native_fast = counted, counted_native


def _own_forward(model, on: bool, saved: dict) -> None:
    """Puts the patched layers on their own forward (on=True) or back on the short path."""
    mods = dict(model.named_modules())
    for name in hi_na_moe.report_for(model).layers:
        m = mods[name]
        if on:
            saved[name] = m.__dict__.pop("forward")
        else:
            m.forward = saved[name]




def _same_decode(model, ids, steps=4, attention_mask=None, native=False):
    """The short path against the layers' own forward: the same logits and cache, bit for bit;
    native: every step of every layer in the two native calls, with the experts in the second
    where the MoE block allows it."""
    count = _Count(model)
    got, c_got = greedy_decode(model, ids, steps, attention_mask)
    assert count.calls == steps * len(hi_na_moe.report_for(model).layers)
    assert count.native == (count.calls if native else 0)
    assert count.fused == (steps * count.fusable if native else 0)
    saved: dict = {}
    _own_forward(model, True, saved)
    try:
        want, c_want = greedy_decode(model, ids, steps, attention_mask)
    finally:
        _own_forward(model, False, saved)
    assert count.calls == steps * len(hi_na_moe.report_for(model).layers)  # none on the own forwards
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for lg, lw in zip(c_got.layers, c_want.layers):
        assert torch.equal(lg.keys, lw.keys) and torch.equal(lg.values, lw.values)
    return count


FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(autouse=True)
def _layer_by_layer(monkeypatch):
    """These tests count and compare the layers' own calls: the stack's one native call
    (tested in test_stack.py) would skip them."""
    from hi_na_moe.fastpath import stack

    monkeypatch.setattr(stack, "ONE_CALL", False)


@pytest.mark.parametrize("all_linears", [False, True], ids=["tiny-projections-left-to-pytorch", "every-linear-native"])
@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in {x.model_type for x in moe_families()}])
def test_known_families_decode_on_the_short_path_bit_for_bit(model_type, all_linears, monkeypatch):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    if all_linears:  # the tiny models' projections are below linear.MIN_WEIGHTS: the two native calls need them packed
        monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    model = build_tiny(model_type, dtype=torch.bfloat16).model.eval()
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        layers = [n for n, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
        assert rep.layers == layers and not rep.layers_differ
        assert f"decoder layers with decode steps in few native calls: {len(layers)}" in str(rep)
        ids = torch.tensor([[3, 9, 4, 7]])
        count = _same_decode(model, ids, native=all_linears)
        # the experts inside the second native call, Qwen2-MoE's shared expert and its gate too
        assert (count.fused > 0) == all_linears
        assert (count.shared > 0) == (all_linears and model_type == "qwen2_moe")
        if model_type == "qwen2_moe":
            n = len(layers)
            assert rep.mlps == [f"model.layers.{i}.mlp.shared_expert" for i in range(n)] if all_linears else not rep.mlps
            assert f"gated MLPs (shared experts, dense MLPs) with decode steps in one native call: {n}" in str(rep) \
                or not all_linears
        # a padded batch: a bool mask over the keys reaches the attention kernel
        _same_decode(model, torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]]), 3,
                     attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), native=all_linears)
    finally:
        hi_na_moe.disable_for_model(model)
    assert all("forward" not in dict(model.named_modules())[n].__dict__ for n in layers)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantised_experts_and_linears_decode_in_the_two_native_calls_bit_for_bit(weights, tmp_path):
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)  # grouped-query heads, k/v large enough to pack
    hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache_dir=str(tmp_path))
    try:
        assert _same_decode(model, torch.tensor([[5, 6, 7, 8, 9]]), 5, native=True).fused == 2 * 5
        # a fused call still records the kernel it ran, for reports
        experts = [patched_runner(layer).moe.experts for layer in model.model.layers]
        for e in experts:
            torch_ops._LAST_KERNEL.pop(e.handle)
        greedy_decode(model, torch.tensor([[5, 6, 7]]), 1)
        assert all(e.last_kernel.startswith(f"moe_decode_{weights}_") for e in experts)
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_layers_partial_plan_checks_its_scratch_and_runs_only_its_two_calls():
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = patched_runner(model.model.layers[0])
        dt, B = runner.attn.dtype, 2
        weights = runner._norm_weights(dt)
        plan, parts, nbytes, regions = runner._layer_call(dt, B, weights)
        assert parts == (True, True, True, False)  # the logits, the selection, the experts; no dense MLP
        assert nbytes == plan.scratch_bytes(B) == regions["total"]
        assert all(regions[n] % 64 == 0 and regions[n] < nbytes for n in ("q", "normed", "logits", "w", "idx"))
        assert runner._layer_call(dt, B, weights)[0] is plan  # held while nothing it holds changes
        x = torch.zeros(B, runner.hidden, dtype=dt)
        small = torch.empty(nbytes - 1, dtype=torch.uint8)
        kv = (x.data_ptr(), x.data_ptr(), 0, 0, 0, 1, 0, 0, 0)
        with pytest.raises(ValueError, match=rf"layer_pre: scratch of {nbytes - 1} bytes, the layer needs {nbytes}"):
            plan.layer_pre(B, x.data_ptr(), 0, 0, 0, kv, small.data_ptr(), small.numel())
        with pytest.raises(ValueError, match="layer_post: scratch of"):
            plan.layer_post(B, x.data_ptr(), kv, 0, 0, small.data_ptr(), small.numel(), x.data_ptr())
        with pytest.raises(ValueError, match="a partial plan runs its layer's two calls apart"):
            plan.run(B, *([0] * 9))
        native = runner.native
        with pytest.raises(ValueError, match="only a partial plan"):
            native.StepPlan(1).layer_pre(B, x.data_ptr(), 0, 0, 0, kv, small.data_ptr(), small.numel())
        with pytest.raises(ValueError, match="holds one layer"):
            native.StepPlan(2, partial=True)
        args = dict(runner._layer_args(dt, B, weights, False)[1], experts=None, shared=())
        with pytest.raises(ValueError, match="needs its selection .* and experts"):  # the stack's plan: the whole block
            native.StepPlan(1).set_layer(0, **args)
        native.StepPlan(1, partial=True).set_layer(0, **args)  # a partial one: the experts left to the caller
    finally:
        hi_na_moe.disable_for_model(model)


def test_below_the_attention_kernels_tiers_sdpa_does_the_math_between_the_two_native_calls(monkeypatch):
    from hi_na_moe.fastpath import attention

    model = olmoe(layers=2, kv_heads=4)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        for layer in model.model.layers:  # as on a CPU below the kernels' tiers
            monkeypatch.setattr(patched_runner(layer.self_attn), "kernel", False)
        calls = []
        monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                            lambda *a, _f=attention.F.scaled_dot_product_attention, **k: calls.append(1) or _f(*a, **k))
        _same_decode(model, torch.tensor([[5, 6, 7, 8]]), 3, native=True)
        assert len(calls) >= 2 * 3 * 2  # both arms' decode steps, every layer
    finally:
        hi_na_moe.disable_for_model(model)


def test_generate_with_a_static_cache_takes_the_two_native_calls_bit_for_bit():
    from transformers import StaticCache

    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)

        def run():
            with torch.inference_mode():
                cache = StaticCache(config=model.config, max_cache_len=32)
                return model.generate(ids, past_key_values=cache, **kw).logits

        got = run()
        assert count.native == count.calls == 4 * 2  # the decode steps after the first token, both layers
        saved: dict = {}
        _own_forward(model, True, saved)
        try:
            want = run()
        finally:
            _own_forward(model, False, saved)
        assert count.calls == 8
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        hi_na_moe.disable_for_model(model)


def test_norm_weights_replaced_after_enable_are_read_at_every_step():
    model = olmoe(layers=2, kv_heads=2, hidden=512, heads=8)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        layer = model.model.layers[1]
        with torch.no_grad():
            layer.post_attention_layernorm.weight = torch.nn.Parameter(layer.post_attention_layernorm.weight * 2)
            layer.self_attn.q_norm.weight.mul_(0.5)
        _same_decode(model, torch.tensor([[5, 6, 7, 8]]), 3, native=True)
        # a weight of the wrong size after the prompt: never read by the kernels, PyTorch's own
        # error at the next step instead
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, use_cache=True)
            layer.input_layernorm.weight = torch.nn.Parameter(torch.ones(7, dtype=torch.bfloat16))
            with pytest.raises(RuntimeError, match="size of tensor"):
                model(torch.tensor([[9]]), past_key_values=cache, use_cache=True)
    finally:
        hi_na_moe.disable_for_model(model)


def test_hooks_and_replaced_modules_send_the_layer_to_its_own_forward():
    model = olmoe(layers=2, kv_heads=2)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)
        ids = torch.tensor([[5, 6, 7]])
        seen = []
        layer = model.model.layers[1]
        handle = layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        greedy_decode(model, ids, 2)
        assert count.calls == 2 and len(seen) == 3  # layer 0 only; the hook saw the prompt and both steps
        handle.remove()
        handle = layer.input_layernorm.register_forward_pre_hook(lambda m, i: seen.append("pre"))
        greedy_decode(model, ids, 2)
        assert count.calls == 4 and seen.count("pre") == 3
        handle.remove()
        from torch.nn.modules.module import register_module_forward_hook

        handle = register_module_forward_hook(lambda m, i, o: None)
        greedy_decode(model, ids, 2)
        assert count.calls == 4  # a global hook: every layer on its own forward
        handle.remove()
        # transformers' output-capturing hooks stay on the modules after a call asking for
        # hidden states; they capture only during such a call
        with torch.inference_mode():
            out = model(ids, output_hidden_states=True, output_attentions=False)
        assert len(out.hidden_states) == 3
        assert any(m._forward_hooks for m in layer.self_attn.modules())
        greedy_decode(model, ids, 2)
        assert count.calls == 8
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache, use_cache=True)
            out = model(ids[:, :1], past_key_values=cache, use_cache=True, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and count.calls == 8  # captured: the layers' own forwards
        handle = layer.mlp.experts.register_forward_hook(lambda m, i, o: seen.append("experts"))
        greedy_decode(model, ids, 2)
        assert count.calls == 10 and seen.count("experts") == 3  # the MoE block's short path skips it too
        handle.remove()
        # a part replaced after enable: the new module's own forward, never the old runners
        from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

        old_norm = layer.input_layernorm
        layer.input_layernorm = OlmoeRMSNorm(model.config.hidden_size).to(torch.bfloat16)
        seen.clear()
        layer.input_layernorm.register_forward_hook(lambda m, i, o: seen.append("new norm"))
        greedy_decode(model, ids, 2)
        assert count.calls == 12 and seen.count("new norm") == 3
        layer.input_layernorm = old_norm
        # a module's forward replaced after enable (here: the norm back on its own forward)
        layer.post_attention_layernorm.__dict__.pop("forward")
        greedy_decode(model, ids, 2)
        assert count.calls == 14
    finally:
        hi_na_moe.disable_for_model(model)


def test_prefill_training_and_unknown_arguments_run_the_layers_own_forward():
    model = olmoe(layers=2, kv_heads=2)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        count = _Count(model)
        layer = model.model.layers[0]
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(1, 1, model.config.hidden_size, generator=gen).bfloat16()
        ang = torch.rand(1, 1, layer.self_attn.head_dim // 2, generator=gen)
        emb = torch.cat([ang, ang], -1)
        pe = (emb.cos().bfloat16(), emb.sin().bfloat16())
        with torch.inference_mode():
            layer(torch.randn(1, 3, model.config.hidden_size).bfloat16(),
                  position_embeddings=(pe[0].expand(1, 3, -1), pe[1].expand(1, 3, -1)))
            layer(h, position_embeddings=pe, some_new_argument=1)
            layer(h, None, None, None, False, pe)  # positional arguments
            layer(h.repeat_interleave(2, dim=-1)[..., ::2], position_embeddings=pe)  # not contiguous
        layer.train()
        with torch.no_grad():
            layer(h, position_embeddings=pe)
        layer.eval()
        assert count.calls == 0
        with torch.inference_mode():
            want = type(layer).forward(layer, h, position_embeddings=pe)
            got = layer(h, position_embeddings=pe)  # no cache: attention over the new token alone
        assert count.calls == 1 and torch.equal(got, want)
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_layer_of_another_shape_keeps_its_own_forward_and_is_named():
    from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer

    class ScaledDecoderLayer(OlmoeDecoderLayer):  # scales its output: the probe tells
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * 0.5

    model = olmoe(layers=2, kv_heads=2)
    old = model.model.layers[1]
    new = ScaledDecoderLayer(model.config, layer_idx=1).to(torch.bfloat16)
    new.load_state_dict(old.state_dict())
    model.model.layers[1] = new
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.layers == ["model.layers.0"] and rep.layers_differ == ["model.layers.1"]
        assert "forward" not in new.__dict__
        assert "1 take their own forward" in str(rep) and "model.layers.1" in str(rep)
        assert rep.to_dict()["layers_differ"] == ["model.layers.1"]
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_moe_block_of_another_form_is_called_as_a_module_by_the_short_path():
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    class HalvedBlock(OlmoeSparseMoeBlock):  # the same children, another output: the probe tells
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 0.5

    model = olmoe(layers=2, kv_heads=2)
    old = model.model.layers[1].mlp
    new = HalvedBlock(model.config).to(torch.bfloat16)
    new.load_state_dict(old.state_dict())
    model.model.layers[1].mlp = new
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.layers == ["model.layers.0", "model.layers.1"]
        runners = [patched_runner(layer) for layer in model.model.layers]
        assert runners[0].moe is not None and runners[1].moe is None
        _same_decode(model, torch.tensor([[5, 6, 7, 8]]), 3)
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_layer_whose_attention_is_left_to_pytorch_keeps_its_own_forward():
    model = olmoe(layers=2, kv_heads=2)
    rep = hi_na_moe.enable_for_model(model, scope="all", dense_exclude="*.layers.0.self_attn")
    try:
        assert rep.attention == ["model.layers.1.self_attn"]
        assert rep.layers == ["model.layers.1"] and rep.layers_differ == ["model.layers.0"]
    finally:
        hi_na_moe.disable_for_model(model)
