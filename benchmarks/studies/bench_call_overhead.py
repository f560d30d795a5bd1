"""What one T=1 call of an enabled experts module costs outside the kernels, hot and cold.

A tiny Qwen3-MoE experts block (H64 I32 E8 top-2, bf16: the kernels' own work is ~1 us) is
enabled with the native backend and called as transformers calls it, and a 256x256 bf16
Linear under scope="all" is called next to the same layer in PyTorch; "cold" calls follow a
64 MB read of a bandwidth-probe buffer, which evicts the caches the way a decode step's weight
stream does between two MoE layers. Also timed, the same way: torch.empty_like, a bf16 -> fp32
conversion (each one torch op), torch_ops._run (the direct kernel call), and a no-op.

    chrt -f 1 python benchmarks/studies/bench_call_overhead.py [--calls 300]

Prints the median of --calls calls per row.

Question: What does one T=1 call of an enabled experts module cost outside the kernels, hot and
  cold?
Answered in benchmarks/log/experts-op.md, "Decode call overhead, huge pages, and the six shapes
  again (2026-11-30)".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    import hi_na_moe
    from hi_na_moe import _native
    from hi_na_moe.core import torch_ops

    torch.set_num_threads(2)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    ex = modeling_qwen3_moe.Qwen3MoeExperts(cfg).to(torch.bfloat16).eval()
    hi_na_moe.enable_for_model(torch.nn.ModuleList([ex]), backend="native", threads=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g).bfloat16()
    idx = torch.tensor([[1, 5]])
    w = torch.tensor([[0.6, 0.4]]).bfloat16()
    wf = w.float()
    probe = _native.BandwidthProbe(1 << 30, 2)
    handle = next(iter(torch_ops._PACKED))
    inf = float("inf")

    def median_us(f, cold: bool) -> float:
        s = []
        for _ in range(args.calls):
            if cold:
                probe.read(64 << 20)
            t = time.perf_counter()
            f()
            s.append(time.perf_counter() - t)
        return statistics.median(s) * 1e6

    # a dense layer under scope="all" (hi_na_moe.fastpath.linear), and the same layer in PyTorch
    lin = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).bfloat16().eval()
    plain = torch.nn.Linear(256, 256, bias=False).bfloat16().eval()
    hi_na_moe.enable_for_model(lin, scope="all", threads=2)
    xl = torch.randn(1, 1, 256, generator=g).bfloat16()
    rows = {
        "enabled experts module, T=1": lambda: ex(x, idx, w),
        "Linear 256x256 under scope='all', T=1": lambda: lin[0](xl),
        "the same Linear in PyTorch": lambda: plain(xl),
        "torch_ops._run (direct kernel call)": lambda: torch_ops._run(x, idx, wf, handle, "silu", 1.702, inf, inf, inf,
                                                                      0.0, False, 1),
        "torch.empty_like": lambda: torch.empty_like(x),
        "bf16 -> fp32 (w.float())": lambda: w.float(),
        "no-op lambda": lambda: None,
    }
    print("| call | hot µs | cold µs |")
    print("|---|---|---|")
    with torch.inference_mode():
        for name, f in rows.items():
            print(f"| {name} | {median_us(f, False):.1f} | {median_us(f, True):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
