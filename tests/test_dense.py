"""scope="all" (hi_na_moe.fastpath.linear): the model's dense linear layers on the native kernels.
Against native transformers on tiny models: outputs, state_dict while enabled, exact restore,
tied weights, exclusions, the lossless list, training, and the config keys."""

from __future__ import annotations

import pytest
import torch
from tiny_models import olmoe
from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

import hi_na_moe
from hi_na_moe.fastpath import common, linear
from hi_na_moe.core.config import ConfigError
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.store import PackedStore

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="scope='all' runs on the native kernels")

IDS = torch.tensor([[3, 9, 27, 81, 115, 17, 51, 7]])


def _olmoe(tied=False, dtype=torch.bfloat16):
    return olmoe(tied=tied, dtype=dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _flip_a_payload_byte(path):
    """Corrupt a store entry near its end (payload): its checksum no longer matches."""
    with open(path, "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def _logits(model, ids=IDS):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lossless_all_matches_native_and_restores_exactly(dtype):
    model = _olmoe(dtype=dtype)
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    want, want1 = _logits(model), _logits(model, IDS[:, :1])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        names = {d.name for d in rep.dense}
        # every attention projection and the lm_head; no expert and nothing tiny
        assert "lm_head" in names and "model.layers.0.self_attn.q_proj" in names
        assert not any(".experts" in n for n in names)
        assert all(d.weights == "lossless" and d.released_bytes > 0 for d in rep.dense)
        assert "dense linear layers on native kernels" in str(rep)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert _rel(_logits(model), want) < tol  # prefill path (T = 8)
        assert _rel(_logits(model, IDS[:, :1]), want1) < tol  # decode path (T = 1)
        q = model.model.layers[0].self_attn.q_proj
        assert q.weight.untyped_storage().nbytes() <= q.weight.element_size()  # released
        sd = model.state_dict()  # while enabled: the real weights
        assert all(torch.equal(sd[k], v) for k, v in sd0.items())
    finally:
        hi_na_moe.disable_for_model(model)
    assert all(torch.equal(v, sd0[k]) for k, v in model.state_dict().items())
    assert "forward" not in model.lm_head.__dict__
    assert torch.equal(_logits(model), want)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_all_keeps_lm_head_lossless_and_stays_close(weights):
    model = _olmoe()
    want = _logits(model)
    rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache=False)
    try:
        fmt = {d.name: d.weights for d in rep.dense}
        assert fmt.pop("lm_head") == "lossless" and set(fmt.values()) == {weights}
        # cache=False: no store to back the originals up in, so quantised layers keep theirs;
        # the lossless lm_head is released
        assert all((d.released_bytes == 0) == (d.weights != "lossless") for d in rep.dense)
        assert all(d.cache is None for d in rep.dense)
        err = _rel(_logits(model), want)
        assert err < (0.05 if weights == "int8" else 0.35), err
    finally:
        hi_na_moe.disable_for_model(model)
    assert torch.equal(_logits(model), want)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_layers_live_in_the_store_and_restore_exactly(weights, tmp_path):
    sd0 = {k: v.clone() for k, v in _olmoe().state_dict().items()}
    want = _logits(_olmoe())
    got = []
    for _ in range(2):  # the second model (same weights) maps what the first one wrote
        model = _olmoe()
        rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache_dir=str(tmp_path))
        try:
            quant = [d for d in rep.dense if d.weights == weights]
            assert quant and all(d.released_bytes > 0 for d in quant)  # backed up, then released
            q = model.model.layers[0].self_attn.q_proj
            assert q.weight.untyped_storage().nbytes() <= q.weight.element_size()
            got.append((sorted({d.cache for d in quant}), _logits(model)))
            sd = model.state_dict()  # while enabled: the exact originals, from the backup
            assert all(torch.equal(sd[k], v) for k, v in sd0.items())
            assert "in the packed-expert store" in str(rep)
        finally:
            hi_na_moe.disable_for_model(model)
        assert all(torch.equal(v, sd0[k]) for k, v in model.state_dict().items())
        assert torch.equal(_logits(model), want)
    assert got[0][0] == ["built"] and got[1][0] == ["reused"]
    assert torch.equal(got[0][1], got[1][1])  # the mapped entries compute the same
    entries = {e.name for e in PackedStore(tmp_path).entries()}
    qkv = "model.layers.0.self_attn.q_proj+k_proj+v_proj"  # one entry per fused group
    assert {qkv, qkv + ".original", "model.layers.0.self_attn.o_proj"} <= entries
    assert "lm_head" not in entries  # lossless layers are packed in memory


