"""Write a full-size, random-weight MoE checkpoint that transformers loads like a real one.

End-to-end comparisons (transformers, hi_na_moe, llama.cpp) need the real model's shapes and
the real on-disk format, not its trained values, and there is no model hub here. This script
writes exactly what `save_pretrained` would write for the model type (same parameter names,
the per-expert `experts.{e}.{gate,up,down}_proj.weight` keys that transformers 5.23 saves and
fuses again on load, safetensors shards + `model.safetensors.index.json`, `config.json`,
`generation_config.json`), but streams it tensor by tensor in fixed-size chunks, so the writer
needs a few hundred MB of RAM whatever the model's size.

Weights: normal(0, --std) for every matrix and bias, 1 for every norm; with std 0.02 and
RMSNorm in front of every block the activations stay O(1) through all layers in bf16. Each
tensor is drawn from its own generator seeded by (--seed, tensor name), so the values do not
depend on the sharding or on the order of writing.

Before writing, the key set and shapes this script would write are checked against what
`save_pretrained` writes for a tiny config of the same model type, so a change in
transformers' on-disk format fails loudly instead of producing a checkpoint with silently
re-initialised weights.

    python benchmarks/make_checkpoint.py --shape olmoe-1b-7b --out /work/ckpt/olmoe-1b-7b
    python benchmarks/make_checkpoint.py --shape qwen3-30b-a3b --layers 2 --out /tmp/q2 --verify
    python benchmarks/make_checkpoint.py --shape qwen1.5-moe-a2.7b --layers 4 --out /work/ckpt/qwen1.5-moe-a2.7b-4l

Shapes: olmoe-1b-7b (OLMoE-1B-7B), qwen3-30b-a3b (Qwen3-30B-A3B), qwen1.5-moe-a2.7b
(Qwen1.5-MoE-A2.7B: routed experts plus a shared expert and q/k/v biases), gpt-oss-20b
(GPT-OSS-20B in bf16: sinks, sliding windows, biases, experts saved fused), ernie-4.5-21b-a3b
(ERNIE-4.5-21B-A3B: a dense first layer, shared experts, a float32 router, interleaved rotary),
glm-4.5-air (GLM-4.5-Air: a dense first layer, a shared expert, DeepSeek-V3's sigmoid router with a
correction bias, partial rotary), deepseek-v2-lite (DeepSeek-V2-Lite: a dense first layer, shared
experts, DeepSeek-V2's softmax router, multi-head latent attention), deepseek-v2-lite-qlora (the
same with DeepSeek-V2's q LoRA, for llama.cpp, which takes fewer layers of the Lite form only so).

`--verify` loads the result with `AutoModelForCausalLM.from_pretrained` (the whole model in
RAM: use it on small `--layers`), fails on missing/unexpected/mismatched keys, checks a few
tensors against regenerated values and runs a short forward pass with finite logits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# The real models' hyper-parameters (from their published config.json files). OlmoeConfig's
# own defaults differ from OLMoE-1B-7B in intermediate_size (2048 vs 1024), Qwen3MoeConfig's
# in layers, head_dim and rope, and Qwen2MoeConfig's from Qwen1.5-MoE-A2.7B in context length
# and rope, so every value that matters is spelled out here.
SHAPES: dict[str, dict] = {
    "olmoe-1b-7b": dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        norm_topk_prob=False,
        clip_qkv=None,
        tie_word_embeddings=False,
        pad_token_id=1,
        eos_token_id=50279,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen1.5-MoE-A2.7B: 60 routed experts (top-4, not renormalised) plus a shared expert of
    # width 5632 behind a sigmoid gate in every layer, and biases on q/k/v (qkv_bias, True by
    # default in Qwen2MoeConfig; spelled out). intermediate_size is unused while every layer is
    # sparse (mlp_only_layers empty, decoder_sparse_step 1). The published config has no sliding
    # window in use (use_sliding_window false; max_window_layers then does nothing).
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
        use_sliding_window=False,
        max_window_layers=21,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    # GPT-OSS-20B (its published config.json): 32 experts of width 2880 (top-4) with biases and
    # the clamped SwiGLU, attention with biases and sinks (one learned logit per head), sliding
    # windows of 128 on every other layer, YaRN rope. transformers saves its experts fused
    # (gate_up_proj [E, H, 2I], down_proj [E, I, H], and their biases), written so here. The
    # published weights are MXFP4; these are bf16, as transformers dequantises them on CPU.
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        attention_bias=True,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        pad_token_id=199999,
        eos_token_id=200002,
    ),
    # ERNIE-4.5-21B-A3B (its published config.json): a dense first layer, then 64 experts of width
    # 1536 (top-6) and two shared experts per layer, a float32 router with a correction bias
    # (transformers keeps both float32 on load), rotary pairs interleaved in float32, tied embeddings
    "ernie-4.5-21b-a3b": dict(
        model_type="ernie4_5_moe",
        vocab_size=103424,
        hidden_size=2560,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=28,
        num_attention_heads=20,
        num_key_value_heads=4,
        moe_num_experts=64,
        moe_k=6,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=27,
        moe_layer_interval=1,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        use_bias=False,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GLM-4.5-Air (its published config.json): a dense first layer, then 128 experts of width 1408
    # (top-8) and a shared expert per layer, DeepSeek-V3's router (sigmoid scores, a score
    # correction bias kept float32, one expert group), partial rotary (half of each head), q/k/v
    # biases, untied embeddings
    "glm-4.5-air": dict(
        model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        attention_bias=True,
        use_qk_norm=False,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 1000000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
        tie_word_embeddings=False,
        pad_token_id=151329,
        eos_token_id=151329,
    ),
    # DeepSeek-V2-Lite (its published config.json): a dense first layer, then 64 experts of width
    # 1408 (top-6, greedy softmax router, unscaled) and two shared experts per layer, multi-head
    # latent attention (kv_lora_rank 512, no q LoRA), YaRN rotary
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
        tie_word_embeddings=False,
        bos_token_id=100000,
        eos_token_id=100001,
    ),
}
# DeepSeek-V2-Lite with DeepSeek-V2's q LoRA (q_a_proj to rank 1536, q_a_layernorm, q_b_proj)
# instead of its q_proj: the llama.cpp that llama-cpp-python 0.3.36 vendors reads a deepseek2
# GGUF without q LoRA only at 26 or 27 layers (its test for the Lite models), so a slice of
# fewer layers is compared with llama.cpp in this form
SHAPES["deepseek-v2-lite-qlora"] = dict(SHAPES["deepseek-v2-lite"], q_lora_rank=1536)

ARCHITECTURES = {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
# families whose fused experts transformers saves fused (not one nn.Linear layout per expert)
SAVED_FUSED = {"gpt_oss"}
# parameter names transformers saves under another key (its checkpoint conversion, reversed)
SAVED_RENAMES = {"ernie4_5_moe": ((".mlp.gate.moe_statics.", ".mlp.moe_statics."),)}

DTYPES = {
    "bf16": (torch.bfloat16, "BF16"),
    "fp16": (torch.float16, "F16"),
    "fp32": (torch.float32, "F32"),
}

# Elements drawn per generator call. Fixed (not derived from RAM or shard size) because the
# stream of a seeded generator depends on how it is cut into calls.
CHUNK_ELEMS = 8 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_bias(self) -> bool:
        return self.name.endswith(".bias")

    @property
    def is_norm(self) -> bool:
        # a norm's scale (1-D, "...norm.weight"); biases and GPT-OSS's sinks are drawn like the rest
        return len(self.shape) == 1 and self.name.endswith("norm.weight")


def build_config(shape: str, layers: int | None, dtype: str):
    from transformers import AutoConfig

    params = dict(SHAPES[shape])
    model_type = params.pop("model_type")
    if layers is not None:
        params["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **params)
    config.dtype = DTYPES[dtype][0]
    return config


def checkpoint_tensors(config) -> list[TensorSpec]:
    """Names and shapes `save_pretrained` writes for this config, in a layer-major order.

    The module tree is built on the meta device (no memory). transformers 5.23 holds each MoE
    block's experts fused (gate_up_proj: [E, 2I, H], down_proj: [E, H, I]) but saves them
    per expert in the classic nn.Linear layout, which is what is written here.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs: list[TensorSpec] = []
    fused = config.model_type in SAVED_FUSED
    renames = SAVED_RENAMES.get(config.model_type, ())
    saved = set(model.state_dict())  # persistent buffers are saved too (DeepSeek-V3's correction bias)
    buffers = [(n, b) for n, b in model.named_buffers() if n in saved]
    for name, param in [*model.named_parameters(), *buffers]:
        shape = tuple(param.shape)
        for old, new in renames:
            name = name.replace(old, new)
        if fused:
            specs.append(TensorSpec(name, shape))
        elif name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            n_exp, two_i, hidden = shape
            for e in range(n_exp):
                specs.append(TensorSpec(f"{prefix}{e}.gate_proj.weight", (two_i // 2, hidden)))
                specs.append(TensorSpec(f"{prefix}{e}.up_proj.weight", (two_i // 2, hidden)))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            n_exp, hidden, inter = shape
            for e in range(n_exp):
                specs.append(TensorSpec(f"{prefix}{e}.down_proj.weight", (hidden, inter)))
        elif name.endswith("experts.gate_proj") or name.endswith("experts.up_proj"):
            raise RuntimeError(f"unexpected fused expert layout {name} {shape}: update this script")
        else:
            specs.append(TensorSpec(name, shape))
    return specs


def check_against_save_pretrained(model_type: str) -> None:
    """Compare our key set and shapes with what save_pretrained writes for a tiny config."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    shape_name = next(k for k, v in SHAPES.items() if v["model_type"] == model_type)
    params = dict(SHAPES[shape_name])
    params.pop("model_type")
    # Small but all-distinct sizes, so a swapped dimension cannot go unnoticed.
    params.update(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_experts=4, num_experts_per_tok=2, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )
    if model_type == "olmoe":
        params.update(intermediate_size=48, num_key_value_heads=4)
    elif model_type == "gpt_oss":
        params.pop("num_experts")  # an alias of num_local_experts here
        params.update(intermediate_size=48, num_key_value_heads=2, head_dim=16, sliding_window=8,
                      num_local_experts=4)
    elif model_type == "qwen2_moe":
        # head_dim is hidden / heads (16) here: Qwen2MoeConfig has no head_dim field
        params.update(intermediate_size=80, moe_intermediate_size=48, shared_expert_intermediate_size=112,
                      num_key_value_heads=2)
    else:
        params.update(intermediate_size=80, moe_intermediate_size=48, num_key_value_heads=2, head_dim=16)
        if model_type in ("glm4_moe", "deepseek_v2"):
            params.update(n_routed_experts=4)
        if model_type == "deepseek_v2":
            params.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    config = AutoConfig.for_model(model_type, **params)
    ours = {s.name: s.shape for s in checkpoint_tensors(config)}
    model = AutoModelForCausalLM.from_config(config)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tiny save's own bar would only confuse
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf_logging.enable_progress_bar()
        theirs = {}
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    theirs[key] = tuple(st.get_slice(key).get_shape())
    if ours != theirs:
        only_ours = sorted(set(ours) - set(theirs))[:5]
        only_theirs = sorted(set(theirs) - set(ours))[:5]
        wrong_shape = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])[:5]
        raise RuntimeError(
            f"on-disk format differs from save_pretrained for {model_type}: only ours {only_ours}, "
            f"only save_pretrained {only_theirs}, different shapes {wrong_shape}"
        )


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generate_chunks(spec: TensorSpec, seed: int, std: float, dtype: torch.dtype):
    """Yield the tensor's values as contiguous 1-D chunks of `dtype`, in storage order."""
    if spec.is_norm:
        yield torch.ones(spec.numel, dtype=dtype)
        return
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    buf = torch.empty(min(CHUNK_ELEMS, spec.numel), dtype=torch.float32)
    left = spec.numel
    while left:
        n = min(CHUNK_ELEMS, left)
        chunk = buf[:n]
        chunk.normal_(0.0, std, generator=gen)
        yield chunk.to(dtype)
        left -= n


def regenerate(spec: TensorSpec, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    # clone: an fp32 chunk aliases the generator's reused buffer
    return torch.cat([c.clone() for c in generate_chunks(spec, seed, std, dtype)]).view(spec.shape)


def plan_shards(specs: list[TensorSpec], elem_size: int, max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * elem_size
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def safetensors_header(specs: list[TensorSpec], st_dtype: str, elem_size: int) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.numel * elem_size
        header[spec.name] = {"dtype": st_dtype, "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_shard(path: Path, specs, dtype: torch.dtype, st_dtype: str, seed: int, std: float, bar) -> None:
    elem_size = torch.empty(0, dtype=dtype).element_size()
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(safetensors_header(specs, st_dtype, elem_size))
        for spec in specs:
            for chunk in generate_chunks(spec, seed, std, dtype):
                f.write(chunk.view(torch.uint8).numpy().data)
                bar.update(chunk.numel() * elem_size)
    tmp.rename(path)


def verify(out: Path, specs: list[TensorSpec], seed: int, std: float, dtype: torch.dtype) -> None:
    """Load as a user would; fail on any key problem, wrong value or non-finite logits."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise RuntimeError(f"from_pretrained reported {problems}")
    state = model.state_dict()
    by_name = {s.name: s for s in specs}
    # A plain tensor, a norm, and the first/last expert of layer 0 (checks the fusing order).
    # the first layer with experts (ERNIE's first is dense)
    moe = next(i for i in range(model.config.num_hidden_layers) if f"model.layers.{i}.mlp.experts.down_proj" in state)
    exp0 = f"model.layers.{moe}.mlp.experts.0."
    checks = {
        "model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    if "lm_head.weight" in by_name:  # (not written when tied to the embedding)
        checks["lm_head.weight"] = state["lm_head.weight"]
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.shared_expert.down_proj.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight"):
        if name in state:  # qwen2_moe only
            checks[name] = state[name]
    fused = f"model.layers.{moe}.mlp.experts."
    if model.config.model_type in SAVED_FUSED:  # written as loaded: check the fused tensors as they are
        for name in (fused + "gate_up_proj", fused + "down_proj", fused + "gate_up_proj_bias",
                     "model.layers.0.self_attn.sinks"):
            checks[name] = state[name]
    elif fused + "gate_up_proj" in state:
        gate_up, down = state[fused + "gate_up_proj"], state[fused + "down_proj"]
        last = f"{fused}{gate_up.shape[0] - 1}."
        inter = gate_up.shape[1] // 2
        for prefix, e in ((exp0, 0), (last, gate_up.shape[0] - 1)):
            checks[prefix + "gate_proj.weight"] = gate_up[e, :inter]
            checks[prefix + "up_proj.weight"] = gate_up[e, inter:]
            checks[prefix + "down_proj.weight"] = down[e]
    for name, loaded in checks.items():
        expected = regenerate(by_name[name], seed, std, dtype)
        if not torch.equal(loaded, expected):
            raise RuntimeError(f"{name}: loaded values differ from the written ones")
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits")
    print(
        f"verify: from_pretrained OK (no missing/unexpected/mismatched keys), {len(checks)} tensors "
        f"equal to the written values, logits finite (std {logits.float().std():.3f})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the normal weights")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="max shard size, GB (1e9 bytes)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in --out")
    ap.add_argument("--verify", action="store_true", help="load with from_pretrained afterwards (needs the model in RAM)")
    args = ap.parse_args(argv)

    from tqdm import tqdm
    from transformers import GenerationConfig

    torch_dtype, st_dtype = DTYPES[args.dtype]
    config = build_config(args.shape, args.layers, args.dtype)
    check_against_save_pretrained(config.model_type)
    specs = checkpoint_tensors(config)
    elem_size = torch.empty(0, dtype=torch_dtype).element_size()
    total = sum(s.numel for s in specs) * elem_size

    out: Path = args.out
    existing = list(out.glob("*.safetensors*")) if out.exists() else []
    if existing and not args.overwrite:
        print(f"{out} already holds a checkpoint; pass --overwrite to replace it", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for f in existing + [out / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    free = shutil.disk_usage(out).free
    if free < total + (1 << 30):
        print(f"not enough disk in {out}: need {total / 1e9:.1f} GB + 1 GB, have {free / 1e9:.1f} GB", file=sys.stderr)
        return 2

    shards = plan_shards(specs, elem_size, int(args.shard_gb * 1e9))
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    print(
        f"{args.shape}: {config.num_hidden_layers} layers, {sum(s.numel for s in specs) / 1e9:.2f} B params, "
        f"{total / 1e9:.2f} GB {args.dtype} in {n} shard(s) -> {out}"
    )
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", mininterval=0.5 if sys.stderr.isatty() else 15) as bar:
        for fname, shard in zip(names, shards):
            write_shard(out / fname, shard, torch_dtype, st_dtype, args.seed, args.std, bar)

    if n > 1:
        index = {
            "metadata": {"total_parameters": sum(s.numel for s in specs), "total_size": total},
            "weight_map": {s.name: fname for fname, shard in zip(names, shards) for s in shard},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.architectures = [ARCHITECTURES[config.model_type]]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    (out / "RANDOM_WEIGHTS.txt").write_text(
        "Random weights for benchmarking only, written by hi_na_moe's benchmarks/make_checkpoint.py\n"
        f"shape={args.shape} layers={config.num_hidden_layers} dtype={args.dtype} seed={args.seed} std={args.std}\n"
    )
    print(f"wrote {out}")

    if args.verify:
        verify(out, specs, args.seed, args.std, torch_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
