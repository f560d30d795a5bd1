"""How an int4 group's scale can be stored in one byte: layout 5's choice against the others.

A numpy model (not the packer: its candidate search copied) at group 32 on three kinds of rows of
2048 weights: standard normal, the shipped model's trained matrices, and normal rows where one
weight in each of 64 rows is 20-1000x its row's scale (a "super weight"; the figure is the SQNR
of those rows' other weights, which the outlier must not ruin). Scale forms:
- bf16: a bfloat16 scale a group (layout 4), the search over 8 shrinks of m / -8;
- lin-row: an int8 code a group, linear in an fp32 factor a row (the row's largest |m| / 8 / 127);
- log/8 (layout 5): a sign and a 7-bit step index, |scale| = F 2^-(e/8), F the row's largest
  |m| / 8; 8 candidates e0 - 1 .. e0 + 6 around the nearest step e0;
- log/12, log/16: finer steps, a shorter range (2^-10.6, 2^-7.9 of F).
Q4_0 (an fp16 scale m / -8 a block of 32) is printed for reference.

    python benchmarks/studies/study_int4_scale_codes.py

Question: How should an int4 group's scale be stored in one byte (packed layout 5)?
Answered in benchmarks/log/quantised.md, "int4 layout 5: a one-byte scale code a group, group 32 by
  default (2026-12-05)".
"""
from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

G = 32
ROOT = Path(__file__).resolve().parents[2]


def bf16(x):
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def codes(w, d):
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0)
    return np.clip(np.rint(np.clip(w * inv[..., None], -9, 8)), -8, 7)


def best(w, cands):
    """Per group the candidate scale with the smallest squared error (ties: the earlier)."""
    out, err = None, None
    for d in cands:
        e = ((w - d[..., None] * codes(w, d)) ** 2).sum(2)
        if out is None:
            out, err = d.copy(), e
        else:
            u = e < err
            out[u], err[u] = d[u], e[u]
    return out


def scales(W, form):
    R, K = W.shape
    w = W.reshape(R, K // G, G)
    m = np.take_along_axis(w, np.argmax(np.abs(w), axis=2)[..., None], 2)[..., 0]
    if form == "Q4_0":
        return w, (m / -8).astype(np.float16).astype(np.float32)
    if form == "bf16":
        return w, best(w, [bf16(m / -8 * (1 - i / 20)) for i in range(8)])
    if form == "lin-row":
        F = np.abs(m).max(1, keepdims=True) / 8 / 127
        F = np.where(F == 0, 1, F)
        return w, best(w, [-np.sign(m) * np.clip(np.rint(np.abs(m) / 8 * (1 - i / 20) / F), 0, 127) * F
                           for i in range(8)])
    steps = int(form.split("/")[1])
    F = np.abs(m).max(1, keepdims=True) / 8
    F = np.where(F == 0, 1, F)
    r = np.maximum(np.abs(m) / 8 / F, 1e-38)
    e0 = np.rint(-np.log2(r) * steps)
    return w, best(w, [-np.sign(m) * F * 2.0 ** (-np.clip(e0 + i, 0, 127) / steps) for i in list(range(7)) + [-1]])


def sqnr(w, d, mask=None):
    err = w - d[..., None] * codes(w, d)
    if mask is not None:
        w, err = w[mask], err[mask]
    return 10 * np.log10((w ** 2).sum() / (err ** 2).sum())


FORMS = ("Q4_0", "bf16", "lin-row", "log/8", "log/12", "log/16")


def main():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((2048, 2048)).astype(np.float32)
    mats = {"normal": normal}
    try:
        from safetensors.numpy import load_file
        st = {}
        for f in glob.glob(str(ROOT / "models" / "hina-tiny-moe" / "*.safetensors")):
            st.update(load_file(f))
        mats["shipped model"] = np.concatenate([v.astype(np.float32).reshape(-1, v.shape[-1]) for v in st.values()
                                                if v.ndim >= 2 and v.shape[-1] == 128])
    except Exception as e:  # safetensors missing, or the model not there
        print(f"(shipped model skipped: {e})")
    print("| rows | " + " | ".join(FORMS) + " |\n|---|" + "---|" * len(FORMS))
    for name, W in mats.items():
        print(f"| {name} | " + " | ".join(f"{sqnr(*scales(W, f)):.2f}" for f in FORMS) + " |")
    idx = rng.integers(0, 2048, (64, 2))
    for mult in (20, 60, 200, 1000):
        W = normal.copy()
        W[idx[:, 0], idx[:, 1]] *= mult
        mask = np.zeros(W.shape, bool)
        mask[idx[:, 0]] = True
        mask[idx[:, 0], idx[:, 1]] = False
        cells = []
        for f in FORMS:
            w, d = scales(W, f)
            cells.append(f"{sqnr(w, d, mask.reshape(w.shape)):.2f}")
        print(f"| a weight {mult}x, the rest of its row | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
