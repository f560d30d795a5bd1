"""Resident memory around enable/disable: packing must not double the experts in RAM.

Builds a stack of OLMoE-1B-7B-shaped experts layers (bf16, 805 MB each), then reads RSS and the
peak RSS (VmHWM, reset through /proc/self/clear_refs) around `enable_for_model` and
`disable_for_model`, with the default (weights released while packed) and with keep_weights=True.
Also checks that outputs after disable are bit-identical to before enable.

    python benchmarks/bench_enable_memory.py --layers 4
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

from hi_na_moe.tools.workload import build_layers, make_inputs


def rss_gb() -> tuple[float, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 2**20, int(fields["VmHWM"].split()[0]) / 2**20


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", default="olmoe")
    args = ap.parse_args()

    import hi_na_moe

    torch.set_num_threads(2)
    cfg, layers = build_layers(args.shape, args.layers, torch.bfloat16)
    experts_gb = sum(p.numel() * p.element_size() for p in layers.parameters()) / 2**30
    x, idx, w = make_inputs(cfg, 5, torch.bfloat16, 0)
    with torch.inference_mode():
        want = [layer(x, idx, w) for layer in layers]
    print("| arm | experts GiB | RSS before | peak during enable | RSS enabled | peak during disable | RSS after | outputs after disable |")
    print("|---|---|---|---|---|---|---|---|")
    for keep in (False, True):
        gc.collect()
        before, _ = rss_gb()
        reset_peak()
        hi_na_moe.enable_for_model(layers, keep_weights=keep)
        enabled, peak_enable = rss_gb()
        with torch.inference_mode():
            for layer in layers:
                layer(x, idx, w)
        reset_peak()
        hi_na_moe.disable_for_model(layers)
        gc.collect()
        after, peak_disable = rss_gb()
        with torch.inference_mode():
            same = all(torch.equal(layer(x, idx, w), ref) for layer, ref in zip(layers, want))
        print(f"| keep_weights={keep} | {experts_gb:.2f} | {before:.2f} | {peak_enable:.2f} | {enabled:.2f} | "
              f"{peak_disable:.2f} | {after:.2f} | {'bit-identical' if same else 'DIFFERENT'} |")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
