"""A model whose bf16 weights exceed this machine's RAM, loaded with int4 experts and run.

The checkpoint (random weights, written tensor by tensor so the writer never holds it) is made
with `benchmarks/make_checkpoint.py`, e.g. the Qwen3-30B-A3B shape with 24 of its 48 layers
(30.5 GB bf16 > 24 GiB RAM here). This script loads it with `hi_na_moe.from_pretrained(ckpt,
weights="int4")` (experts streamed into the packed-expert store block by block), then times a
greedy decode. Memory is sampled every 0.1 s during load and decode: peak RSS (VmHWM, which
counts file pages the checkpoint's and the store's memory maps bring in; the OS can drop those)
and the peak of anonymous memory (RssAnon: what must really fit).

    python benchmarks/bench_larger_than_ram.py --ckpt /work/ckpt/qwen3-30b-24l [--cache-dir DIR]
        [--new-tokens 32] [--prompt-len 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(val.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_anon = self.peak_file = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            s = status()
            self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
            self.peak_file = max(self.peak_file, s.get("RssFile", 0))
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--cache-dir", default="/work/ckpt/hina-cache/larger-than-ram")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    import hi_na_moe

    torch.set_num_threads(args.threads)
    ckpt = Path(args.ckpt)
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    mem_total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    model = hi_na_moe.from_pretrained(ckpt, weights="int4", dtype=torch.bfloat16,
                                      config=hi_na_moe.load_config(cache_dir=args.cache_dir))
    load_s = time.perf_counter() - t0
    after_load = status()
    rep = hi_na_moe.report_for(model)
    store_bytes = sum(b.packed_bytes or 0 for b in rep.blocks)
    events = sorted({b.cache for b in rep.blocks})
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab, (1, args.prompt_len), generator=g)
    steps = []
    with torch.inference_mode():
        cache = DynamicCache()
        t = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(args.new_tokens):
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
            assert torch.isfinite(out.logits).all()
            nxt = out.logits[:, -1:].argmax(-1)
    sampler.stop.set()
    sampler.join()
    end = status()
    res = {
        "checkpoint": str(ckpt), "checkpoint_bytes": ckpt_bytes, "machine_ram_bytes": mem_total,
        "load_s": load_s, "store_events": events, "int4_expert_bytes": store_bytes,
        "rss_after_load_bytes": after_load.get("VmRSS"), "peak_rss_bytes": end.get("VmHWM"),
        "peak_anon_bytes": sampler.peak_anon, "peak_file_bytes": sampler.peak_file,
        "prefill_s": prefill_s, "decode_tokens_per_s": len(steps) / sum(steps),
        "decode_median_ms": 1e3 * statistics.median(steps), "decode_p90_ms": 1e3 * sorted(steps)[int(0.9 * (len(steps) - 1))],
        "first_steps_ms": [round(1e3 * s, 1) for s in steps[:4]],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    gib = 2 ** 30
    print(f"checkpoint {ckpt_bytes / 1e9:.1f} GB bf16 on a machine with {mem_total / gib:.1f} GiB RAM; int4 experts "
          f"{store_bytes / 1e9:.2f} GB ({', '.join(events)}); load {load_s:.0f} s")
    print(f"peak RSS {end.get('VmHWM', 0) / gib:.2f} GiB (anonymous peak {sampler.peak_anon / gib:.2f} GiB, file-backed "
          f"peak {sampler.peak_file / gib:.2f} GiB); after load {after_load.get('VmRSS', 0) / gib:.2f} GiB")
    print(f"prefill-{args.prompt_len} {prefill_s:.2f} s; decode {res['decode_tokens_per_s']:.2f} tok/s "
          f"(median {res['decode_median_ms']:.0f} ms, p90 {res['decode_p90_ms']:.0f} ms; first steps {res['first_steps_ms']})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
