"""The model the step and batch benchmarks time: a checkpoint loaded from its packed store with
scope="all" (every linear layer on the native kernels, lm_head quantised too: dense_lossless="",
as llama.cpp's pure Q8_0 / Q4_0 files are), bf16, in eval mode. One place for the arguments and
the load, shared by bench_generate, bench_step_ab, bench_prefill_pool, bench_batch_decode,
bench_interleaved, study_step_python, study_kernel_rates, study_gomp_spin and bench_mla_parts."""
from __future__ import annotations

import argparse

WEIGHTS = ("lossless", "lossless12", "int8", "int4")


def add_args(ap: argparse.ArgumentParser, cache_help: str = "the store of --weights") -> None:
    """--ckpt, --weights (default int4) and --cache-dir, all a stored model needs."""
    ap.add_argument("--ckpt", required=True, help="the checkpoint (save_pretrained directory)")
    ap.add_argument("--weights", default="int4", choices=WEIGHTS)
    ap.add_argument("--cache-dir", required=True, help=cache_help)


def load(ckpt: str, weights: str, cache_dir: str, **config):
    """hi_na_moe.from_pretrained of `ckpt` at `weights` from the store in `cache_dir`, scope="all"
    with lm_head quantised; `config` adds or overrides configuration keys (pool=..., ...)."""
    import torch

    import hi_na_moe

    cfg = hi_na_moe.load_config(**{"cache_dir": cache_dir, "scope": "all", "dense_lossless": "", **config})
    return hi_na_moe.from_pretrained(ckpt, weights=weights, dtype=torch.bfloat16, progress=False,
                                     config=cfg).eval()