def _packed_linears(model, weights: str) -> list:
    """The model's dense runners (one per layer or fused group) packed in `weights`."""
    from hi_na_moe.fastpath.linear import patched_member

    runners = {id(r): r for m in model.modules() if (r := (patched_member(m) or (None,))[0]) is not None
               and getattr(r, "packed", None) is not None and r.weights == weights}
    return list(runners.values())


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_layers_pack_paired_with_the_same_outputs_bit_for_bit(weights, tmp_path, monkeypatch):
    """linear.PAIRED: an int8 / int4 layer (or group) with an even number of outputs packs as one
    gated expert's two matrices (PackedExperts.paired), in a store entry of its own; the logits
    are those of the one-matrix packing, bit for bit, and disable restores the weights."""
    sd0 = {k: v.clone() for k, v in _olmoe().state_dict().items()}
    got = {}
    for pair in (True, False):
        monkeypatch.setattr(linear, "PAIRED", pair)
        model = _olmoe()
        rep = hi_na_moe.enable_for_model(model, scope="all", weights=weights, cache_dir=str(tmp_path))
        try:
            runners = _packed_linears(model, weights)
            assert runners and all(r.packed.paired == (pair and r.out_features % 2 == 0) for r in runners)
            assert any(r.packed.paired for r in runners) == pair
            assert {d.cache for d in rep.dense if d.weights == weights} == {"built"}  # (paired: other entries)
            got[pair] = _logits(model)
        finally:
            hi_na_moe.disable_for_model(model)
        assert all(torch.equal(v, sd0[k]) for k, v in model.state_dict().items())
    assert torch.equal(got[True], got[False])


def test_a_store_with_one_matrix_entries_keeps_using_them_under_pairing(tmp_path, monkeypatch):
    """An int4 layer whose one-matrix entry a store already holds (built with linear.PAIRED off, as
    before pairing) uses that entry rather than building a paired one beside it; without one, or
    with linear.REUSE_UNPAIRED off, the paired entry is built."""
    def paired_layers(model):
        return {r.packed.paired for r in _packed_linears(model, "int4")}

    for reuse, want in ((True, {False}), (False, {True})):
        store = tmp_path / str(reuse)
        monkeypatch.setattr(linear, "PAIRED", False)
        model = _olmoe()
        hi_na_moe.enable_for_model(model, scope="all", weights="int4", cache_dir=str(store))
        hi_na_moe.disable_for_model(model)
        monkeypatch.setattr(linear, "PAIRED", True)
        monkeypatch.setattr(linear, "REUSE_UNPAIRED", reuse)
        model = _olmoe()
        rep = hi_na_moe.enable_for_model(model, scope="all", weights="int4", cache_dir=str(store))
        try:
            assert paired_layers(model) == want
            assert {d.cache for d in rep.dense if d.weights == "int4"} == ({"reused"} if reuse else {"built"})
        finally:
            hi_na_moe.disable_for_model(model)
    monkeypatch.setattr(linear, "REUSE_UNPAIRED", True)
    model = _olmoe()  # a fresh store: paired
    hi_na_moe.enable_for_model(model, scope="all", weights="int4", cache_dir=str(tmp_path / "fresh"))
    try:
        assert paired_layers(model) == {True}
    finally:
        hi_na_moe.disable_for_model(model)


