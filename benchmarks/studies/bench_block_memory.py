"""Where a packed block lives (config key memory), compared in one process: every experts block
of a store (one format's directory under bench_full_model.py's --cache-dir) loaded twice, as a
read-only view of the store's mapping (PackedExperts.view, memory="map") and as a copy of its own
(PackedExperts.copy, memory="copy"). Decode calls (T=1, top_k experts drawn at random, the same
draw for both arms) go block by block, the two arms alternating which runs first, each call
followed by a read of the bandwidth probe (paired, and evicting the caches).

    chrt -f 1 python benchmarks/studies/bench_block_memory.py \\
        --store /work/ckpt/hina-cache/bench_full_model-olmoe-1b-7b/int4 --top-k 8 [--drop-cache]

The mapping's speed depends on the state of the page cache, so the script prints how much of the
mapping the kernel maps with 2 MiB entries (FilePmdMapped) and how much of the copies got huge
pages (AnonHugePages). Three states to choose from:
- as earlier runs left the store's cached pages (the default);
- --drop-cache: the OS first drops them (posix_fadvise DONTNEED, no privilege needed), so the
  mapping is read from disk again, in whatever folios readahead makes then;
- --written DIR: the store's files are first written again into DIR (on the store's file
  system, removed at the end), so that the cached pages are those writing leaves, as after
  the store was built by the same machine (a first from_pretrained).

Prints per arm: median µs per call, GB/s (the routed experts' bytes: nbytes * top_k / E), the
median of call GB/s over the paired probe read, and the copy / map ratio of the medians.

Question: Do packed blocks stream faster as a copy of their own than from the store's mapping (the
  memory key)?
Answered in benchmarks/log/decode-step.md, "Inside the one call op by op, and where the packed
  blocks live (2026-12-02)".
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import torch


def smaps_kb(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{os.getpid()}/smaps_rollup").read_text())
    return int(m.group(1)) if m else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a store directory holding experts blocks of one format")
    ap.add_argument("--top-k", type=int, required=True, help="experts per token (the model's num_experts_per_tok)")
    ap.add_argument("--rounds", type=int, default=6, help="passes over all blocks (each block once per arm per pass)")
    ap.add_argument("--drop-cache", action="store_true", help="drop the store files' cached pages first")
    ap.add_argument("--written", metavar="DIR", help="measure a copy of the store written into DIR (removed after)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    root = Path(args.store)
    if args.written:
        import shutil

        dst = Path(args.written)
        if dst.exists():
            raise SystemExit(f"--written {dst}: exists; give a directory this script may create and remove")
        shutil.copytree(root, dst)
        root = dst
    try:
        return measure(root, args)
    finally:
        if args.written:
            shutil.rmtree(root)


def measure(root: Path, args) -> int:
    from hi_na_moe import _native
    from hi_na_moe.core.store import PackedStore

    store = PackedStore(root)
    infos = [e for e in store.entries() if not e.name.endswith(".original")]
    if args.drop_cache:
        for e in infos:
            fd = os.open(store.path_for(e.key, e.name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    blocks = []  # (name, view, copy, entry)
    pmd0, huge0 = smaps_kb("FilePmdMapped"), smaps_kb("AnonHugePages")
    t_copy = 0.0
    for e in infos:
        entry = store.open(e.key, e.name)
        if "block" not in entry.meta:  # a dense layer's entry (meta "layer"): not an experts block
            entry.close()
            continue
        header = bytes.fromhex(entry.meta["header"])
        arr = entry.array("block", "uint8")
        view = _native.PackedExperts.view(header, arr)
        t = time.perf_counter()
        copy = _native.PackedExperts.copy(header, arr)
        t_copy += time.perf_counter() - t
        blocks.append((entry.meta["block"], view, copy, entry))
    if not blocks:
        raise SystemExit(f"no experts blocks under {root}")
    huge = smaps_kb("AnonHugePages") - huge0  # (before the probe's buffer)
    E, H = blocks[0][1].E, blocks[0][1].H
    total = sum(b[1].nbytes for b in blocks)
    print(f"{root}: {len(blocks)} experts blocks, {total / 1e9:.2f} GB; copied in {t_copy:.1f} s "
          f"({total / t_copy / 1e9:.2f} GB/s)")

    probe = _native.BandwidthProbe(1 << 30, args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=g).bfloat16()
    w = torch.full((1, args.top_k), 1.0 / args.top_k)
    out = torch.empty_like(x)
    arms = ("map", "copy")
    res = {a: [] for a in arms}  # (seconds, GB/s, share)
    with torch.inference_mode():
        # the mapping's pages touched once (a first read from disk is not what this measures)
        for _, view, _, _ in blocks:
            idx = torch.randperm(E, generator=g)[: args.top_k].reshape(1, -1)
            view.forward(x, idx, w, out)
        pmd = smaps_kb("FilePmdMapped") - pmd0
        for r in range(args.rounds + 1):
            for i, (_, view, copy, _) in enumerate(blocks):
                idx = torch.randperm(E, generator=g)[: args.top_k].reshape(1, -1)
                order = (view, copy) if (r + i) % 2 == 0 else (copy, view)
                for pe in order:
                    probe.read(256 << 20)
                    t = time.perf_counter()
                    pe.forward(x, idx, w, out)
                    dt = time.perf_counter() - t
                    bw = probe.read(256 << 20)
                    if r == 0:
                        continue  # a warm-up pass
                    gbs = pe.nbytes * args.top_k / E / dt / 1e9
                    res["map" if pe is view else "copy"].append((dt, gbs, gbs / bw))
    print(f"the mapping: {pmd / 1024:.0f} of {total / 2**20:.0f} MiB mapped with 2 MiB entries; "
          f"the copies: {huge / 1024:.0f} MiB on huge pages")
    print(f"{len(res['map'])} calls per arm, T=1, top_k {args.top_k} of {E}, {args.threads} threads")
    print("| arm | median µs | GB/s | paired share (median) |")
    print("|---|---|---|---|")
    med = {}
    for a in arms:
        dt = statistics.median(v[0] for v in res[a])
        gbs = statistics.median(v[1] for v in res[a])
        share = statistics.median(v[2] for v in res[a])
        med[a] = dt
        print(f"| {a} | {dt * 1e6:.0f} | {gbs:.1f} | {100 * share:.0f} % |")
    print(f"copy / map time: {med['copy'] / med['map']:.3f}")
    for _, _, _, entry in blocks:
        entry.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
