"""Write a llama.cpp GGUF file from a transformers MoE checkpoint directory, streaming.

So that llama.cpp and transformers/hi_na_moe are timed on the same weights: the GGUF holds
exactly the checkpoint's tensors (bit-identical in bf16, quantised from them in q8_0/q4_0).
Runs in the llama.cpp venv (benchmarks/requirements-llamacpp.txt): needs only numpy and the
PyPI `gguf` package; no torch, no transformers.

    python benchmarks/make_gguf.py /work/ckpt/olmoe-1b-7b --type q4_0 --out /work/ckpt/gguf/olmoe-1b-7b-q4_0.gguf

What is written:
- Architecture "olmoe" for OlmoeForCausalLM checkpoints, "qwen3moe" for Qwen3MoeForCausalLM,
  "qwen2moe" for Qwen2MoeForCausalLM (Qwen1.5-MoE), "deepseek2" for DeepseekV2ForCausalLM
  (kv_b_proj split into attn_k_b, each head's key rows transposed, and attn_v_b, as llama.cpp's
  MLA path loads them; its MQA-over-the-latent lengths, YaRN, shared experts); tensor names from gguf's TensorNameMap,
  hyper-parameters under the keys GGUFWriter's helpers define (block_count, context/embedding/
  feed_forward length, head counts, rope base, rms eps, expert count/used, key/value length;
  expert_feed_forward_length for qwen3moe/qwen2moe, expert_shared_feed_forward_length for
  qwen2moe).
- Per-expert tensors stacked into one [E, rows, cols] tensor per projection (ffn_gate_exps,
  ffn_up_exps, ffn_down_exps), as llama.cpp's loader wants. qwen2moe's shared expert is an
  ordinary MLP: mlp.shared_expert.{gate,up,down}_proj -> ffn_{gate,up,down}_shexp, and its
  sigmoid gate mlp.shared_expert_gate ([1, hidden]) -> ffn_gate_inp_shexp; q/k/v biases ->
  attn_{q,k,v}.bias.
- Types: 1-D tensors (norms, biases), the router (ffn_gate_inp) and the shared expert's gate
  (ffn_gate_inp_shexp) stay F32, as llama.cpp's own converter keeps them; every other matrix,
  the shared expert's, token_embd and output included, is --type. So q4_0 is the "pure"
  recipe (llama-quantize --pure): real Q4_0 files usually keep `output` at Q6_K, which gguf's
  Python quantiser cannot produce.
- Quantisation by gguf.quants (bit-exact with ggml's reference Q8_0/Q4_0 quantisers).
- A synthetic SentencePiece-style vocabulary of the checkpoint's vocab_size (<unk>, <s>, </s>,
  256 byte tokens, filler pieces): enough for llama.cpp to load and run from token ids; it
  tokenises nothing like the real model.

Memory: each source tensor is memory-mapped on its own and converted in pieces (one expert,
or a block of rows, at a time); the largest buffer is one stacked expert tensor in the output
type (about 0.27 GB for OLMoE in bf16). `--check` reads the file back with gguf's reader and
reports, per type, the error of a few dequantised tensors against the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from synthetic_tokenizer import synthetic_tokens  # this script's folder is on sys.path

ARCHS = {
    "OlmoeForCausalLM": gguf.MODEL_ARCH.OLMOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "DeepseekV2ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2,
}
KV_B_RE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.kv_b_proj\.weight$")
# Matrices llama.cpp's converter never quantises: the router and qwen2moe's shared-expert gate
# (one output row; a product with it decides a whole branch's weight).
KEEP_F32 = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)
TYPES = {
    "bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}  # bf16 read as raw bits

EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
ROWS_PER_PIECE = 4096  # rows converted at once for 2-D tensors (32 MB of fp32 at 2048 columns)


@dataclass(frozen=True)
class Source:
    """One tensor of the checkpoint: where its bytes are, never the bytes themselves."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes

    def map(self) -> np.ndarray:
        return np.memmap(self.file, dtype=ST_DTYPES[self.dtype], mode="r", offset=self.offset, shape=self.shape)