def test_unreadable_backup_of_a_dense_layer_is_a_clear_error_and_the_layer_keeps_running(tmp_path):
    model = _olmoe()
    want = _logits(model)
    hi_na_moe.enable_for_model(model, scope="all", weights="int8", cache_dir=str(tmp_path))
    store = PackedStore(tmp_path)
    for e in store.entries():
        if e.name.endswith(".original"):
            _flip_a_payload_byte(store.path_for(e.key, e.name))
    with pytest.raises(RuntimeError, match="exact backup in the packed-expert store is unreadable"):
        hi_na_moe.disable_for_model(model)
    assert hi_na_moe.is_enabled(model)
    assert _rel(_logits(model), want) < 0.05  # still enabled, the broken layers on their int8 copy
    store.clear()  # the backups gone for good: still a clear error, still working
    with pytest.raises(RuntimeError, match="could not restore .* dense linear layer"):
        hi_na_moe.disable_for_model(model)
    assert _rel(_logits(model), want) < 0.05


def test_exclusions_and_lossless_patterns():
    model = _olmoe()
    rep = hi_na_moe.enable_for_model(model, scope="all", weights="int8", cache=False,
                                     dense_exclude="*.k_proj,*.v_proj", dense_lossless="lm_head,*.o_proj")
    try:
        fmt = {d.name: d.weights for d in rep.dense}
        assert not any(n.endswith((".k_proj", ".v_proj")) for n in fmt)
        assert "forward" not in model.model.layers[0].self_attn.k_proj.__dict__
        assert fmt["model.layers.1.self_attn.o_proj"] == "lossless" and fmt["model.layers.1.self_attn.q_proj"] == "int8"
    finally:
        hi_na_moe.disable_for_model(model)


