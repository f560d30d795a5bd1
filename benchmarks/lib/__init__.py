"""Helpers the benchmark scripts share (imported as `from lib import ...`).

A kept tool in benchmarks/ finds this package on its own folder's path; a study in
benchmarks/studies/ puts benchmarks/ on sys.path first. Nothing here imports torch or hi_na_moe
at import time, so bench_llamacpp.py (run in the llama.cpp venv) can use it too.

- `stored`: the scope="all" model the step and batch benchmarks load from a packed store.
- `steps`: decode steps of two arms alternating in one process, each after a paired read.
- `record`: the one record schema for result files (commit, date, CPU, threads, arm, samples,
  median, probe GB/s) and the writer the kept tools use.
- `procstat`: resident memory from /proc and percentiles, as the arms report them.
- `synth`: synthetic bf16 weights for the op-level benchmarks.
- `rivals`: busy processes competing for the cores (--compete N).
- `ab_switch`: the small-module patches switched on and off (--ab-norms, ...).
"""
