"""One latent attention decode call (hina::mla_decode) with kv_b_proj's weight dense in bf16
against the same weight as a quantised layer's codes and scales (moe.h's RowQuant, what
hi_na_moe.fastpath.mla reads under scope="all" with int8 / int4).

Every arm cycles through --layers distinct weights (as a model's layers do: with the default 40,
DeepSeek-V2-Lite's shape holds 168 MB of bf16 weights, far beyond the L3; --layers 1 keeps one
weight in cache, the kernel's compute alone), the arms alternate round by round in one process,
and each prints the median time a call over --rounds rounds (the first two dropped) with the
weight bytes a call reads and their rate. The queries, latent cache and rope keys are random;
--context cached positions. The quantised arms' weights are hi_na_moe.fastpath.mla.QuantWeight's, as the
model's kernels read them.

    chrt -f 1 python benchmarks/studies/bench_mla_weight.py [--layers 40] [--context 1] [--threads 2]

--ab-dots: the dense weight twice instead, the bf16 latent cache read with AVX512-BF16 dot products
(mla_decode's default where the CPU has them) against float32 FMAs.

Question: Should latent attention read a quantised kv_b_proj as its codes and scales rather than a
  dense bf16 copy, and a bf16 cache with bf16 dot products?
Answered in benchmarks/log/attention-and-families.md, "Latent attention reading a quantised
  kv_b_proj as its codes and scales (2026-12-02)".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_na_moe.core.native import native_module
from hi_na_moe.fastpath.mla import QuantWeight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim")
    ap.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    ap.add_argument("--value", type=int, default=128, help="v_head_dim")
    ap.add_argument("--rank", type=int, default=512, help="kv_lora_rank")
    ap.add_argument("--context", type=int, default=1, help="cached positions")
    ap.add_argument("--layers", type=int, default=40, help="distinct weights each arm cycles through")
    ap.add_argument("--group", type=int, default=64, help="int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--ab-dots", action="store_true",
                    help="instead of the weight forms: the dense weight with the bf16 latent cache read on bf16 dot "
                         "products (where the CPU has AVX512-BF16) / on float32 FMAs (_native.set_mla_bf16_dots)")
    args = ap.parse_args()
    nat = native_module()[0]
    if nat is None:
        raise SystemExit(f"the native kernels are not available: {native_module()[1]}")
    H, Dn, Dv, Dr, L, S = args.heads, args.nope, args.value, args.rope, args.rank, args.context
    rows = H * (Dn + Dv)
    gen = torch.Generator().manual_seed(0)
    dense = [(torch.randn(rows, L, generator=gen) * 0.05).to(torch.bfloat16) for _ in range(args.layers)]
    arms = {"bf16 dense": ([w.data_ptr() for w in dense], rows * L * 2)}
    if args.ab_dots:
        arms["f32 FMAs"] = arms["bf16 dense"]
    keep = []
    for fmt in () if args.ab_dots else ("int8", "int4"):
        ws, nbytes = [], 0
        for w in dense:
            packed = nat.PackedExperts.pack_linear(w, None, isa="generic", num_threads=args.threads, weights=fmt,
                                                   group_size=args.group)
            qw = QuantWeight(packed, fmt, args.group if fmt == "int4" else 0)
            keep.append(qw)
            ws.append(qw.handle)
            nbytes = qw.nbytes
        arms[f"{fmt} codes"] = (ws, nbytes)
    q = torch.randn(1, H, Dn + Dr, generator=gen).to(torch.bfloat16)
    lat = torch.randn(1, S, L, generator=gen).to(torch.bfloat16)
    kr = torch.randn(1, S, Dr, generator=gen).to(torch.bfloat16)
    out = torch.empty(1, H, Dv, dtype=torch.bfloat16)
    isa = nat.best_isa() if args.isa == "auto" else args.isa

    def call(w) -> None:
        nat.mla_decode_raw(1, q.data_ptr(), H * (Dn + Dr), Dn + Dr, q.data_ptr() + Dn * 2, H * (Dn + Dr), Dn + Dr, w,
                           lat.data_ptr(), S * L, L, kr.data_ptr(), S * Dr, Dr, out.data_ptr(), 1, H, S, Dn, Dr, L, Dv,
                           0.1, 0, 0, args.threads, isa)

    times = {a: [] for a in arms}
    for _ in range(args.rounds):
        for a, (ws, _) in arms.items():
            nat.set_mla_bf16_dots(a != "f32 FMAs")
            t = time.perf_counter()
            for w in ws:
                call(w)
            times[a].append((time.perf_counter() - t) / len(ws))
    nat.set_mla_bf16_dots(True)
    print(f"mla_decode at {isa}, {args.threads} threads: H {H}, Dn {Dn}, Dr {Dr}, Dv {Dv}, L {L}, {S} cached "
          f"positions, {args.layers} distinct weights an arm, medians of {args.rounds - 2} rounds")
    base = statistics.median(times["bf16 dense"][2:])
    for a, (ws, nbytes) in arms.items():
        m = statistics.median(times[a][2:])
        print(f"  {a:10s}: {m * 1e6:7.1f} us a call ({base / m:.2f}x dense), weight {nbytes / 2**20:.2f} MiB a call, "
              f"{nbytes / m / 1e9:.1f} GB/s of it")


if __name__ == "__main__":
    main()