def test_tied_lm_head_is_run_but_never_released():
    model = _olmoe(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = model.model.embed_tokens.weight.clone()
    want = _logits(model)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        head = next(d for d in rep.dense if d.name == "lm_head")
        assert head.released_bytes == 0
        assert torch.equal(model.model.embed_tokens.weight, emb)  # the embedding still works
        assert _rel(_logits(model), want) < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _qwen2moe(hidden=256, kv_heads=4):
    cfg = Qwen2MoeConfig(hidden_size=hidden, intermediate_size=512, moe_intermediate_size=64,
                         shared_expert_intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=300, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg).eval().to(torch.bfloat16)


def test_shared_experts_run_on_the_kernels():
    model = _qwen2moe()
    want = _logits(model)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        names = {d.name for d in rep.dense}
        assert "model.layers.0.mlp.shared_expert.down_proj" in names
        # 256 weights, below MIN_WEIGHTS, but a shared expert's gate: the layer's fused step computes it
        assert "model.layers.0.mlp.shared_expert_gate" in names
        assert _rel(_logits(model), want) < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


def test_training_through_a_released_layer_is_a_clear_error():
    model = _olmoe().train()
    hi_na_moe.enable_for_model(model, scope="all", keep_weights=False)
    try:
        with pytest.raises(RuntimeError, match="scope='experts'"):
            model(IDS, labels=IDS).loss.backward()
    finally:
        hi_na_moe.disable_for_model(model)


def test_inspect_model_plans_the_dense_layers_without_packing():
    model = _olmoe()
    rep = hi_na_moe.inspect_model(model, scope="all", weights="int4")
    assert rep.dry_run and "forward" not in model.lm_head.__dict__
    fmt = {d.name: d.weights for d in rep.dense}
    assert fmt["lm_head"] == "lossless" and fmt["model.layers.0.self_attn.q_proj"] == "int4"
    enabled = hi_na_moe.enable_for_model(model, scope="all", weights="int4", cache=False)
    try:  # the plan is what enable then does, bytes and kernels included
        assert [(d.name, d.weights, d.kernel, d.packed_bytes, d.group) for d in rep.dense] == \
               [(d.name, d.weights, d.kernel, d.packed_bytes, d.group) for d in enabled.dense]
        assert rep.dense[0].group == "model.layers.0.self_attn.q_proj+k_proj+v_proj"
        # the small modules it names are the candidates enable probed (all of them match here)
        assert (rep.norms, rep.routers, rep.attention, rep.layers, rep.stacks) == (
            enabled.norms, enabled.routers, enabled.attention, enabled.layers, enabled.stacks)
        assert len(rep.norms) == 9 and len(rep.routers) == 2 and len(rep.attention) == 2 and len(rep.layers) == 2
        assert rep.stacks == ["model"]
    finally:
        hi_na_moe.disable_for_model(model)
    assert "would run on native kernels" in str(rep)
    assert ("would probe at enable and run natively where their form matches: 9 RMSNorm, 2 router(s), 2 attention "
            "module(s), 2 decoder layer(s), 1 decoder stack(s)") in str(rep)
    with torch.device("meta"):  # planned from shapes alone
        meta = OlmoeForCausalLM(model.config)
    planned = hi_na_moe.inspect_model(meta, scope="all")
    assert len(planned.dense) == len(rep.dense)
    assert (planned.norms, planned.routers, planned.attention, planned.layers, planned.stacks) == (
        rep.norms, rep.routers, rep.attention, rep.layers, rep.stacks)


def test_scope_all_with_the_reference_backend_is_a_config_error():
    """scope="all" runs the dense layers natively, backend="reference" turns the native kernels
    off: the pair used to enable nothing but the experts' reference path, silently."""
    model = _olmoe()
    with pytest.raises(ConfigError, match=r"config keys 'scope' \(keyword argument\) = 'all' and 'backend' \(keyword argument\) = "
                                          r"'reference' do not go together.*backend='auto'"):
        hi_na_moe.enable_for_model(model, scope="all", backend="reference")
    assert not hi_na_moe.is_enabled(model)


def test_scope_experts_is_the_default_and_touches_no_linear():
    model = _olmoe()
    rep = hi_na_moe.enable_for_model(model)
    try:
        assert rep.dense == [] and "forward" not in model.lm_head.__dict__
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("kw, match", [
    (dict(scope="everything"), r"config key 'scope' .* expected one of 'experts', 'all'"),
    (dict(scope="al"), "did you mean 'all'"),
    (dict(dense_exclude=3), "config key 'dense_exclude'.*comma-separated list of module-name patterns"),
])
def test_config_errors_name_the_key(kw, match):
    with pytest.raises(ConfigError, match=match):
        hi_na_moe.load_config(**kw)


# -- RMSNorm (scope="all") ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_native_rms_norm_matches_transformers(dtype):
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from hi_na_moe.core.native import native_module

    native = native_module()[0]
    gen = torch.Generator().manual_seed(3)
    for n in (2048, 128, 77, 1):
        norm = OlmoeRMSNorm(n, eps=1e-6).to(dtype)
        norm.weight.data = torch.randn(n, generator=gen).to(dtype)
        x = (torch.randn(6, n, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)).to(dtype)
        out = torch.empty_like(x)
        native.rms_norm(x, norm.weight.data, 1e-6, out)
        want = norm(x)
        if dtype == torch.bfloat16:  # the last bit can differ (sum order); in bf16 none did here
            assert torch.equal(out, want)
        else:
            rtol = {torch.float16: 2.0**-10, torch.float32: 2.0**-20}[dtype]
            assert ((out.float() - want.float()).abs() <= rtol * want.float().abs()).all()


def test_native_rms_norm_refuses_bad_arguments():
    from hi_na_moe.core.native import native_module

    native = native_module()[0]
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="weight has shape"):
        native.rms_norm(x, torch.randn(7), 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match="out has dtype"):
        native.rms_norm(x, w, 1e-6, torch.empty_like(x, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="overlap"):
        native.rms_norm(x, w, 1e-6, x)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.rms_norm(torch.randn(8, 2).t(), w, 1e-6, torch.empty(2, 8))


def test_rms_norms_run_natively_for_decode_and_are_restored():
    model = _olmoe()
    for n, p in model.named_parameters():
        if "norm" in n:
            p.data.normal_(1.0, 0.2)  # not all ones: a swapped weight would show
    want, want1 = _logits(model), _logits(model, IDS[:, :1])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        # 2 layers x (input, post-attention, q, k) + the final norm
        assert len(rep.norms) == 9 and not rep.norms_differ
        assert "RMSNorm modules on the native kernel" in str(rep)
        norm = model.model.layers[0].input_layernorm
        assert "forward" in norm.__dict__
        x = torch.randn(1, 1, 256).bfloat16()
        with torch.inference_mode():  # bf16: the same bits as the module's own forward here
            assert torch.equal(norm(x), type(norm).forward(norm, x))
            big = torch.randn(1, common.DECODE_MAX_ROWS + 1, 256).bfloat16()  # more rows: its own forward
            assert torch.equal(norm(big), type(norm).forward(norm, big))
        assert _rel(_logits(model), want) < 2e-2
        assert _rel(_logits(model, IDS[:, :1]), want1) < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)
    assert "forward" not in model.model.layers[0].input_layernorm.__dict__
    assert torch.equal(_logits(model), want)


