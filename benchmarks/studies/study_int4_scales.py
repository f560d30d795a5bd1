"""Could int4 at group 64 reach Q4_0's weight fidelity with better scales or a non-uniform code?

A numpy model (not the kernels' quantiser, whose search it copies: 8 candidate scales m / -8 x
(1 - i/20), m the group's signed extreme, bf16-rounded, codes -8..7) on 20000 groups of 64
standard normal weights, printing the SQNR of: the same search with 16 and 32 finer candidates;
a least-squares refit of each group's scale to its codes (3 rounds); both signs of the extreme;
and a 16-level non-uniform table (IQ4_NL-like values over [-1, 1]) with a 16-candidate search.
Compare with Q4_0's 21.32 dB and our g64's 20.84 on OLMoE's weights (weight_fidelity.py).

    python benchmarks/studies/study_int4_scales.py

Question: Could int4 at group 64 reach Q4_0's weight fidelity with better scales or a non-uniform
  code?
Answered in benchmarks/log/quantised.md, "What each 4- and 8-bit format gives up against
  llama.cpp's, the amx tier on software tiles (2026-12-05)".
"""
import numpy as np

G = 64
rng = np.random.default_rng(0)
w = rng.standard_normal((20000, G)).astype(np.float32)
m = w[np.arange(len(w)), np.argmax(np.abs(w), axis=1)]


def bf16(x):
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def codes(d):
    inv = np.where(d != 0, 1 / d, 0)
    return np.clip(np.rint(np.clip(w * inv[:, None], -9, 8)), -8, 7)


def sqnr(dq):
    return 10 * np.log10((w ** 2).sum() / ((w - dq) ** 2).sum())


def search(fracs, refine=0):
    best, besterr = None, None
    for f in fracs:
        d = bf16(m / -8 * f)
        e = ((w - d[:, None] * codes(d)) ** 2).sum(1)
        if best is None:
            best, besterr = d.copy(), e
        else:
            u = e < besterr
            best[u], besterr[u] = d[u], e[u]
    d = best
    for _ in range(refine):
        c = codes(d)
        d2 = bf16((w * c).sum(1) / np.maximum((c * c).sum(1), 1e-30))
        e2 = ((w - d2[:, None] * codes(d2)) ** 2).sum(1)
        d = np.where(e2 < ((w - d[:, None] * c) ** 2).sum(1), d2, d)
    return sqnr(d[:, None] * codes(d))


TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32) / 127


def search_table(fracs):
    best, besterr = None, None
    for f in fracs:
        d = bf16(np.abs(m) * f)
        d = np.where(d == 0, 1e-30, d)
        dq = d[:, None] * TABLE[np.abs((w / d[:, None])[..., None] - TABLE).argmin(-1)]
        e = ((w - dq) ** 2).sum(1)
        if best is None:
            best, besterr = d.copy(), e
        else:
            u = e < besterr
            best[u], besterr[u] = d[u], e[u]
    return sqnr(best[:, None] * TABLE[np.abs((w / best[:, None])[..., None] - TABLE).argmin(-1)])


print(f"8 candidates (the quantiser's search)   {search([1 - i / 20 for i in range(8)]):.3f} dB")
print(f"16 finer candidates                     {search([1 - i / 40 for i in range(16)]):.3f} dB")
print(f"32 candidates                           {search([1 - i / 80 for i in range(32)]):.3f} dB")
print(f"8 candidates + least-squares refit      {search([1 - i / 20 for i in range(8)], 3):.3f} dB")
print(f"32 candidates + refit                   {search([1 - i / 80 for i in range(32)], 3):.3f} dB")
print(f"both signs of the extreme + refit       "
      f"{search([1 - i / 40 for i in range(16)] + [-(8 / 7) * (1 - i / 40) for i in range(16)], 3):.3f} dB")
print(f"non-uniform 16-level table, 16 cands    {search_table([1 - i / 40 for i in range(16)]):.3f} dB")
