"""What an arm reports about its process: resident memory from /proc, and percentiles of samples
computed the same way in every venv (bench_full_model.py's arms and bench_llamacpp.py, which runs
in the llama.cpp venv: standard library only)."""
from __future__ import annotations

STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def proc_status() -> dict:
    """VmRSS, RssAnon, RssFile, VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