def test_an_rms_norm_that_computes_something_else_is_left_alone():
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    class OnePlusRMSNorm(OlmoeRMSNorm):  # Gemma-style: scales by (1 + weight)
        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return ((1.0 + self.weight.float()) * h).to(x.dtype)

    model = _olmoe()
    for layer in model.model.layers:
        old = layer.input_layernorm
        layer.input_layernorm = OnePlusRMSNorm(old.weight.numel(), eps=old.variance_epsilon).bfloat16()
    want = _logits(model, IDS[:, :1])
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert sorted(rep.norms_differ) == ["model.layers.0.input_layernorm", "model.layers.1.input_layernorm"]
        assert "forward" not in model.model.layers[0].input_layernorm.__dict__
        assert "left to PyTorch" in str(rep)
        assert _rel(_logits(model, IDS[:, :1]), want) < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)


# -- sibling projections in one call (dense_fuse) ----------------------------------------------
def test_fused_siblings_give_the_same_bits_as_one_call_per_layer():
    want = {}
    for fuse in (False, True):
        model = _olmoe()
        rep = hi_na_moe.enable_for_model(model, scope="all", dense_fuse=fuse)
        try:
            groups = {d.group for d in rep.dense}
            if fuse:
                assert groups == {None, "model.layers.0.self_attn.q_proj+k_proj+v_proj",
                                  "model.layers.1.self_attn.q_proj+k_proj+v_proj"}
                q = next(d for d in rep.dense if d.name == "model.layers.0.self_attn.q_proj")
                assert q.group and q.released_bytes == 256 * 256 * 2
            else:
                assert groups == {None}
            with torch.inference_mode():
                got = (_logits(model), _logits(model, IDS[:, :1]))
            sd = model.state_dict()
        finally:
            hi_na_moe.disable_for_model(model)
        want[fuse] = (got, sd)
    (p0, d0), sd0 = want[False]
    (p1, d1), sd1 = want[True]
    assert torch.equal(p0, p1) and torch.equal(d0, d1)  # prefill and decode: the same bits
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)  # state_dict while enabled: exact


