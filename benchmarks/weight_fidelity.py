"""How close each quantised format's weights are to the checkpoint's: ours and llama.cpp's.

The whole-model comparisons with llama.cpp (bench_full_model.py) pair formats by width: int4
with Q4_0, int8 with Q8_0. This script says what each pairing gives up. For a sample of the
checkpoint's linear weights (attention projections, a few experts' gate/up/down, lm_head; from
--layers), every format quantises the same bf16 matrix and the result is compared with it:
- ours: `PackedExperts.pack_linear(w, weights=int8|int4, group_size=...)`, dequantised by
  `unpack()` (scale * code, exactly what the kernels multiply by), bits a weight from the
  packed block's bytes (codes, scales, panel layout);
- llama.cpp's: Q8_0 and Q4_0 through the PyPI `gguf` package's reference quantiser
  (`gguf.quants.quantize` / `dequantize`, the same code make_gguf.py writes the GGUFs with),
  8.5 and 4.5 bits a weight. The package is taken from --gguf-site (by default the llama.cpp
  venv's site-packages) when this interpreter has none; without it those rows are skipped.
SQNR = 10 log10(sum w^2 / sum (w - w_q)^2) over all sampled weights of a kind (float64).

    python benchmarks/weight_fidelity.py --ckpt /work/ckpt/olmoe-1b-7b [--layers 0,8,15] [--experts 4]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

OURS = (("int8", "int8", 64), ("int4 g32", "int4", 32), ("int4 g64", "int4", 64), ("int4 g128", "int4", 128))
THEIRS = (("Q8_0", "Q8_0", 8.5), ("Q4_0", "Q4_0", 4.5))
KINDS = ("attention", "experts", "lm_head")


def kind_of(name: str) -> str | None:
    if name == "lm_head.weight":
        return "lm_head"
    if ".self_attn." in name and name.endswith("proj.weight"):
        return "attention"
    if ".experts." in name and name.endswith("proj.weight"):
        return "experts"
    return None


def sample(ckpt: Path, layers: set[int], experts: int) -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    out = []
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                kind = kind_of(name)
                if kind is None:
                    continue
                if kind != "lm_head":
                    parts = name.split(".")
                    layer = int(parts[parts.index("layers") + 1])
                    if layer not in layers:
                        continue
                    if kind == "experts" and int(parts[parts.index("experts") + 1]) >= experts:
                        continue
                w = st.get_tensor(name)
                if w.dim() == 2:
                    out.append((name, w))
    return out


def import_gguf(site: str | None):
    try:
        import gguf  # noqa: F401
    except ImportError:
        if not site or not Path(site, "gguf").is_dir():
            return None
        sys.path.append(site)  # after this interpreter's own packages: its numpy stays first
        try:
            import gguf  # noqa: F401
        except ImportError:
            return None
    import gguf

    return gguf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (safetensors)")
    ap.add_argument("--layers", default="0,-1", help="decoder layers to sample (negative: from the end)")
    ap.add_argument("--experts", type=int, default=4, help="experts sampled per layer (the first N)")
    ap.add_argument("--gguf-site", default="/work/venv-llamacpp/lib/python3.11/site-packages")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from hi_na_moe import _native

    ckpt = Path(args.ckpt)
    n_layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    layers = {int(x) % n_layers for x in args.layers.split(",")}
    mats = sample(ckpt, layers, args.experts)
    if not mats:
        raise SystemExit(f"{ckpt}: no attention, expert or lm_head weights found in layers {sorted(layers)}")
    gguf = import_gguf(args.gguf_site)
    if gguf is None:
        print(f"(no gguf package here nor in {args.gguf_site}: Q8_0 / Q4_0 rows skipped)")
    formats = [f[0] for f in OURS] + ([f[0] for f in THEIRS] if gguf else [])
    sig = {k: 0.0 for k in KINDS}
    err = {(f, k): 0.0 for f in formats for k in KINDS}
    bits = {f: [0.0, 0] for f in formats}
    count = {k: 0 for k in KINDS}
    for name, w in mats:
        k = kind_of(name)
        ref = w.float().numpy().astype(np.float64)
        sig[k] += float((ref * ref).sum())
        count[k] += ref.size
        for label, weights, group in OURS:
            pe = _native.PackedExperts.pack_linear(w.contiguous(), None, weights=weights, group_size=group)
            q = torch.from_dlpack(pe.unpack()[1]).float().numpy().reshape(ref.shape)
            err[(label, k)] += float(((ref - q) ** 2).sum())
            bits[label][0] += 8.0 * pe.nbytes
            bits[label][1] += ref.size
        if gguf:
            wf = w.float().numpy()
            for label, qt, b in THEIRS:
                t = getattr(gguf.GGMLQuantizationType, qt)
                q = gguf.quants.dequantize(gguf.quants.quantize(wf, t), t).reshape(ref.shape)
                err[(label, k)] += float(((ref - q.astype(np.float64)) ** 2).sum())
                bits[label][0] += b * ref.size
                bits[label][1] += ref.size
    kinds = [k for k in KINDS if count[k]]
    print(f"{ckpt.name}: {len(mats)} matrices ({', '.join(f'{count[k] / 1e6:.1f} M {k} weights' for k in kinds)}), "
          f"layers {sorted(layers)}, first {args.experts} experts each")
    print("| format | bits a weight | " + " | ".join(f"SQNR {k} dB" for k in kinds) + " | SQNR all dB |")
    print("|---|---|" + "---|" * (len(kinds) + 1))
    rows = {}
    for f in formats:
        per = {k: 10 * math.log10(sig[k] / err[(f, k)]) for k in kinds}
        total = 10 * math.log10(sum(sig[k] for k in kinds) / sum(err[(f, k)] for k in kinds))
        rows[f] = {"bits_per_weight": bits[f][0] / bits[f][1], "sqnr_db": per, "sqnr_all_db": total}
        print(f"| {f} | {rows[f]['bits_per_weight']:.3f} | " + " | ".join(f"{per[k]:.2f}" for k in kinds)
              + f" | {total:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ckpt": str(ckpt), "layers": sorted(layers), "experts": args.experts,
                                               "matrices": len(mats), "formats": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
