"""The decode attention kernel alone: hi_na_moe's attention_decode against PyTorch's SDPA.

One query token per head (--heads query heads, --kv-heads key/value heads, --head-dim), over S
cached positions, bf16, --threads threads. As in a decode step, every call reads another
layer's cache: --layers separate K/V buffers are visited round robin, so at long context the
working set (2 x layers x kv_heads x S x head_dim x 2 bytes) is far beyond the L3 and the
figures are DRAM-bound; at short context it is not (as in a real step, where the weights the
step streams evict the cache between layers: these short-context figures are a lower bound).
Arms alternate call by call (in-process A/B); medians over --calls calls per arm.

- native: `_native.attention_decode_raw` (what hi_na_moe.fastpath.attention calls; no argument checks),
  on each tier this CPU has;
- sdpa: `torch.nn.functional.scaled_dot_product_attention` on [1, heads, 1, D] queries and
  [1, kv_heads, S, D] caches (enable_gqa when kv_heads < heads), what transformers' "sdpa"
  attention calls at decode.

GB/s counts the K and V bytes of one call. On a CPU with AVX-512, ATEN_CPU_CAPABILITY=avx2 in
the environment holds PyTorch's kernels to AVX2, the fair opponent of the avx2 column.

    python benchmarks/bench_attention_kernel.py --contexts 16,144,1024,4096
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16,144,1024,4096")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    tiers = [t for t in ("generic", "avx2", "avx512") if _native.isa_supported(t)]
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    print(f"# heads {H}, kv heads {Hkv}, head dim {D}, bf16, {args.threads} threads, {args.layers} layers' caches "
          f"visited round robin, {args.calls} calls per arm (medians)")
    print("| context | K+V per call | " + " | ".join(f"native {t} us" for t in tiers) + " | sdpa us | "
          + " | ".join(f"{t} / sdpa" for t in tiers) + " | best native GB/s |")
    print("|---|---|" + "---|" * (2 * len(tiers) + 2))
    gen = torch.Generator().manual_seed(0)
    for S in (int(c) for c in args.contexts.split(",")):
        q = torch.randn(1, H, D, generator=gen).bfloat16()
        caches = [(torch.randn(1, Hkv, S, D, generator=gen).bfloat16(), torch.randn(1, Hkv, S, D, generator=gen).bfloat16())
                  for _ in range(args.layers)]
        out = torch.empty_like(q)
        q4 = q.unsqueeze(2)
        arms = {t: [] for t in tiers} | {"sdpa": []}

        def native(k, v, tier):
            ks, vs = k.stride(), v.stride()
            _native.attention_decode_raw(1, q.data_ptr(), 1, H, Hkv, S, D, k.data_ptr(), ks[0], ks[1], ks[2],
                                         v.data_ptr(), vs[0], vs[1], vs[2], D**-0.5, out.data_ptr(), args.threads,
                                         tier, 0, 0)

        with torch.inference_mode():
            for i in range(args.calls + 10):
                k, v = caches[i % args.layers]
                for arm in arms:
                    t = time.perf_counter()
                    if arm == "sdpa":
                        F.scaled_dot_product_attention(q4, k, v, scale=D**-0.5, enable_gqa=Hkv != H)
                    else:
                        native(k, v, arm)
                    dt = time.perf_counter() - t
                    if i >= 10:
                        arms[arm].append(dt)
        med = {a: statistics.median(x) for a, x in arms.items()}
        kv = 2 * Hkv * S * D * 2
        best = min(med[t] for t in tiers)
        print(f"| {S} | {kv / 2**20:.1f} MiB | " + " | ".join(f"{1e6 * med[t]:.1f}" for t in tiers)
              + f" | {1e6 * med['sdpa']:.1f} | " + " | ".join(f"{med[t] / med['sdpa']:.2f}" for t in tiers)
              + f" | {kv / best / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
