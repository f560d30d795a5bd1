"""Prefill attention: the native AVX512-BF16 kernel against PyTorch's SDPA, as an op and in a model.

--op: causal attention of T query rows over T keys (what transformers asks SDPA for on a
prompt: no mask, is_causal), bfloat16, for each shape and length; the kernel
(attention_prefill_raw) and SDPA alternate call by call, --reps pairs; the medians, GFLOP/s
(2 T^2 D Hq flops for each of q k^T and p v, halved by the causal mask) and the ratio of the
medians. Shapes: OLMoE-1B-7B / Qwen1.5-MoE (16 heads of 128), Qwen3-30B-A3B (32 query heads
over 4 kv heads of 128), and a 64-wide head (16 of 64).

--ckpt: the whole model's prefill of a random prompt of each --lengths, one forward with a
fresh DynamicCache and logits_to_keep=1 (as generate prefills, and bench_full_model.py), with
hi_na_moe.fastpath.attention.PREFILL on (the attention on the native kernel; latent attention's too,
hi_na_moe.fastpath.mla) and off (the attention modules' own forward: SDPA, or eager for GPT-OSS, which has
no SDPA form), alternating, --reps pairs per length after one untimed forward
per arm; the medians and their ratio. Loads with hi_na_moe.from_pretrained from a warm store
(--cache-dir).

--rope: the rotary embedding of T x 16 x 128 bf16 query rows, the baseline build (tier
generic) against the AVX-512 build on one thread and on --threads, alternating; medians.

    chrt -f 1 python benchmarks/bench_prefill_attention.py --op --lengths 512,2048,4096
    chrt -f 1 python benchmarks/bench_prefill_attention.py --ckpt /work/ckpt/olmoe-1b-7b --weights int4 \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4 --lengths 512,2048,4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = {  # name: (Hq, Hkv, D)
    "16x128 (OLMoE, Qwen1.5-MoE)": (16, 16, 128),
    "32/4x128 (Qwen3-30B-A3B)": (32, 4, 128),
    "16x64": (16, 16, 64),
}


def op(args, torch, F, native) -> list[dict]:
    rows = []
    isa = args.isa
    for name, (Hq, Hkv, D) in SHAPES.items():
        if not native.attention_prefill_supported(D, Hq, Hkv, isa):
            raise SystemExit(f"the native prefill kernel does not run here (tier {isa}: AVX512-BF16 needed)")
        for T in args.lengths:
            g = torch.Generator().manual_seed(T)
            q = torch.randn(1, T, Hq, D, generator=g).bfloat16()
            k = torch.randn(1, Hkv, T, D, generator=g).bfloat16()
            v = torch.randn(1, Hkv, T, D, generator=g).bfloat16()
            out = torch.empty(1, T, Hq, D, dtype=torch.bfloat16)
            qt = q.transpose(1, 2)
            ks, vs = k.stride(), v.stride()

            def ours():
                native.attention_prefill_raw(q.data_ptr(), *q.stride()[:3], 1, T, Hq, Hkv, T, D, k.data_ptr(),
                                             ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2], D ** -0.5,
                                             out.data_ptr(), args.threads, isa, 0, 0, 0)

            def sdpa():
                return F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=D ** -0.5,
                                                      enable_gqa=Hq != Hkv)

            if args.row_blocks:  # a tuning build: the settings alternate call by call, no SDPA arm
                rows.append(row_block_ab(args, name, T, ours, flops=2 * 2 * T * T * D * Hq / 2))
                continue
            ours()
            ref = sdpa().transpose(1, 2)
            diff = (out.float() - ref.float()).abs().max().item()
            t_ours, t_sdpa = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                ours()
                t1 = time.perf_counter()
                sdpa()
                t2 = time.perf_counter()
                t_ours.append(t1 - t0)
                t_sdpa.append(t2 - t1)
            flops = 2 * 2 * T * T * D * Hq / 2
            mo, ms = statistics.median(t_ours), statistics.median(t_sdpa)
            row = {"shape": name, "T": T, "native_ms": mo * 1e3, "sdpa_ms": ms * 1e3,
                   "native_gflops": flops / mo / 1e9, "sdpa_gflops": flops / ms / 1e9, "sdpa_over_native": ms / mo,
                   "max_abs_diff_vs_sdpa": diff}
            rows.append(row)
            print(f"{name:28s} T={T:5d}: native {row['native_ms']:8.1f} ms ({row['native_gflops']:4.0f} GFLOP/s)  "
                  f"SDPA {row['sdpa_ms']:8.1f} ms ({row['sdpa_gflops']:4.0f} GFLOP/s)  SDPA/native "
                  f"{row['sdpa_over_native']:.2f}x  (max |diff| {diff:.1e})", flush=True)
    return rows


def row_block_ab(args, name, T, ours, flops) -> dict:
    """--row-blocks: the kernel with HINA_PREFILL_ROW_BLOCKS = each value in turn, call by call."""
    import os

    times: dict[int, list[float]] = {g: [] for g in args.row_blocks}
    for _ in range(args.reps):
        for g in args.row_blocks:
            os.environ["HINA_PREFILL_ROW_BLOCKS"] = str(g)
            t0 = time.perf_counter()
            ours()
            times[g].append(time.perf_counter() - t0)
    os.environ.pop("HINA_PREFILL_ROW_BLOCKS", None)
    med = {g: statistics.median(v) for g, v in times.items()}
    print(f"{name:28s} T={T:5d}: " + "  ".join(f"G={g} {med[g] * 1e3:7.1f} ms ({flops / med[g] / 1e9:4.0f} GFLOP/s)"
                                              for g in args.row_blocks), flush=True)
    return {"shape": name, "T": T, "row_blocks_ms": {str(g): med[g] * 1e3 for g in args.row_blocks}}


def rope(args, torch, native) -> list[dict]:
    """--rope: the rotary embedding of a prompt's queries (T x 16 heads x 128, bf16) as prefill
    calls it: the baseline loops (tier generic, one thread) against the AVX-512 build on one and
    on --threads threads; the same bits (tests/test_attention.py)."""
    rows = []
    arms = (("generic", 1), (args.isa if args.isa != "auto" else "avx512", 1),
            (args.isa if args.isa != "auto" else "avx512", args.threads))
    for T in args.lengths:
        H, D = 16, 128
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, D, generator=g).bfloat16()
        c, s = torch.randn(T, D, generator=g).bfloat16(), torch.randn(T, D, generator=g).bfloat16()
        out = torch.empty_like(x)
        times: dict[tuple, list[float]] = {a: [] for a in arms}
        for _ in range(args.reps):
            for tier, threads in arms:
                t0 = time.perf_counter()
                native.rope_rotate_half_raw(x.data_ptr(), T, H, D, c.data_ptr(), s.data_ptr(), out.data_ptr(), 1,
                                            tier, threads)
                times[(tier, threads)].append(time.perf_counter() - t0)
        med = {a: statistics.median(v) for a, v in times.items()}
        rows.append({"T": T, "ms": {f"{t}/{n}": m * 1e3 for (t, n), m in med.items()}})
        print(f"rope T={T:5d} x {H} x {D}: " + "  ".join(f"{t} {n} thread(s) {m * 1e3:6.2f} ms"
                                                         for (t, n), m in med.items()), flush=True)
    return rows


def model(args, torch) -> list[dict]:
    from transformers import DynamicCache

    import hi_na_moe
    from hi_na_moe.fastpath import attention

    cfg = hi_na_moe.load_config(cache_dir=args.cache_dir, scope="all", dense_lossless=args.dense_lossless,
                                threads=args.threads)
    m = hi_na_moe.from_pretrained(args.ckpt, weights=args.weights, dtype=torch.bfloat16, progress=False, config=cfg)
    rep = hi_na_moe.report_for(m)
    # latent attention (hi_na_moe.fastpath.mla) counts too: its prefill follows attention.PREFILL as well
    on, of = (len(rep.attention_prefill) + len(rep.attention_latent_prefill),
              len(rep.attention) + len(rep.attention_latent))
    print(f"{on} of {of} attention modules with native prefill attention",
          flush=True)
    if not on:
        raise SystemExit(f"no native prefill attention here: {rep.attention_prefill_math}")
    own = m.config._attn_implementation  # what the modules' own forward computes attention with
    rows = []
    for T in args.lengths:
        ids = torch.randint(3, m.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        times = {True: [], False: []}
        for on in (True, False):  # untimed: first-touch of buffers and caches for both arms
            attention.PREFILL = on
            with torch.inference_mode():
                m(ids, past_key_values=DynamicCache(config=m.config), use_cache=True, logits_to_keep=1)
        for rep_i in range(args.reps):
            for on in ((True, False) if rep_i % 2 == 0 else (False, True)):
                attention.PREFILL = on
                t0 = time.perf_counter()
                with torch.inference_mode():
                    m(ids, past_key_values=DynamicCache(config=m.config), use_cache=True, logits_to_keep=1)
                times[on].append(time.perf_counter() - t0)
        attention.PREFILL = True
        on, off = statistics.median(times[True]), statistics.median(times[False])
        row = {"T": T, "native_s": on, "sdpa_s": off, "speedup": off / on, "native_all": times[True],
               "sdpa_all": times[False], "own_attention": own}
        rows.append(row)
        print(f"prefill-{T}: native attention {on:.2f} s ({T / on:.0f} tok/s), own forward ({own}) {off:.2f} s "
              f"({T / off:.0f} tok/s): {off / on:.3f}x", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", action="store_true", help="the kernel against SDPA as an op")
    p.add_argument("--ckpt", help="a checkpoint: whole-model prefill with and without the kernel")
    p.add_argument("--rope", action="store_true", help="the rotary embedding of a prompt's queries, per build")
    p.add_argument("--weights", default="int4")
    p.add_argument("--cache-dir", help="the packed-expert store of --ckpt and --weights")
    p.add_argument("--dense-lossless", default="")
    p.add_argument("--lengths", default="512,2048,4096", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--reps", type=int, default=0, help="pairs per point (default: 7 for --op, 3 for --ckpt)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", default="auto")
    p.add_argument("--row-blocks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="with --op, in a tuning build (-Ccmake.define.HINA_PREFETCH_TUNING=ON): query-row blocks "
                        "per pass over the keys, e.g. 1,2,3, alternating call by call (no SDPA arm)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not args.op and not args.ckpt and not args.rope:
        p.error("give --op, --rope, --ckpt or several")
    if args.ckpt and not args.cache_dir:
        p.error("--ckpt needs --cache-dir (a warm store of that checkpoint and format)")

    import torch
    import torch.nn.functional as F

    from hi_na_moe.core.native import native_module

    native = native_module()[0]
    if native is None:
        raise SystemExit(f"native library not available: {native_module()[1]}")
    torch.set_num_threads(args.threads)
    out = {"cpu": native.cpu_features().get("vendor"), "threads": args.threads}
    reps = args.reps
    if args.op:
        args.reps = reps or 7
        out["op"] = op(args, torch, F, native)
    if args.rope:
        args.reps = reps or 7
        out["rope"] = rope(args, torch, native)
    if args.ckpt:
        args.reps = reps or 3
        out["model"] = model(args, torch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
