"""The one record schema of result files, and the writer the kept tools use.

A result file is a JSON object: the tool's own fields, as each tool always wrote them, plus
`records`, a list of flat records of one schema, one per timed arm (or per case a tool times
apart, such as each batch size):

    schema     "hina-bench-record/1"
    tool       the script that measured (its file name)
    commit     the checkout's HEAD (short hash; "+dirty" when tracked files differ from it)
    date       UTC, "YYYY-MM-DD HH:MM"
    cpu_model  /proc/cpuinfo's model name, then "(vendor family F model M)"
    threads    the threads the arm ran on
    arm        what was timed, in the tool's words ("hina-int4-all", "on", "llama.cpp", ...)
    samples    the timed samples, in `unit`
    unit       "ms" unless said otherwise
    median     the samples' median
    probe_gbs  the median of the read-bandwidth probe paired with the samples (None: unpaired)

and whatever a tool adds to place the arm (model, weights, batch, case, ...). results_summary.py
reads these records; files written before the schema are read by it through their own fields
(it names them).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

SCHEMA = "hina-bench-record/1"
REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    """HEAD of the checkout the benchmark runs from, "+dirty" when tracked files differ."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty else "")


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with vendor, family and model (a VM may hide the name)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block says it for all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "unknown"
    name = fields.get("model name", "unknown")
    return f"{name} ({fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def host() -> dict:
    """commit, date and cpu_model of this run, taken once and shared by its records."""
    return {"commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpu_model": cpu_model()}


def make(arm: str, samples, *, threads: int, probe_gbs=None, unit: str = "ms", tool: str = "", at: dict | None = None,
         **fields) -> dict:
    """One record. `samples` may be empty (median None); `probe_gbs` a number, a list of paired
    reads (their median is kept) or None; `at` the host() of the run (taken now when None)."""
    samples = [float(x) for x in samples]
    if isinstance(probe_gbs, (list, tuple)):
        probe_gbs = statistics.median(probe_gbs) if probe_gbs else None
    return {"schema": SCHEMA, "tool": tool, **(at or host()), "threads": int(threads), "arm": str(arm),
            "samples": [round(x, 4) for x in samples], "unit": unit,
            "median": statistics.median(samples) if samples else None,
            "probe_gbs": None if probe_gbs is None else float(probe_gbs), **fields}


def write(path, result: dict, records: list[dict]) -> None:
    """Write `result` (the tool's own fields) with its `records` to `path` as JSON."""
    bad = [r.get("arm") for r in records if r.get("schema") != SCHEMA]
    if bad:
        raise ValueError(f"records not made by lib.record.make: arms {bad}")
    Path(path).write_text(json.dumps({**result, "records": records}, indent=1) + "\n")


def read(path) -> list[dict]:
    """The schema records of a result file (an empty list for a file written before the schema)."""
    data = json.loads(Path(path).read_text())
    recs = data.get("records", []) if isinstance(data, dict) else []
    return [r for r in recs if isinstance(r, dict) and r.get("schema") == SCHEMA]
