"""scope="all" (hi_na_moe.fastpath.routers): the routers' logits on the native kernel for decode-sized
inputs. Against the routers' own forwards: which families match a known form, what a patched
router returns, what goes back to its own forward (prefill, training, changed settings), a
weight changed in place, the routers left to PyTorch, and the routing linears kept lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import UNBUILDABLE, build_tiny, olmoe
from transformers import DbrxConfig, DbrxForCausalLM

import hi_na_moe
from hi_na_moe.fastpath import linear, routers
from hi_na_moe.integrate.families import moe_families
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.registry import patched_runner

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")

# family -> the forms its router may match (transformers 5.x), or None: left to PyTorch. GPT-OSS's
# cast to the input's dtype is a no-op on a bf16 model, so both spellings reproduce it; a softmax
# over all experts renormalised over the top k also reproduces the small probe on some routers
# (the same function up to float32 rounding), and the larger probe must rule it out
EXPECTED = {
    "olmoe": "softmax-topk, cast", "qwen2_moe": "softmax-topk, cast", "qwen3_moe": "softmax-topk, cast",
    "mixtral": "softmax-topk, renormalised", "minimax": "softmax-topk, renormalised",
    "jamba": "softmax-topk, cast", "gpt_oss": ("topk-softmax, cast", "topk-softmax"), "granitemoe": "topk-softmax, float32 logits, cast",
    # DeepSeek-V3's grouped sigmoid form, float32 logits from a bf16 weight
    "deepseek_v3": "sigmoid-group-topk, float32 logits", "glm4_moe": "sigmoid-group-topk, float32 logits",
    "dots1": "sigmoid-group-topk, float32 logits", "solar_open": "sigmoid-group-topk, float32 logits",
    # the correction bias as the forward's argument: MiniMax-M2 (logits in the weight's dtype, no
    # epsilon: NaN weights over zero scores) and Hunyuan-V3 (float32 logits, scaled)
    "minimax_m2": "sigmoid-topk, bias argument", "hy_v3": "sigmoid-topk, bias argument, float32 logits, +1e-20, scaled",
    # DeepSeek-V2's softmax over float32 logits, greedy or group-limited
    "deepseek_v2": "softmax-group-topk, float32 logits", "deepseek_ocr2": "softmax-group-topk, float32 logits",
    # Mistral 4's: the softmax, groups and renormalisation in the logits' dtype
    "mistral4": "softmax-group-topk in the logits' dtype",
}


def _olmoe(layers=2):
    return olmoe(layers=layers, experts=16, top_k=4)


def _runner(model, name):
    """The NativeRouter behind a patched router module."""
    return patched_runner(dict(model.named_modules())[name])


@pytest.mark.parametrize("model_type", [f for f in EXPECTED if f in {x.model_type for x in moe_families()}])
def test_router_forms_across_families(model_type):
    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny model for {model_type}: {UNBUILDABLE[model_type]}")
    tiny = build_tiny(model_type, dtype=torch.bfloat16)
    model = tiny.model
    candidates, unfit = routers.find_routers(model, "")
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        want = EXPECTED[model_type]
        if want is None:
            assert not rep.routers and rep.routers_differ, rep.routers
            assert "routers with their logits on the native kernel" in str(rep) and "left to PyTorch" in str(rep)
            return
        assert rep.routers == [n for n, _ in candidates] and rep.routers and not rep.routers_differ
        gen = torch.Generator().manual_seed(3)
        for name in rep.routers:
            runner = _runner(model, name)
            assert runner.form_name in (want if isinstance(want, tuple) else (want,))
            mod = dict(model.named_modules())[name]
            h = (torch.randn(4, runner.hidden, generator=gen)).bfloat16()
            assert runner.select is not None  # every known form has its native selection
            bias = torch.randn(runner.experts, generator=gen) * 0.3 if runner.bias_arg else None
            arg = () if bias is None else (bias,)
            with torch.inference_mode():
                got = mod(h, *arg)
                own = type(mod).forward(mod, h, *arg)
                # the form in PyTorch on the native logits: the same experts in the same order,
                # the weights within a few float32 ulps (router_select's exp is not PyTorch's)
                by_hand = runner.form(runner._logits, h, bias)
            for g, o, b in zip(got, own, by_hand):
                assert g.dtype == o.dtype and g.shape == o.shape and g.dtype == b.dtype
            assert torch.equal(got[0], by_hand[0]) and torch.equal(got[2], by_hand[2])
            tol = routers._SELECT_RTOL[got[1].dtype] * by_hand[1].float().abs()
            assert ((got[1].float() - by_hand[1].float()).abs() <= tol).all()
            ref = F.linear(h.to(got[0].dtype), mod.weight.to(got[0].dtype), getattr(mod, "bias", None)).float()
            assert ((got[0].float() - ref).abs() <= 2**-7 * ref.abs().amax(-1, keepdim=True)).all()
            assert torch.allclose(got[1].float(), own[1].float(), rtol=2e-2, atol=2e-3)
    finally:
        hi_na_moe.disable_for_model(model)
    assert all("forward" not in dict(model.named_modules())[n].__dict__ for n, _ in candidates)


def test_patched_routers_decode_like_the_model_and_leave_prefill_and_training_alone():
    model = _olmoe()
    ids = torch.tensor([[3, 9, 27, 81, 115, 17, 51, 7]])
    with torch.inference_mode():
        want = model(ids[:, :1]).logits
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.routers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
        gate = model.model.layers[0].mlp.gate
        runner = _runner(model, "model.layers.0.mlp.gate")
        calls = []
        select = runner.select_into  # the native selection, on the native logits
        runner.select_into = lambda logits, *a: calls.append(logits.shape[0]) or select(logits, *a)
        with torch.inference_mode():
            got = model(ids[:, :1]).logits  # the decoder layers' native step selects in layer_decode_post
            assert calls == []
            one = torch.randn(1, 256).bfloat16()
            chosen = gate(one)  # a decode-sized call of the module: the native logits and selection
            assert calls == [1] and chosen[0].dtype is torch.bfloat16 and chosen[1].shape == (1, 4)
            big = torch.randn(routers.ROUTER_MAX_ROWS + 1, 256).bfloat16()
            for g, o in zip(gate(big), type(gate).forward(gate, big)):  # prefill-sized: its own forward
                assert torch.equal(g, o)
            strided = torch.randn(256, 2).bfloat16().t()
            for g, o in zip(gate(strided), type(gate).forward(gate, strided)):
                assert torch.equal(g, o)
        assert calls == [1]
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 2e-2
        gate.train()
        h = torch.randn(1, 256).bfloat16()
        for g, o in zip(gate(h), type(gate).forward(gate, h)):  # training: its own forward
            assert torch.equal(g, o)
        gate.eval()
        assert calls == [1]
    finally:
        hi_na_moe.disable_for_model(model)
    assert "forward" not in model.model.layers[0].mlp.gate.__dict__


def test_a_router_weight_changed_in_place_is_repacked_and_a_changed_setting_goes_back_to_its_forward():
    model = _olmoe(layers=1)
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        gate = model.model.layers[0].mlp.gate
        h = torch.randn(1, 256).bfloat16()
        with torch.inference_mode():
            before = gate(h)
        with torch.no_grad():
            gate.weight.mul_(-1.0)  # in place: the packed copy is stale now
        with torch.inference_mode():
            after = gate(h)
        assert torch.equal(after[0], -before[0])  # negation is exact in the native dot products too
        ref = F.linear(h, gate.weight).float()
        assert ((after[0].float() - ref).abs() <= 2**-7 * ref.abs().amax()).all()
        # load_state_dict copies into the same parameter: repacked again
        gate.load_state_dict({"weight": torch.randn(16, 256).bfloat16()})
        with torch.inference_mode():
            again = gate(h)
        ref = F.linear(h, gate.weight).float()
        assert ((again[0].float() - ref).abs() <= 2**-7 * ref.abs().amax()).all()
        gate.top_k = 2  # the probe matched k = 4: the module's own forward now
        with torch.inference_mode():
            got, own = gate(h), type(gate).forward(gate, h)
        assert got[2].shape == (1, 2) and all(torch.equal(g, o) for g, o in zip(got, own))
    finally:
        hi_na_moe.disable_for_model(model)


def test_a_router_of_no_known_form_is_left_to_pytorch_and_named():
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    class SigmoidRouter(OlmoeTopKRouter):  # sigmoid scores: neither form
        def forward(self, hidden_states):
            logits = F.linear(hidden_states, self.weight)
            top, idx = torch.topk(logits.float().sigmoid(), self.top_k, dim=-1)
            return logits, top.to(logits.dtype), idx

    model = _olmoe()
    old = model.model.layers[1].mlp.gate
    new = SigmoidRouter(model.config).to(torch.bfloat16)
    new.load_state_dict(old.state_dict())
    model.model.layers[1].mlp.gate = new
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.routers == ["model.layers.0.mlp.gate"]
        assert rep.routers_differ == ["model.layers.1.mlp.gate"]
        assert "forward" not in new.__dict__
        assert "1 left to PyTorch (no known router form, e.g. model.layers.1.mlp.gate)" in str(rep)
        assert rep.to_dict()["routers_differ"] == ["model.layers.1.mlp.gate"]
    finally:
        hi_na_moe.disable_for_model(model)


def test_routers_stay_untouched_with_scope_experts_and_when_excluded():
    model = _olmoe()
    rep = hi_na_moe.enable_for_model(model)
    try:
        assert not rep.routers and "forward" not in model.model.layers[0].mlp.gate.__dict__
    finally:
        hi_na_moe.disable_for_model(model)
    rep = hi_na_moe.enable_for_model(model, scope="all", dense_exclude="*.mlp.gate")
    try:
        assert not rep.routers and not rep.routers_differ
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_routing_linears_stay_lossless_when_the_rest_is_quantised(weights):
    # DBRX's router holds an nn.Linear (DbrxRouter.layer): a dense layer for scope="all", but one
    # that decides the routing, so it is never quantised
    cfg = DbrxConfig(d_model=256, n_heads=4, n_layers=1, vocab_size=300, max_seq_len=64,
                     attn_config={"kv_n_heads": 4, "rope_theta": 10000.0},
                     ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 256, "moe_top_k": 2})
    torch.manual_seed(0)
    model = DbrxForCausalLM(cfg).eval().to(torch.bfloat16)
    name = "transformer.blocks.0.ffn.router.layer"
    assert name in linear.routing_linears(model)
    rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, dense_lossless="", cache=False)
    try:
        fmts = {d.name: d.weights for d in rep.dense}
        assert fmts[name] == "lossless"
        assert fmts["transformer.blocks.0.norm_attn_norm.attn.out_proj"] == weights
    finally:
        hi_na_moe.disable_for_model(model)
    plan = hi_na_moe.inspect_model(model, scope="all", weights=weights, dense_lossless="")
    assert {d.name: d.weights for d in plan.dense}[name] == "lossless"


def _select(logits, k, form, renorm, w_dtype, bias=None, norm_min=0.0, groups=1, topk_group=1, scale=1.0, eps=1e-20):
    from hi_na_moe.core.native import native_module

    B, E = logits.shape
    w, idx = torch.empty(B, k, dtype=w_dtype), torch.empty(B, k, dtype=torch.int64)
    native_module()[0].router_select_raw(routers._CODES[logits.dtype], logits.data_ptr(), B, E, k, form, renorm,
                                         routers._CODES[w_dtype], w.data_ptr(), idx.data_ptr(),
                                         0 if bias is None else bias.data_ptr(), norm_min, groups, topk_group, scale,
                                         eps)
    return w, idx


@pytest.mark.parametrize("E,k,groups,topk_group", [(256, 8, 8, 4), (128, 2, 4, 2), (16, 4, 4, 2), (8, 2, 1, 1),
                                                   (8, 3, 4, 3), (64, 6, 8, 8)])
def test_router_select_grouped_sigmoid_form_against_deepseek_v3s_router(E, k, groups, topk_group):
    """router_select's grouped sigmoid form against transformers' DeepseekV3TopkRouter itself (an
    identity weight, so its logits are the rows given): the same experts in the same order (its
    top-ks with sorted=False: nth_element's order, or partial_sort's when 64 k <= E) on rows
    whose scores, biased scores and group scores tie, the weights within a few float32 ulps,
    with and without renormalisation."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(E + k + groups)
    x = torch.randint(-4, 5, (400, E), generator=gen).float() / 4
    x[::4] = torch.randn(100, E, generator=gen) * 3
    for renorm in (True, False):
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                               topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=2.5)
        router = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))
            router.e_score_correction_bias.copy_(torch.randint(-2, 3, (E,), generator=gen).float() / 64)
            logits, want_w, want_idx = router(x)
        assert torch.equal(logits, x)
        w, idx = _select(x, k, 2, renorm, torch.float32, router.e_score_correction_bias, 0.0, groups, topk_group,
                         2.5)
        assert torch.equal(idx, want_idx)
        assert ((w - want_w).abs() <= routers._SELECT_RTOL[torch.float32] * want_w.abs()).all()
    # the rows do test the order of ties: lowest index first among equal scores is not it
    choice = x.sigmoid() + router.e_score_correction_bias
    if groups == 1:
        assert not torch.equal(torch.sort(-choice, dim=-1, stable=True).indices[:, :k], idx)