def read_checkpoint(ckpt: Path) -> dict[str, Source]:
    """Parse the safetensors headers (8-byte length + JSON) of every shard of `ckpt`."""
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    sources: dict[str, Source] = {}
    for fname in files:
        path = ckpt / fname
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in ST_DTYPES:
                raise ValueError(f"{name}: unsupported dtype {info['dtype']}")
            sources[name] = Source(path, info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
    return sources


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.asarray(a, dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


@dataclass
class Planned:
    name: str  # GGUF name
    sources: list[Source]  # one, or one per expert (stacked on a new first axis)
    shape: tuple[int, ...]  # numpy order (GGUF stores it reversed)
    qtype: QT
    # the whole (small) source array -> the tensor to write, in the source's element type (raw
    # bf16 bits move as they are): deepseek2's kv_b_proj split into k_b and v_b
    view: object = None

    @property
    def nbytes(self) -> int:
        if self.qtype == QT.F32:
            return int(np.prod(self.shape)) * 4
        if self.qtype == QT.BF16:
            return int(np.prod(self.shape)) * 2
        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


def split_kv_b(src: Source, heads: int, nope: int, v_dim: int) -> list[tuple[str, tuple[int, ...], object]]:
    """deepseek2's kv_b_proj [heads (nope + v_dim), L] as llama.cpp's MLA path reads it (its own
    converter's split): k_b [heads, L, nope] (each head's key rows, transposed) and v_b [heads,
    v_dim, L]."""
    rows, L = src.shape
    if rows != heads * (nope + v_dim):
        raise ValueError(f"kv_b_proj {src.shape}: expected {heads} x ({nope} + {v_dim}) rows")

    def k_b(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(heads, nope + v_dim, L)[:, :nope].transpose(0, 2, 1))

    def v_b(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(heads, nope + v_dim, L)[:, nope:])

    return [("k_b_proj", (heads, L, nope), k_b), ("v_b_proj", (heads, v_dim, L), v_b)]


def plan_tensors(sources: dict[str, Source], arch, n_layers: int, qtype: QT, cfg: dict | None = None) -> list[Planned]:
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    experts: dict[tuple[str, str], dict[int, Source]] = {}
    plain: list[tuple[str, Source]] = []
    views: list[tuple[str, Source, tuple[int, ...], object]] = []
    for name, src in sources.items():
        m = EXPERT_RE.match(name)
        kv = KV_B_RE.match(name) if arch == gguf.MODEL_ARCH.DEEPSEEK2 else None
        if m:
            experts.setdefault((m.group(1), m.group(4)), {})[int(m.group(3))] = src
        elif kv:
            for part, shape, fn in split_kv_b(src, cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                                              cfg["v_head_dim"]):
                views.append((f"{kv.group(1)}.{part}.weight", src, shape, fn))
        else:
            plain.append((name, src))
    merged = []
    for (prefix, proj), by_e in experts.items():
        if sorted(by_e) != list(range(len(by_e))):
            raise ValueError(f"{prefix}.*.{proj}: experts {sorted(by_e)} are not 0..E-1")
        shapes = {s.shape for s in by_e.values()}
        if len(shapes) != 1:
            raise ValueError(f"{prefix}.*.{proj}: experts of different shapes {shapes}")
        merged.append((f"{prefix}.{proj}.weight", [by_e[e] for e in range(len(by_e))]))
    plan = []
    for hf_name, srcs in [(n, [s]) for n, s in plain] + merged:
        found = tmap.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise ValueError(f"no GGUF name for {hf_name} in arch {arch.name}")
        kind, name = found
        shape = srcs[0].shape if len(srcs) == 1 else (len(srcs), *srcs[0].shape)
        if len(shape) == 1 or name.endswith("_norm.weight") or kind in KEEP_F32:
            t = QT.F32
        else:
            t = qtype
        plan.append(Planned(name, srcs, shape, t))
    for hf_name, src, shape, fn in views:
        found = tmap.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise ValueError(f"no GGUF name for {hf_name} in arch {arch.name}")
        plan.append(Planned(found[1], [src], shape, qtype, fn))

    def order(p: Planned):
        m = re.match(r"blk\.(\d+)\.", p.name)
        if m:
            return (1, int(m.group(1)), p.name)
        return (0 if p.name.startswith("token_embd") else 2, 0, p.name)

    return sorted(plan, key=order)


def convert_piece(raw: np.ndarray, dtype: str, qtype: QT) -> np.ndarray:
    if qtype == QT.BF16 and dtype == "BF16":
        return np.asarray(raw)  # the same bits: lossless
    x = to_f32(raw, dtype)
    if qtype == QT.F32:
        return x
    return gguf.quants.quantize(x, qtype)


def convert(p: Planned, bar) -> np.ndarray:
    """The whole tensor in its GGUF type, built piece by piece from memory-mapped sources."""
    out_dtype = {QT.F32: np.float32, QT.BF16: np.uint16}.get(p.qtype, np.uint8)
    out_shape = p.shape if out_dtype is not np.uint8 else gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
    out = np.empty(out_shape, dtype=out_dtype)
    for e, src in enumerate(p.sources):
        arr = src.map()
        if p.view is not None:
            arr = p.view(np.asarray(arr))
        dst = out[e] if len(p.sources) > 1 else out
        if arr.ndim == 1:
            dst[...] = convert_piece(arr, src.dtype, p.qtype)
        else:
            for r in range(0, arr.shape[0], ROWS_PER_PIECE):
                dst[r : r + ROWS_PER_PIECE] = convert_piece(arr[r : r + ROWS_PER_PIECE], src.dtype, p.qtype)
        bar.update(arr.nbytes)
        del arr  # unmaps this source tensor
    return out


def synthetic_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-shaped: llama.cpp's SPM loader wants <unk>/<s>/</s> and the byte tokens."""
    tokens = synthetic_tokens(n)  # synthetic_tokenizer.py writes the same list as a transformers tokenizer
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, [int(t) for t in types]


def add_deepseek2(w: gguf.GGUFWriter, cfg: dict) -> None:
    """deepseek2's own keys: its MLA read as MQA over the latent (one kv head of kv_lora_rank +
    rope dims, values of kv_lora_rank) and decompressed per head (the *_mla lengths), the dense
    leading layers, the shared experts, the routed weights' scale, the rotary dims and YaRN."""
    L, rope_dims = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(L)
    w.add_key_length(L + rope_dims)
    w.add_value_length(L)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dims)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dims)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("mscale_all_dim") is not None:  # (llama.cpp's converter writes 0.1 x mscale_all_dim)
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def add_metadata(w: gguf.GGUFWriter, cfg: dict, arch, ftype, name: str) -> None:
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    deepseek2 = arch == gguf.MODEL_ARCH.DEEPSEEK2
    w.add_head_count_kv(1 if deepseek2 else cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts"))))
    if deepseek2:
        add_deepseek2(w, cfg)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    # olmoe: llama.cpp reads the experts' width from feed_forward_length (OLMoE has no dense
    # MLP); qwen3moe and qwen2moe read it from expert_feed_forward_length, and qwen2moe the
    # shared expert's width from expert_shared_feed_forward_length (both fall back to values
    # derived from feed_forward_length when absent, which would be wrong here).
    w.add_feed_forward_length(cfg["intermediate_size"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("head_dim") and not deepseek2:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, scores, types = synthetic_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def check(path: Path, plan: list[Planned], n_samples: int = 3) -> None:
    """Read the file back; compare a few tensors (first expert of stacked ones) to the source."""
    reader = gguf.GGUFReader(path)
    got = {t.name: t for t in reader.tensors}
    missing = [p.name for p in plan if p.name not in got]
    if missing or len(got) != len(plan):
        raise RuntimeError(f"read-back: {len(got)} tensors, expected {len(plan)}; missing {missing[:5]}")
    for p in plan:
        t = got[p.name]
        if t.tensor_type != p.qtype or tuple(int(d) for d in reversed(t.shape)) != p.shape:
            raise RuntimeError(f"{p.name}: read back {t.tensor_type.name} {list(t.shape)}, wrote {p.qtype.name} {p.shape}")
    picks = [p for p in plan if p.qtype == QT.F32][:1] + [p for p in plan if p.qtype != QT.F32][:n_samples]
    picks += [p for p in plan if "exps" in p.name][:1]
    # qwen2moe: a shared-expert matrix, its gate and a bias too
    # deepseek2: the two halves of kv_b_proj
    for want in ("ffn_down_shexp", "ffn_gate_inp_shexp", "attn_q.bias", "attn_k_b", "attn_v_b"):
        picks += [p for p in plan if want in p.name and p not in picks][:1]
    for p in picks:
        data = got[p.name].data
        first = data[0] if len(p.sources) > 1 else data
        src = p.sources[0]
        ref = to_f32(src.map() if p.view is None else p.view(np.asarray(src.map())), src.dtype)
        if p.qtype == QT.BF16:
            # the reader hands bf16 out as raw bytes
            deq = (np.asarray(first).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif p.qtype == QT.F32:
            deq = np.asarray(first, dtype=np.float32)
        else:
            deq = gguf.quants.dequantize(np.asarray(first), p.qtype)
        deq = deq.reshape(ref.shape)
        err = float(np.sum((deq - ref) ** 2))
        sig = float(np.sum(ref**2))
        sqnr = float("inf") if err == 0 else 10 * np.log10(sig / err)
        print(f"check: {p.name:32s} {p.qtype.name:5s} SQNR vs checkpoint {sqnr:6.1f} dB" + (" (bit-exact)" if err == 0 else ""))
    print(f"check: {len(plan)} tensors read back with the written names, types and shapes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="directory with config.json and safetensors")
    ap.add_argument("--type", choices=sorted(TYPES), required=True)
    ap.add_argument("--out", type=Path, help="output .gguf (default: <checkpoint>-<type>.gguf beside it)")
    ap.add_argument("--check", action="store_true", help="read the file back and compare to the checkpoint")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    cfg = json.loads((args.checkpoint / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in ARCHS:
        print(f"unsupported architecture {archs}; supported: {sorted(ARCHS)}", file=sys.stderr)
        return 2
    arch = ARCHS[archs[0]]
    qtype, ftype = TYPES[args.type]
    out = args.out or args.checkpoint.with_name(f"{args.checkpoint.name}-{args.type}.gguf")

    sources = read_checkpoint(args.checkpoint)
    plan = plan_tensors(sources, arch, cfg["num_hidden_layers"], qtype, cfg)
    total_out = sum(p.nbytes for p in plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total_out + (1 << 30):
        print(f"not enough disk for {out}: need {total_out / 1e9:.1f} GB + 1 GB, have {free / 1e9:.1f} GB", file=sys.stderr)
        return 2

    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    print(f"{args.checkpoint} -> {out}: {arch_name}, {len(plan)} tensors, {args.type}, {total_out / 1e9:.2f} GB")
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch_name)
    add_metadata(w, cfg, arch, ftype, f"{args.checkpoint.name} (random weights) {args.type}")
    for p in plan:
        dtype = {QT.F32: np.float32, QT.BF16: np.uint16}.get(p.qtype, np.uint8)
        shape = p.shape if dtype is not np.uint8 else gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
        raw = None if p.qtype == QT.F32 else p.qtype
        w.add_tensor_info(p.name, shape, np.dtype(dtype), p.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total_in = sum(int(np.prod(s.shape)) * np.dtype(ST_DTYPES[s.dtype]).itemsize for p in plan for s in p.sources)
    with tqdm(total=total_in, unit="B", unit_scale=True, desc=f"{args.type}", mininterval=0.5 if sys.stderr.isatty() else 15) as bar:
        for p in plan:
            w.write_tensor_data(convert(p, bar))
    w.close()
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB)")
    if args.check:
        check(out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
