"""The public API around enable/disable: reports, errors, the transformers-native switch, and
custom models found through router_name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, OlmoeConfig, OlmoeForCausalLM

import hi_na_moe
from hi_na_moe.core import reference
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.core.spec import ExpertsSpec, GateSpec
from tiny_models import layout, layout_diff


def _olmoe(tmp_path=None, seed=0):
    cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, num_experts=8, num_experts_per_tok=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


IDS = torch.tensor([[3, 9, 27, 81, 115, 17, 51]])


def test_report_str_and_json():
    model = _olmoe()
    report = hi_na_moe.enable_for_model(model)
    try:
        text = str(report)
        assert "model.layers.0.mlp.experts" in text
        d = report.to_dict()
        on_kernels = 2 if native_kernels_available() else 0
        assert d["summary"] == {"moe_blocks": 2, "accelerated": on_kernels, "reference": 2 - on_kernels, "native": 0}
        if on_kernels:
            assert "moe_decode_f32_" in text and d["blocks"][0]["status"] == "accelerated"
        assert d["blocks"][0]["experts"] == 8 and d["blocks"][0]["gate"] == "silu"
        assert '"model_class": "OlmoeForCausalLM"' in report.to_json()
    finally:
        hi_na_moe.disable_for_model(model)


def test_inspect_changes_nothing():
    model = _olmoe()
    before = repr(model)
    report = hi_na_moe.inspect_model(model)
    assert report.dry_run and len(report.blocks) == 2
    assert repr(model) == before and not hi_na_moe.is_enabled(model)


def test_enable_twice_and_disable_unknown_are_clear_errors():
    model = _olmoe()
    hi_na_moe.enable_for_model(model)
    with pytest.raises(RuntimeError, match="already enabled"):
        hi_na_moe.enable_for_model(model)
    with pytest.raises(RuntimeError, match="already accelerated through another enable_for_model"):
        hi_na_moe.enable_for_model(model.model.layers[0])
    hi_na_moe.disable_for_model(model)
    with pytest.raises(RuntimeError, match="not enabled"):
        hi_na_moe.disable_for_model(model)


def test_enable_on_submodule_only():
    model = _olmoe()
    with torch.no_grad():
        want = model(IDS).logits
        report = hi_na_moe.enable_for_model(model.model.layers[1])
        assert [b.name for b in report.blocks] == ["mlp.experts"]
        got = model(IDS).logits
        hi_na_moe.disable_for_model(model.model.layers[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_not_a_module():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got str"):
        hi_na_moe.enable_for_model("model")


def test_native_backend_refused_when_no_kernel_fits():
    model = _olmoe().double()  # no float64 kernels
    with pytest.raises(ValueError, match="backend='native' but this block cannot run natively: .*float64"):
        hi_na_moe.enable_for_model(model, backend="native")
    assert not hi_na_moe.is_enabled(model)


def test_strict_refuses_native_blocks():
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import build_tiny

    tiny = build_tiny("jetmoe")  # its attention experts (MoA) stay native
    with pytest.raises(RuntimeError, match="strict=True.*JetMoe|strict=True.*attention experts"):
        hi_na_moe.enable_for_model(tiny.model, strict=True)
    assert not hi_na_moe.is_enabled(tiny.model)


def test_experts_implementation_through_from_pretrained(tmp_path):
    model = _olmoe()
    model.save_pretrained(tmp_path)
    native = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="hi_na_moe").eval()
    assert ours.config._experts_implementation == "hi_na_moe"
    with torch.no_grad():
        a, b = native(IDS).logits, ours(IDS).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_set_experts_implementation_round_trip():
    model = _olmoe()
    with torch.no_grad():
        a = model(IDS).logits
        model.set_experts_implementation("hi_na_moe")
        b = model(IDS).logits
        model.set_experts_implementation("eager")
        c = model(IDS).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


def test_training_mode_keeps_autograd_working():
    model = _olmoe().train()
    hi_na_moe.enable_for_model(model, keep_weights=True)
    try:
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    finally:
        hi_na_moe.disable_for_model(model)


def test_inference_calls_take_the_one_frame_path(monkeypatch):
    """After a block's first call, inference forwards with plain inputs run NativeExperts.fast
    (one frame to the kernel) and give the same bits as the full path; what fast() does not
    take (here a float32 hidden for bf16 experts: a conversion) still goes through __call__."""
    if not native_kernels_available():
        pytest.skip("the one-frame path is the native runner's")
    from hi_na_moe.core import ops

    model = _olmoe().to(torch.bfloat16)
    hi_na_moe.enable_for_model(model, backend="native")
    try:
        with torch.inference_mode():
            first = model(IDS).logits  # the full path (makes each block's BoundForward)
            full_calls = []
            real_call = ops.NativeExperts.__call__
            monkeypatch.setattr(ops.NativeExperts, "__call__",
                                lambda self, *a: full_calls.append(1) or real_call(self, *a))
            again = model(IDS).logits
            assert not full_calls, "an inference forward went through NativeExperts.__call__"
            assert torch.equal(first, again)
            experts = model.model.layers[0].mlp.experts
            h = torch.randn(3, 64)
            idx, w = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
            got = experts(h, idx, w)
            assert full_calls and torch.equal(got, experts(h.bfloat16(), idx, w))
    finally:
        hi_na_moe.disable_for_model(model)


def test_training_with_released_weights_is_a_clear_error():
    if not native_kernels_available():
        pytest.skip("weights are only released for native kernels")
    model = _olmoe().train()
    hi_na_moe.enable_for_model(model)
    try:
        with pytest.raises(RuntimeError, match="keep_weights=True"):
            model(IDS, labels=IDS).loss.backward()
    finally:
        hi_na_moe.disable_for_model(model)


def test_weights_released_while_enabled_and_restored_exactly(tmp_path):
    if not native_kernels_available():
        pytest.skip("weights are only released for native kernels")
    model = _olmoe()
    experts = model.model.layers[0].mlp.experts
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(IDS).logits
    report = hi_na_moe.enable_for_model(model)
    assert report.blocks[0].released_bytes == report.blocks[0].expert_bytes
    # the model's own copy is gone: a zero-byte placeholder of the same shape and dtype
    assert experts.gate_up_proj.shape == before["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert experts.gate_up_proj.untyped_storage().nbytes() <= 4
    # ...but state_dict (hence save_pretrained) still sees the real weights
    sd = model.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v), k
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        got = model(IDS).logits
    hi_na_moe.disable_for_model(model)
    assert experts.gate_up_proj.untyped_storage().nbytes() == experts.gate_up_proj.numel() * 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_restore_gives_each_parameter_its_layout_back():
    """A checkpoint loaded from safetensors leaves parameters at the file's offsets: data pointers
    not 64-byte aligned (PyTorch's kernels, MKL's GEMMs among them, may round otherwise on
    memory aligned otherwise), views into a shared storage, strides of a transposed layout.
    disable_for_model gives each released parameter its layout back, not only its values."""
    if not native_kernels_available():
        pytest.skip("weights are only released for native kernels")
    model = _olmoe()
    for layer in model.model.layers:
        ex = layer.mlp.experts
        gu, down = ex.gate_up_proj.detach().clone(), ex.down_proj.detach().clone()
        n_gu, n_down = gu.numel(), down.numel()
        buf = bytearray((n_gu + n_down) * 4 + 64)
        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        # one storage, exactly the two tensors' bytes, its data pointer 24 bytes past a 64-byte line
        storage = torch.frombuffer(buf, dtype=torch.uint8, count=(n_gu + n_down) * 4,
                                   offset=(24 - base) % 64).untyped_storage()
        E, H, I = down.shape
        gu_t = torch.empty(0).set_(storage, 0, gu.shape, gu.stride())
        down_t = torch.empty(0).set_(storage, n_gu, down.shape, (H * I, 1, H))  # [E, H, I] stored as [E, I, H]
        gu_t.copy_(gu)
        down_t.copy_(down)
        ex.gate_up_proj.data, ex.down_proj.data = gu_t, down_t
    before = layout(model)
    assert before["model.layers.0.mlp.experts.gate_up_proj"]["align64"] == 24
    assert not before["model.layers.0.mlp.experts.down_proj"]["contiguous"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(IDS).logits
    report = hi_na_moe.enable_for_model(model)
    assert all(b.released_bytes == b.expert_bytes for b in report.blocks)
    hi_na_moe.disable_for_model(model)
    diff = layout_diff(before, layout(model))
    assert not diff, diff
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_experts_tied_between_blocks_are_exact_and_kept():
    """Two MoE blocks holding the same parameters (DiffusionGemma ties its encoder's experts to its
    decoder's): both run exactly, on copies packed from the real weights, which stay in place
    (releasing them for one block would leave the other reading them), and stay tied."""
    model = _olmoe()
    first, second = (layer.mlp.experts for layer in model.model.layers)
    second.gate_up_proj, second.down_proj = first.gate_up_proj, first.down_proj
    before = layout(model)
    with torch.no_grad():
        want = model(IDS).logits
    report = hi_na_moe.enable_for_model(model)
    try:
        with torch.no_grad():
            got = model(IDS).logits
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-5, f"tied experts: rel L2 {rel:.2e}"
        assert len(report.accelerated) == (2 if native_kernels_available() else 0)
        if native_kernels_available():
            assert all(b.released_bytes == 0 and "(tied weights)" in b.reason for b in report.blocks), str(report)
            assert "shared with 'model.layers.1.mlp.experts.gate_up_proj'" in report.blocks[0].reason
            assert not any(hi_na_moe.core.ops.is_released(p) for p in model.parameters())
    finally:
        hi_na_moe.disable_for_model(model)
    assert second.gate_up_proj is first.gate_up_proj and second.down_proj is first.down_proj
    diff = layout_diff(before, layout(model))
    assert not diff, diff
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_reading_a_released_weight_is_an_error():
    """While enabled a released parameter has no values: anything that would read them raises an
    error naming it (never the placeholder's contents); what says nothing of its values works."""
    if not native_kernels_available():
        pytest.skip("weights are only released for native kernels")
    import copy

    from hi_na_moe.core import ops

    model = _olmoe()
    experts = model.model.layers[0].mlp.experts
    shape, dtype = experts.gate_up_proj.shape, experts.gate_up_proj.dtype
    hi_na_moe.enable_for_model(model)
    try:
        w = experts.gate_up_proj
        x = torch.randn(3, shape[-1])
        reads = [
            lambda: torch.nn.functional.linear(x, w[0]), lambda: w.sum(), lambda: w.clone(), lambda: w.tolist(),
            lambda: w.detach().numpy(), lambda: torch.equal(w, w), lambda: w.view(-1)[:4].sum(),
            lambda: torch.bmm(w, torch.randn(shape[0], shape[-1], 2)), lambda: w[torch.tensor([0, 1])] @ x.t(),
            lambda: w.to(torch.bfloat16), lambda: copy.deepcopy(experts), lambda: torch.save(w, __import__("io").BytesIO()),
        ]
        for read in reads:
            with pytest.raises(RuntimeError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is released"):
                read()
        # the block's own code, in each of transformers' experts implementations, reading its weights
        idx, tw = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
        for impl in ("eager", "grouped_mm", "batched_mm"):
            experts.config._experts_implementation = impl
            with pytest.raises(RuntimeError, match="released while hi_na_moe runs its block"):
                type(experts).forward(experts, x, idx, tw)
        assert ops.is_released(w) and w.shape == shape and w.dtype == dtype and w.device.type == "cpu"
        assert w.numel() == shape.numel() and w.requires_grad and w.untyped_storage().nbytes() == 0
        assert "released by hi_na_moe" in repr(w)
        model.to("cpu")  # no change: no read
        assert model.dtype == torch.float32 and model.num_parameters() > 0
    finally:
        hi_na_moe.disable_for_model(model)
    assert not ops.is_released(experts.gate_up_proj) and type(experts.gate_up_proj) is nn.Parameter


# --- a custom model the discovery cannot read by itself -------------------------------------

class MyExperts(nn.Module):
    def __init__(self, E=4, H=16, I=8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, x, idx, w):  # not the contract's argument names: discovery skips it
        spec = ExpertsSpec(num_experts=4, hidden=16, intermediate=8, gate_up=self.gate_up_proj,
                           down=self.down_proj, gate_spec=GateSpec("silu"))
        return reference.experts_forward(spec, x, idx, w)


class MyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = MyExperts()

    def forward(self, x):
        w, idx = torch.topk(self.router(x).softmax(-1), 2)
        return self.experts(x, idx, w)


def test_router_name_for_custom_model():
    torch.manual_seed(0)
    model = nn.Sequential(MyBlock()).eval()
    x = torch.randn(5, 16)
    assert hi_na_moe.inspect_model(model).blocks == []
    want = model(x)
    report = hi_na_moe.enable_for_model(model, router_name="0.router")
    assert [b.name for b in report.blocks] == ["0.experts"]
    got = model(x)
    hi_na_moe.disable_for_model(model)
    torch.testing.assert_close(got, want)


def test_router_name_errors():
    model = nn.Sequential(MyBlock())
    with pytest.raises(ValueError, match=r"router_name='0.rooter': no such submodule"):
        hi_na_moe.enable_for_model(model, router_name="0.rooter")
    plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no experts module next to the router"):
        hi_na_moe.enable_for_model(plain, router_name="0")