def test_fused_members_fed_different_or_modified_inputs_stay_correct():
    model = _olmoe()
    attn = model.model.layers[0].self_attn
    x1, x2 = torch.randn(1, 3, 256).bfloat16(), torch.randn(1, 3, 256).bfloat16()
    ref = _olmoe()
    hi_na_moe.enable_for_model(ref, scope="all", dense_fuse=False)  # one call per layer
    hi_na_moe.enable_for_model(model, scope="all")
    try:
        r = ref.model.layers[0].self_attn
        with torch.inference_mode():
            # each member with another input: every call computes the group for its own input
            assert torch.equal(attn.q_proj(x1), r.q_proj(x1))
            assert torch.equal(attn.k_proj(x2), r.k_proj(x2))
            assert torch.equal(attn.v_proj(x1), r.v_proj(x1))
            # the same input, modified in place between two members: recomputed, not reused
            x = x1.clone()
            assert torch.equal(attn.q_proj(x), r.q_proj(x))
            x.mul_(2)
            assert torch.equal(attn.k_proj(x), r.k_proj(x))
            # a member asked twice for one input: the second call computes again (never hands
            # out one tensor twice, which an in-place op on the first could have changed)
            a = attn.v_proj(x)
            a.zero_()
            assert torch.equal(attn.v_proj(x), r.v_proj(x))
    finally:
        hi_na_moe.disable_for_model(model)
        hi_na_moe.disable_for_model(ref)


def test_a_fused_group_whose_backup_is_unreadable_stays_patched_as_a_whole(tmp_path):
    model = _olmoe()
    want = _logits(model, IDS[:, :1])
    hi_na_moe.enable_for_model(model, scope="all", weights="int8", cache_dir=str(tmp_path))
    store = PackedStore(tmp_path)
    for e in store.entries():
        if e.name == "model.layers.0.self_attn.q_proj+k_proj+v_proj.original":
            _flip_a_payload_byte(store.path_for(e.key, e.name))
    with pytest.raises(RuntimeError, match="q_proj\\+k_proj\\+v_proj"):
        hi_na_moe.disable_for_model(model)
    attn = model.model.layers[0].self_attn
    # q, k and v all still run on the packed group (their weights are released placeholders)
    assert all("forward" in getattr(attn, n).__dict__ for n in ("q_proj", "k_proj", "v_proj"))
    assert "forward" not in model.model.layers[1].self_attn.k_proj.__dict__  # the rest is restored
    assert _rel(_logits(model, IDS[:, :1]), want) < 0.05


