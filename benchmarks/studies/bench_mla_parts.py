"""Where a latent attention (MLA) module's decode call spends its time (hi_na_moe.fastpath.mla.NativeMLA),
in a whole model: each segment of NativeMLA._decode timed with perf_counter around it, per
module call, over --steps decode steps after a --context-token prompt (DynamicCache), medians
per segment. The segments: the q and kv_a projections (one kernel call when dense_fuse packed
them as one group), the splits and views, kv_a_layernorm, the rotary ops, the cache append, the
weight lookup and checks, the attention kernel, o_proj.

    chrt -f 1 python benchmarks/studies/bench_mla_parts.py --ckpt /work/ckpt/deepseek-v2-lite-6l \\
        --cache-dir /work/ckpt/hina-cache/dsv2-lite-6l/int4 [--no-fuse]

--no-fuse packs every dense linear alone (dense_fuse=False: the shared experts' gate/up too, so
the step time is not only the projections' difference).

Question: Where does a latent attention (MLA) module's decode call spend its time?
Answered in benchmarks/log/attention-and-families.md, "DeepSeek-V2-Lite-shaped: multi-head latent
  attention on a native absorbed kernel (2026-12-02)".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--cache-dir", required=True, help="the int4 store")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fuse", action="store_true")
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache

    from hi_na_moe.fastpath import kv_cache
    from hi_na_moe.fastpath import mla

    torch.set_num_threads(args.threads)
    model = stored.load(args.ckpt, args.weights, args.cache_dir, dense_fuse=not args.no_fuse)
    seg: dict[str, list[float]] = {}

    def timed_decode(self, m, h, pe, cache, mask=None):  # NativeMLA._decode, segment by segment
        B, H, Dn, Dr, L, Dv = h.shape[0], self.H, self.Dn, self.Dr, self.L, self.Dv
        t = [time.perf_counter()]
        q, ckv = self._projections(m, h)
        t.append(time.perf_counter())
        q_nope, q_pe = torch.split(q.view(B, 1, H, Dn + Dr).transpose(1, 2), [Dn, Dr], dim=-1)
        latent, k_pe = torch.split(ckv, [L, Dr], dim=-1)
        t.append(time.perf_counter())
        latent = m.kv_a_layernorm(latent).view(B, 1, 1, L)
        t.append(time.perf_counter())
        q_pe, k_pe = self._rotate(q_pe, k_pe.view(B, 1, 1, Dr), pe)
        t.append(time.perf_counter())
        latent, k_pe = kv_cache.append(cache, m.layer_idx, latent, k_pe)
        t.append(time.perf_counter())
        w = self._weight()
        out = torch.empty(B, 1, H * Dv, dtype=self.dtype)
        if not self._kernel_fits(q_nope, q_pe, latent, k_pe, mask, B):
            raise SystemExit("the kernel does not take this cache's tensors")
        t.append(time.perf_counter())
        self.native.mla_decode_raw(
            1, q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
            w.data_ptr(), latent.data_ptr(), latent.stride(0), latent.stride(2), k_pe.data_ptr(), k_pe.stride(0),
            k_pe.stride(2), out.data_ptr(), B, H, latent.shape[2], Dn, Dr, L, Dv, m.scaling,
            0 if mask is None else mask.data_ptr(), 0, self.threads or torch.get_num_threads(), self.isa)
        t.append(time.perf_counter())
        res = m.o_proj(out)
        t.append(time.perf_counter())
        for name, a, b in zip(("q and kv_a projections", "splits and views", "kv_a_layernorm", "rotary ops",
                               "cache append", "weight and checks", "attention kernel", "o_proj"), t, t[1:]):
            seg.setdefault(name, []).append(b - a)
        return res, None

    mla.NativeMLA._decode = timed_decode
    ids = torch.randint(300, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    steps = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        seg.clear()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t0)
            nxt = out.logits[:, -1:].argmax(-1)
    if not seg:
        raise SystemExit("no latent attention module took its native decode path (scope all? an MLA model?)")
    print(f"# {args.ckpt} | {args.weights} scope all, dense_fuse {not args.no_fuse} | context {args.context} | "
          f"{args.steps} steps | step {1e3 * statistics.median(steps):.1f} ms (median)")
    print("| segment | us per module call (median) |")
    print("|---|---|")
    total = 0.0
    for name, v in seg.items():
        med = 1e6 * statistics.median(v)
        total += med
        print(f"| {name} | {med:.1f} |")
    print(f"| sum | {total:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