def test_router_select_sigmoid_form_without_epsilon_against_minimax_m2s_router():
    """One group and no epsilon (MiniMax-M2's router, the bias its forward's argument): the same
    experts in the same order as the module (an identity weight, so its logits are the rows),
    weights within a few float32 ulps, and NaN weights where every chosen score is zero."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    E, k = 16, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 5, (300, E), generator=gen).float() / 4
    x[::3] = torch.randn(100, E, generator=gen) * 3
    x[7] = -200.0  # every score zero: 0 / 0
    router = MiniMaxM2TopKRouter(MiniMaxM2Config(hidden_size=E, num_local_experts=E, num_experts_per_tok=k))
    bias = torch.randint(-2, 3, (E,), generator=gen).float() / 64
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        logits, want_w, want_idx = router(x, bias)
    assert torch.equal(logits, x) and want_w[7].isnan().all()
    w, idx = _select(x, k, 2, True, torch.float32, bias, 0.0, 1, 1, 1.0, 0.0)
    assert torch.equal(idx, want_idx) and torch.equal(w.isnan(), want_w.isnan())
    ok = ~want_w.isnan()
    assert ((w[ok] - want_w[ok]).abs() <= routers._SELECT_RTOL[torch.float32] * want_w[ok].abs()).all()


@pytest.mark.parametrize("method,E,k,groups,topk_group", [("greedy", 64, 6, 1, 1), ("greedy", 160, 2, 1, 1),
                                                           ("group_limited_greedy", 160, 6, 8, 3),
                                                           ("group_limited_greedy", 16, 4, 4, 2)])
def test_router_select_softmax_group_form_against_deepseek_v2s_router(method, E, k, groups, topk_group):
    """router_select's DeepSeek-V2 form against transformers' DeepseekV2TopkRouter (an identity
    weight: its logits are the rows): softmax, greedy or group-limited (the others' probabilities
    0), the top k unsorted as torch.topk leaves them, times the scaling factor; the same experts
    in the same order on tie-heavy rows, weights within a few float32 ulps."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    gen = torch.Generator().manual_seed(E + k)
    x = torch.randint(-4, 5, (400, E), generator=gen).float() / 4
    x[::4] = torch.randn(100, E, generator=gen) * 3
    cfg = DeepseekV2Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                           topk_group=topk_group, topk_method=method, routed_scaling_factor=16.0,
                           num_attention_heads=4, num_key_value_heads=4)
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        logits, want_w, want_idx = router(x)
    assert torch.equal(logits, x)
    w, idx = _select(x, k, 3, False, torch.float32, None, 0.0, groups, topk_group, 16.0, 0.0)
    assert torch.equal(idx, want_idx)
    assert ((w - want_w).abs() <= routers._SELECT_RTOL[torch.float32] * want_w.abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("E,k,groups,topk_group,norm,scale", [(128, 4, 1, 1, True, 1.0), (16, 4, 4, 2, True, 2.5),
                                                               (64, 6, 8, 3, False, 1.0), (8, 2, 1, 1, True, 1.0)])
def test_router_select_in_dtype_form_against_mistral4s_router(dtype, E, k, groups, topk_group, norm, scale):
    """router_select's Mistral 4 form against transformers' Mistral4TopkRouter itself (an identity
    weight: its logits are the rows): softmax in the logits' dtype, groups by the sum of their two
    largest, the top k unsorted, renormalised and scaled in that dtype; the same experts in the
    same order on tie-heavy rows and the same weights bit for bit in bf16 / fp16 (each step rounded
    to the dtype hides the float32 softmax's last bits), within a few ulps in float32."""
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    gen = torch.Generator().manual_seed(E + k + groups)
    x = torch.randint(-4, 5, (400, E), generator=gen).float() / 4
    x[::4] = torch.randn(100, E, generator=gen) * 3
    x = x.to(dtype)
    cfg = Mistral4Config(hidden_size=E, num_local_experts=E, num_experts_per_tok=k, n_group=groups,
                         topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    router = Mistral4TopkRouter(cfg).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        logits, want_w, want_idx = router(x)
    assert torch.equal(logits, x) and want_w.dtype is dtype
    w, idx = _select(x, k, 4, norm, dtype, None, 0.0, groups, topk_group, scale, 1e-20)
    assert torch.equal(idx, want_idx)
    if dtype is torch.float32:
        assert ((w - want_w).abs() <= routers._SELECT_RTOL[torch.float32] * want_w.abs()).all()
    else:
        assert torch.equal(w, want_w)


def test_a_form_router_select_refuses_keeps_pytorchs_selection():
    """DeepSeek-V2's router with expert groups of one (its forward takes them, router_select does
    not): the form is matched for the native logits, the selection stays PyTorch's ops, and the
    router still returns its own forward's experts."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=8, topk_group=4,
                           topk_method="group_limited_greedy", num_attention_heads=4, num_key_value_heads=4)
    router = DeepseekV2TopkRouter(cfg).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
    runner = routers.NativeRouter("gate", router, router.forward)
    assert runner.matches() and runner.form_name == "softmax-group-topk, float32 logits"
    assert runner.select is None
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        got, own = runner.forward(router, h), router(h)
    assert torch.equal(got[2], own[2])


def test_router_select_grouped_form_checks_its_settings():
    """Group settings that would read past a row are refused, naming what is wrong."""
    x, bias = torch.zeros(2, 8), torch.zeros(8)
    for groups, topk_group, k in ((3, 1, 2), (8, 1, 1), (4, 5, 2), (4, 1, 3), (0, 1, 1)):
        with pytest.raises(ValueError, match="form 2 needs groups dividing E"):
            _select(x, k, 2, True, torch.float32, bias, 0.0, groups, topk_group)
    with pytest.raises(ValueError, match="sel_bias"):
        _select(x, 2, 2, True, torch.float32, None, 0.0, 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,k", [(64, 8), (60, 4), (8, 2), (64, 1), (128, 2), (256, 8)])
def test_router_select_moves_ties_as_torch_topk(dtype, E, k):
    """router_select against the forms in PyTorch on tie-heavy logits: the same indices in the
    same order (64 k <= E takes torch.topk's partial-sort path, the others its nth_element one;
    lowest-index-first differs from both on such rows), weights within a few float32 ulps."""
    gen = torch.Generator().manual_seed(E * 10 + k)
    x = torch.randint(-4, 5, (600, E), generator=gen).float() / 4
    x[::3] = torch.randn(200, E, generator=gen) * 0.01
    x[5, 3] = float("nan")  # NaN ranks first in torch.topk, and the softmax row is NaN
    x = x.to(dtype)
    by_index = torch.sort(-x.float(), dim=-1, stable=True).indices[:, :k]
    assert not torch.equal(by_index, torch.topk(x, k, dim=-1).indices)  # the rows do test the tie order
    for renorm in (False, True):
        probs = F.softmax(x, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, k, dim=-1)
        if renorm:
            top = top / top.sum(-1, keepdim=True)
        w, got = _select(x, k, 0, renorm, torch.float32)
        assert torch.equal(got, idx)
        assert torch.equal(w.isnan(), top.isnan())
        ok = ~top.isnan()
        assert ((w[ok] - top[ok]).abs() <= routers._SELECT_RTOL[torch.float32] * top[ok].abs()).all()
    # ERNIE's: chosen by the probabilities plus a correction bias (ties among the sums too), the
    # probabilities as weights over max(sum, norm_min); a norm_min above some rows' sums
    bias = (torch.randint(-2, 3, (E,), generator=gen).float() / 64)
    probs = F.softmax(x, dtype=torch.float, dim=-1)
    _, idx = torch.topk(probs + bias, k, dim=-1)
    top = torch.gather(probs, -1, idx)
    norm_min = 0.5
    top = top / torch.clamp(top.sum(-1, keepdim=True), min=norm_min)
    w, got = _select(x, k, 0, True, torch.float32, bias, norm_min)
    assert torch.equal(got, idx)
    assert torch.equal(w.isnan(), top.isnan())
    ok = ~top.isnan()
    assert ((w[ok] - top[ok]).abs() <= routers._SELECT_RTOL[torch.float32] * top[ok].abs()).all()
    top, idx = torch.topk(x, k, dim=-1)
    want = F.softmax(top, dim=-1)  # in the logits' dtype, as topk-softmax without float32 logits
    w, got = _select(x, k, 1, False, dtype)
    assert torch.equal(got, idx)
    ok = ~want.isnan()
    assert torch.equal(w.isnan(), want.isnan())
    assert ((w[ok].float() - want[ok].float()).abs() <= routers._SELECT_RTOL[dtype] * want[ok].float().abs()).all()


def test_ernies_float32_router_with_its_score_correction_runs_natively():
    """ERNIE 4.5's router (float32 weight on bf16 inputs, softmax, experts chosen with the
    correction bias, weights without it over max(sum, norm_min)): the biased form, the native
    logits and selection; the same experts as its own forward, weights within rounding; a bias
    changed after enable is read at the next call; a module whose bias no form reads is left
    to PyTorch."""
    if "ernie4_5_moe" in UNBUILDABLE:
        pytest.skip(f"no tiny ernie4_5_moe: {UNBUILDABLE['ernie4_5_moe']}")
    model = build_tiny("ernie4_5_moe", dtype=torch.bfloat16).model
    gate = model.model.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
        bias = gate.moe_statics.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)  # large enough to change the choice
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert rep.routers == ["model.layers.1.mlp.gate"] and not rep.routers_select_pytorch
        runner = _runner(model, "model.layers.1.mlp.gate")
        assert runner.form_name == "softmax-biased-topk, float32 router" and runner.biased
        calls = []
        select = runner.select_into
        runner.select_into = lambda *a: calls.append(1) or select(*a)
        h = torch.randn(6, runner.hidden, generator=gen).bfloat16()
        for step in range(2):
            with torch.inference_mode():
                got = gate(h)
                own = type(gate).forward(gate, h)
            assert len(calls) == step + 1
            assert [t.dtype for t in got] == [t.dtype for t in own] == [torch.float32, torch.bfloat16, torch.int64]
            assert torch.equal(got[2], own[2])
            assert ((got[1].float() - own[1].float()).abs() <= 2**-7 * own[1].float().abs()).all()
            assert ((got[0] - own[0]).abs() <= 2**-16 * own[0].abs().amax(-1, keepdim=True)).all()
            unbiased = torch.topk(F.softmax(own[0], dim=-1), own[2].shape[1], dim=-1).indices
            assert not torch.equal(unbiased, own[2])  # the bias did change the choice
            with torch.no_grad():
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
        # a bias replaced by one the form does not read (another dtype): the module's own forward
        gate.moe_statics.e_score_correction_bias = torch.nn.Parameter(bias.detach().double(), requires_grad=False)
        with torch.inference_mode():
            for g, o in zip(gate(h), type(gate).forward(gate, h)):
                assert torch.equal(g, o)
        assert len(calls) == 2
    finally:
        hi_na_moe.disable_for_model(model)


def test_native_select_off_gives_the_pytorch_form_and_a_select_that_differs_is_not_used(monkeypatch):
    model = _olmoe(layers=1)
    ids = torch.tensor([[3, 9, 27]])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        gate = model.model.layers[0].mlp.gate
        runner = _runner(model, "model.layers.0.mlp.gate")
        assert runner.select is not None and not rep.routers_select_pytorch
        assert "routers with their logits on the native kernel for decode-sized inputs: 1 (and their softmax/top-k)" in str(rep)
        h = torch.randn(3, 256).bfloat16()
        with torch.inference_mode():
            on = gate(h)
            monkeypatch.setattr(routers, "NATIVE_SELECT", False)
            off = gate(h)
            by_hand = runner.form(runner._logits, h)
            off_ids = model.generate(ids, max_new_tokens=4, do_sample=False)
            monkeypatch.setattr(routers, "NATIVE_SELECT", True)
            on_ids = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert all(torch.equal(a, b) for a, b in zip(off, by_hand))
        assert torch.equal(on[2], off[2])
        assert torch.equal(on_ids, off_ids)
    finally:
        hi_na_moe.disable_for_model(model)

    # a selection that breaks ties by index: the probe's tie-heavy logits tell, and the form stays PyTorch's
    def by_index(self, logits, *a):
        w, idx = real(self, logits, *a)
        order = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, : idx.shape[1]]
        return w, order

    real = routers.NativeRouter.select_into
    monkeypatch.setattr(routers.NativeRouter, "select_into", by_index)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        runner = _runner(model, "model.layers.0.mlp.gate")
        assert runner.form is not None and runner.select is None
        assert rep.routers_select_pytorch == ["model.layers.0.mlp.gate"]
        assert "softmax/top-k natively in 0; in PyTorch in 1" in str(rep)
        assert rep.to_dict()["routers_select_pytorch"] == ["model.layers.0.mlp.gate"]
        h = torch.randn(2, 256).bfloat16()
        with torch.inference_mode():
            assert all(torch.equal(a, b) for a, b in zip(gate(h), runner.form(runner._logits, h)))
    finally:
        hi_na_moe.disable_for_model(model)