def test_static_and_dynamic_kv_caches_decode_alike_under_scope_all():
    # benchmarks/bench_long_context.py recommends StaticCache for long contexts: the same tokens
    from transformers import DynamicCache, StaticCache

    model = _olmoe()
    hi_na_moe.enable_for_model(model, scope="all", weights="int4", cache=False)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        runs = {}
        with torch.inference_mode():
            for kind in ("dynamic", "static"):
                cache = (DynamicCache(config=model.config) if kind == "dynamic"
                         else StaticCache(config=model.config, max_cache_len=60))
                out = model(ids, past_key_values=cache, use_cache=True)
                logits = [out.logits[:, -1]]
                for _ in range(8):
                    out = model(logits[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
                    logits.append(out.logits[:, -1])
                runs[kind] = torch.stack(logits).float()
        assert torch.equal(runs["dynamic"].argmax(-1), runs["static"].argmax(-1))
        assert _rel(runs["static"], runs["dynamic"]) < 1e-2
    finally:
        hi_na_moe.disable_for_model(model)


def test_training_through_fused_groups_with_kept_weights_gives_native_gradients():
    native, model = _olmoe().train(), _olmoe().train()
    labels = IDS
    native(IDS, labels=labels).loss.backward()
    hi_na_moe.enable_for_model(model, scope="all", keep_weights=True)
    try:
        model(IDS, labels=labels).loss.backward()
        for name in ("q_proj", "k_proj", "v_proj"):
            g = getattr(model.model.layers[0].self_attn, name).weight.grad
            want = getattr(native.model.layers[0].self_attn, name).weight.grad
            assert g is not None and _rel(g, want) < 5e-2, name
    finally:
        hi_na_moe.disable_for_model(model)


def test_siblings_that_differ_in_bias_are_not_fused():
    # hidden 512, 2 of 4 heads for k/v: k_proj is 256 x 512, above the 64 Ki-weight minimum
    model = _qwen2moe(hidden=512, kv_heads=2)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None  # qkv biases
    want = _logits(model)
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        group = {d.name: d.group for d in rep.dense}
        # q/k/v with biases and GQA (k/v narrower than q): one group; the shared expert's gate/up too
        assert group["model.layers.0.self_attn.k_proj"] == "model.layers.0.self_attn.q_proj+k_proj+v_proj"
        assert group["model.layers.0.mlp.shared_expert.up_proj"] == "model.layers.0.mlp.shared_expert.gate_proj+up_proj"
        assert _rel(_logits(model), want) < 2e-2
    finally:
        hi_na_moe.disable_for_model(model)
    attn.k_proj.bias = None  # now k differs from q and v in bias presence: not fused
    rep = hi_na_moe.enable_for_model(model, scope="all")
    try:
        assert {d.group for d in rep.dense if d.name.endswith(("q_proj", "k_proj", "v_proj"))} == {None}
    finally:
        hi_na_moe.disable_for_model(model)


@pytest.mark.parametrize("scope, layer", [("experts", "model.layers.0.mlp.experts"),
                                          ("all", "model.layers.0.self_attn.q_proj")])
def test_load_state_dict_into_released_weights_says_what_to_do(scope, layer):
    model = _olmoe()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    hi_na_moe.enable_for_model(model, scope=scope)
    try:
        with pytest.raises(RuntimeError, match=rf"cannot load '{layer}\.[a-z_]+' into '{layer}'.*disable_for_model"):
            model.load_state_dict(sd)
        # keys of modules that kept their weights still load (the layer norms here)
        norm = {k: v for k, v in sd.items() if "input_layernorm" in k}
        assert model.load_state_dict(norm, strict=False).unexpected_keys == []
    finally:
        hi_na_moe.disable_for_model(model)
    model.load_state_dict(sd)  # disabled: the usual load
    with torch.inference_mode():
        assert torch.isfinite(model(IDS).logits).all()

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type, linear, reader", [
    ("longcat_flash", "model.layers.0.mlp.router.classifier", "model.layers.0.mlp.router"),
    ("jamba", "model.layers.1.mamba.dt_proj", "model.layers.1.mamba"),
])
def test_a_linear_whose_weight_its_parent_reads_itself_keeps_it(monkeypatch, dtype, model_type, linear, reader):
    """LongCat-Flash's router computes F.linear(h.float(), self.classifier.weight.float()) and
    Jamba's Mamba mixer self.dt_proj.weight @ x, neither calling the Linear: a released weight
    (the zero placeholder) made LongCat's routing uniform and Jamba's time steps zero. Such a
    linear is packed and runs natively when called, but keeps its weight, and the report says why;
    the model then computes what it computes with keep_weights=True."""
    import copy

    from tiny_models import UNBUILDABLE, build_tiny

    from hi_na_moe.fastpath import linear as linear_mod

    if model_type in UNBUILDABLE:
        pytest.skip(f"no tiny {model_type}: {UNBUILDABLE[model_type]}")
    monkeypatch.setattr(linear_mod, "MIN_WEIGHTS", 0)
    tiny = build_tiny(model_type, dtype)
    model = tiny.model
    twin = copy.deepcopy(model)
    lin = model.get_submodule(linear)
    w = lin.weight.detach().clone()
    ids = torch.randint(0, tiny.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        rep = hi_na_moe.enable_for_model(model, scope="all")
        hi_na_moe.enable_for_model(twin, scope="all", keep_weights=True)
        try:
            entry = {d.name: d for d in rep.dense}[linear]
            assert entry.released_bytes == 0 and f"weight kept: {reader} reads it itself" in entry.note
            assert torch.equal(lin.weight, w)
            got, kept = model(ids).logits, twin(ids).logits
            assert torch.equal(got, kept)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
        finally:
            hi_na_moe.disable_for_model(model)
            hi_na_moe.disable_for_model(twin)
