"""Realistic-size MoE workloads built from transformers' own experts classes with random
weights: for the demo, `bench` and the benchmark scripts. Working sets are several real-size
layers cycled, far larger than the CPU's last-level cache, so timings measure memory, not cache.
"""

from __future__ import annotations

import time

import torch
import transformers

SHAPES = {
    # name: (config class, kwargs) — shapes from the public model configs
    "olmoe": ("OlmoeConfig", dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8)),
    "qwen3": ("Qwen3MoeConfig", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "qwen15": ("Qwen2MoeConfig", dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                                      shared_expert_intermediate_size=5632)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                                                  num_experts_per_tok=6, n_shared_experts=2)),
    "gpt-oss-20b": ("GptOssConfig", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
}
_MODULES = {"OlmoeConfig": "olmoe", "Qwen3MoeConfig": "qwen3_moe", "MixtralConfig": "mixtral",
            "Qwen2MoeConfig": "qwen2_moe", "DeepseekV2Config": "deepseek_v2", "GptOssConfig": "gpt_oss"}


def shape_dims(shape: str) -> tuple[int, int, int, int]:
    """(E, H, I, K) of a named shape."""
    kw = SHAPES[shape][1]
    E = kw.get("num_experts", kw.get("num_local_experts", kw.get("n_routed_experts")))
    I = kw.get("moe_intermediate_size", kw.get("intermediate_size"))
    return E, kw["hidden_size"], I, kw["num_experts_per_tok"]


def _config(shape: str):
    cls_name, kw = SHAPES[shape]
    cfg = getattr(transformers, cls_name)(num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, **kw)
    cfg._experts_implementation_internal = "grouped_mm"  # transformers' default on CPU
    modeling = __import__(f"transformers.models.{_MODULES[cls_name]}.modeling_{_MODULES[cls_name]}", fromlist=["x"])
    return cfg, modeling


# Filling GBs with normal_() takes tens of seconds on one core; tiling a 16 MiB random block
# (shifted per tensor) runs at memcpy speed and still gives every expert distinct weights.
def _fill(module: torch.nn.Module, block: torch.Tensor, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            flat = p.view(-1)
            shift = int(torch.randint(0, block.numel(), (1,), generator=g))
            src = torch.cat([block[shift:], block[:shift]])
            for start in range(0, flat.numel(), src.numel()):
                n = min(src.numel(), flat.numel() - start)
                flat[start:start + n] = src[:n]


def build_layers(shape: str, n_layers: int, dtype: torch.dtype, progress=None):
    """`n_layers` separate experts modules of the named model shape (random weights, std 0.02),
    in a ModuleList, with the config they share."""
    cfg, modeling = _config(shape)
    experts_cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Experts"))
    layers = torch.nn.ModuleList()
    g = torch.Generator().manual_seed(0)
    block = (torch.randn(1 << 23, generator=g) * 0.02).to(dtype)
    for _ in range(n_layers):
        with torch.device("meta"):
            ex = experts_cls(cfg)
        ex = ex.to_empty(device="cpu").to(dtype)
        _fill(ex, block, g)
        layers.append(ex.eval())
        if progress is not None:
            progress()
    return cfg, layers


def build_shared(shape: str, n_layers: int, dtype: torch.dtype):
    """The shape's shared-expert MLPs (transformers' own class, random weights), one per layer,
    or None when the shape has no shared expert. Run by PyTorch in every arm: hi_na_moe
    accelerates the routed experts."""
    kw = SHAPES[shape][1]
    if "shared_expert_intermediate_size" in kw:
        inter = kw["shared_expert_intermediate_size"]
    elif kw.get("n_shared_experts"):
        inter = kw["moe_intermediate_size"] * kw["n_shared_experts"]
    else:
        return None
    cfg, modeling = _config(shape)
    mlp_cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("MLP"))
    g = torch.Generator().manual_seed(1)
    block = (torch.randn(1 << 23, generator=g) * 0.02).to(dtype)
    mlps = torch.nn.ModuleList()
    for _ in range(n_layers):
        with torch.device("meta"):
            m = mlp_cls(cfg, intermediate_size=inter)
        m = m.to_empty(device="cpu").to(dtype)
        _fill(m, block, g)
        mlps.append(m.eval())
    return mlps


def set_impl(layers, name: str) -> None:
    for ex in layers:
        ex.config._experts_implementation_internal = name


def active_bytes(layer, idx: torch.Tensor) -> int:
    """Bytes of expert weights one call must read: every distinct expert hit, once."""
    per_expert = sum(p[0].numel() * p.element_size() for p in layer.parameters() if p.dim() == 3)
    return int(torch.unique(idx).numel()) * per_expert


def make_inputs(cfg, T: int, dtype, seed: int):
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    K = cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype)
    return x, idx, w


def time_arm(layers, cfg, T, dtype, iters, warmup, seed0, after=None):
    """Seconds per call and bytes of experts read per call, each call on the next layer copy
    with fresh tokens and routing. `after()`, if given, runs (untimed) right after every timed
    call: a benchmark pairs each call with a probe of the machine taken under the same
    conditions."""
    samples, nbytes = [], []
    with torch.inference_mode():
        for i in range(warmup + iters):
            layer = layers[i % len(layers)]
            x, idx, w = make_inputs(cfg, T, dtype, seed0 + i)
            t0 = time.perf_counter()
            layer(x, idx, w)
            dt = time.perf_counter() - t0
            if i >= warmup:
                samples.append(dt)
                nbytes.append(active_bytes(layer, idx))
                if after is not None:
                    after()
    return samples, nbytes
