"""Write benchmarks/RESULTS.md: the current headline figures per machine, read from the result
files, then the machines and an index of benchmarks/log/.

    python benchmarks/results_summary.py            # rewrite RESULTS.md
    python benchmarks/results_summary.py --check    # exit 1 if RESULTS.md is not what it would write

Takes well under a second and measures nothing. Every figure comes from a file in
benchmarks/results/; a file the headline names but cannot read is an error naming the file.

Which files hold the headline. Files in the record schema (lib/record.py: a `records` list with
commit, date, CPU model, threads, arm, samples, median and probe GB/s) are listed per machine as
they are written; the files written before that schema are read through their own fields, and
these are the ones the headline takes (HEADLINE below, per machine):
- AMD EPYC Zen 4, 2026-12-05: bench_interleaved.py --generate files (`interleaved_generate_*`,
  `interleaved_tf_*`): engines.<engine>.tok_s and probe_gbs, round_ratios; and
  bench_batch_decode.py's `batch_decode-*-vs-transformers` (batches.<B>.tok_s).
- AMD EPYC Zen 5, 2026-12-04, and Intel Xeon (AMX), 2026-12-02: bench_full_model.py files
  (`full_*`): results[].arm, results[].decode.tokens_per_s, results[].paired_probe.median_gbs,
  results[].prefill.ms; a pair is a hina arm and the rival arm of the same width after it in
  one file (the one before it when
  none follows), and a row is the median over the pairs of the files listed.
The machines' own names are not in those older files; HEADLINE names them, as their log sections do.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from lib import record

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LOG = HERE / "log"
OUT = HERE / "RESULTS.md"

MACHINES = {
    "zen4": ("AMD EPYC Zen 4", "CPUID family 25 model 17: AVX-512 with VNNI, BF16 and VBMI, no AMX; 2 cores, 2 MiB L2 "
             "a core, 32 MiB L3, 24 GiB; a host whose read bandwidth moves between a slow phase (~30 GB/s) and a "
             "fast one (~45-50 GB/s)"),
    "zen5": ("AMD EPYC Zen 5", "CPUID family 26: AVX-512 with VNNI, BF16, VBMI, VBMI2, VP2INTERSECT, no AMX; 2 cores, "
             "1 MiB L2 a core, 32 MiB L3, 24 GiB; read probe 40-60 GB/s"),
    "xeon2": ("Intel Xeon with AMX (480 MiB L3)", "CPUID family 6 model 167: AVX-512 with VNNI, BF16, FP16, VBMI, "
              "AMX bf16/int8; 2 cores, 2 MiB L2 a core, 480 MiB L3, 24 GiB; read probe 28-30 GB/s"),
    "xeon1": ("Intel Xeon with AMX (300 MB L3)", "AVX-512 F/BW/VL/VNNI/BF16/FP16, AMX tile/bf16/int8; 2 cores, "
              "300 MB L3, 24 GiB, one NUMA node; read probe 18-31 GB/s; the machine of the first measurements "
              "(2026-11-29 to 2026-11-30), no headline kept: its figures predate the one-call decode step"),
}

MODELS = {"olmoe": "OLMoE-1B-7B (16 layers)", "qwen4l": "Qwen1.5-MoE-A2.7B, 4 layers"}
WIDTH_ARMS = {"4-bit": ("hina-int4-all", "llamacpp-q4_0"), "8-bit": ("hina-int8-all", "llamacpp-q8_0"),
              "16-bit": ("hina-lossless12-all", "llamacpp-bf16")}


def load(name: str) -> dict:
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"results_summary: cannot read the headline's result file {path}: {e}")


def interleaved(name: str) -> dict:
    """bench_interleaved.py: ours and the rival's tok/s, the median of the rounds' ratios and their range."""
    d = load(name)
    ours = d["engines"]["hi_na_moe"]
    rival = next(v for k, v in d["engines"].items() if k != "hi_na_moe")
    rr = d["round_ratios"]
    return {"ours": ours["tok_s"], "rival": rival["tok_s"], "ratio": d["median_round_ratio"],
            "range": (min(rr), max(rr)), "probe": ours["probe_gbs"], "files": [name]}


def full_pairs(names: list[str], ours_arm: str, rival_arm: str, what: str = "decode") -> dict:
    """bench_full_model.py: each `ours_arm` result paired with the next `rival_arm` in its file (the
    one before it when none follows);
    medians over the pairs of tok/s (decode) or of the prefill time, and of the ratio."""
    ours, rival, ratios, probes = [], [], [], []
    for name in names:
        res = load(name)["results"]
        for i, r in enumerate(res):
            if r["arm"] != ours_arm or (r.get("phase") not in (None, "warm")):
                continue
            other = next((x for x in res[i + 1:] if x["arm"] == rival_arm), None) or next(
                (x for x in reversed(res[:i]) if x["arm"] == rival_arm), None)
            if other is None:
                continue
            if what == "decode":
                a, b = r["decode"]["tokens_per_s"], other["decode"]["tokens_per_s"]
                ratios.append(a / b)
            else:
                a, b = r["prefill"]["ms"], other["prefill"]["ms"]
                ratios.append(b / a)
            ours.append(a)
            rival.append(b)
            if r.get("paired_probe"):
                probes.append(r["paired_probe"]["median_gbs"])
    if not ratios:
        raise SystemExit(f"results_summary: no {ours_arm} / {rival_arm} pair in {names}")
    return {"ours": statistics.median(ours), "rival": statistics.median(rival), "ratio": statistics.median(ratios),
            "range": (min(ratios), max(ratios)), "probe": statistics.median(probes) if probes else None,
            "files": names, "pairs": len(ratios)}


def batch(name: str, b: int) -> dict:
    """bench_batch_decode.py: tok/s of both arms at batch `b` (B sequences a step)."""
    row = load(name)["batches"][str(b)]
    ours = next(v for k, v in row["tok_s"].items() if k.startswith("hi_na_moe"))
    rival = next(v for k, v in row["tok_s"].items() if not k.startswith("hi_na_moe"))
    probe = next(v for k, v in row["probe_gbs"].items() if k.startswith("hi_na_moe"))
    return {"ours": ours, "rival": rival, "ratio": ours / rival, "range": None, "probe": probe, "files": [name]}


Z4, Z5, X2 = "2026-12-05-aa45a1d", "2026-12-04-b7b5915", "2026-12-02-f944edb"
Z4_L5 = "2026-12-05-9c653c0"
HEADLINE = {
    "zen4": {
        "date": "2026-12-05",
        "how": "generate() of 128 tokens against llama-cpp-python's Llama.generate, the engines by turns in one "
               "process (bench_interleaved.py --generate); tok/s are the medians of all tokens; the ratio is the "
               "median of the rounds' ratios, with their range: low rounds are the host's slow phase, where both "
               "engines read at the bandwidth, high ones its fast phase",
        "rows": [
            ("olmoe", "int4 (g32) / llama.cpp Q4_0", lambda: interleaved(f"interleaved_generate_olmoe-int4g32-{Z4_L5}.json")),
            ("qwen4l", "int4 (g32) / llama.cpp Q4_0",
             lambda: interleaved(f"interleaved_generate_qwen4l-int4g32-{Z4_L5}-final.json")),
            ("olmoe", "int8 / llama.cpp Q8_0", lambda: interleaved(f"interleaved_generate_olmoe-int8-{Z4}.json")),
            ("qwen4l", "int8 / llama.cpp Q8_0", lambda: interleaved(f"interleaved_generate_qwen4l-int8-{Z4}-b.json")),
            ("qwen4l", "lossless12 / llama.cpp BF16",
             lambda: interleaved(f"interleaved_generate_qwen4l-lossless12-{Z4}.json")),
            ("qwen4l", "lossless12 / transformers bf16 (decode steps)",
             lambda: interleaved(f"interleaved_tf_qwen4l-lossless12-{Z4}.json")),
            ("qwen4l", "int4, 4 sequences a step / transformers bf16",
             lambda: batch("batch_decode-qwen1.5-moe-a2.7b-4l-int4-2026-12-05-94e9811-vs-transformers.json", 4)),
            ("qwen4l", "int4, 16 sequences a step / transformers bf16",
             lambda: batch("batch_decode-qwen1.5-moe-a2.7b-4l-int4-2026-12-05-94e9811-vs-transformers.json", 16)),
        ],
    },
    "zen5": {
        "date": "2026-12-04",
        "how": "bench_full_model.py, each arm a process of its own, run in turns; the median over the runs' pairs "
               "(the range in brackets); decode 128 tokens after a 16-token prompt",
        "rows": [
            ("olmoe", "int4 / llama.cpp Q4_0", lambda: full_pairs([f"full_olmoe-{Z5}-C{i}.json" for i in (1, 2, 3)],
                                                                   *WIDTH_ARMS["4-bit"])),
            ("olmoe", "int8 / llama.cpp Q8_0", lambda: full_pairs([f"full_olmoe-{Z5}-C{i}.json" for i in (1, 2, 3)],
                                                                   *WIDTH_ARMS["8-bit"])),
            ("olmoe", "lossless12 / llama.cpp BF16",
             lambda: full_pairs([f"full_olmoe-{Z5}-C{i}.json" for i in (1, 2, 3)], *WIDTH_ARMS["16-bit"])),
            ("olmoe", "lossless12 / transformers bf16",
             lambda: full_pairs([f"full_olmoe-{Z5}-D{i}.json" for i in (1, 2)], "hina-lossless12-all", "transformers")),
            ("olmoe", "prefill-512, int4 / llama.cpp Q4_0",
             lambda: full_pairs([f"full_olmoe-{Z5}-C{i}.json" for i in (1, 2, 3)], *WIDTH_ARMS["4-bit"], "prefill")),
        ],
    },
    "xeon2": {
        "date": "2026-12-02",
        "how": "bench_full_model.py, each arm a process of its own, in turns (run B of that day); decode 128 tokens "
               "after a 16-token prompt",
        "rows": [
            ("olmoe", "int4 / llama.cpp Q4_0", lambda: full_pairs([f"full_olmoe-{X2}-B.json"], *WIDTH_ARMS["4-bit"])),
            ("qwen4l", "int4 / llama.cpp Q4_0", lambda: full_pairs([f"full_qwen4l-{X2}-B.json"], *WIDTH_ARMS["4-bit"])),
            ("olmoe", "lossless12 / llama.cpp BF16",
             lambda: full_pairs([f"full_olmoe-{X2}-B.json"], *WIDTH_ARMS["16-bit"])),
            ("olmoe", "lossless12 / transformers bf16",
             lambda: full_pairs([f"full_olmoe-{X2}-B.json"], "hina-lossless12-all", "transformers")),
            ("olmoe", "prefill-512, int4 / llama.cpp Q4_0",
             lambda: full_pairs([f"full_olmoe-{X2}-B.json"], *WIDTH_ARMS["4-bit"], "prefill")),
        ],
    },
}


def headline_rows(key: str) -> list[tuple[str, str, dict]]:
    rows = []
    for model, what, get in HEADLINE[key]["rows"]:
        r = get()
        rows.append((model, what, r))
    return rows


def fmt(x, unit="") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def headline_table(key: str) -> tuple[list[str], list[str]]:
    """The machine's table, and the commits that recorded its files (from the files' names)."""
    out = ["| model | ours / rival | ours | rival | ratio (range) | paired probe GB/s | result files |",
           "|---|---|---|---|---|---|---|"]
    commits: list[str] = []
    for model, what, r in headline_rows(key):
        for f in r["files"]:
            m = re.search(r"\d{4}-\d{2}-\d{2}-([0-9a-f]{7})", f)
            if m and m.group(1) not in commits:
                commits.append(m.group(1))
        prefill = what.startswith("prefill")
        unit = " s" if prefill else " tok/s"
        ours, rival = (r["ours"] / 1e3, r["rival"] / 1e3) if prefill else (r["ours"], r["rival"])
        rng = f" ({r['range'][0]:.2f}-{r['range'][1]:.2f})" if r.get("range") else ""
        files = ", ".join(f"`{f}`" for f in r["files"])
        out.append(f"| {MODELS[model]} | {what} | {fmt(ours, unit)} | {fmt(rival, unit)} | "
                   f"**{r['ratio']:.2f}x**{rng} | {fmt(r['probe'])} | {files} |")
    return out, commits


def schema_records() -> list[dict]:
    """Every record of the schema in the result files, newest first."""
    recs = []
    for f in sorted(RESULTS.glob("*.json")):
        try:
            recs += [dict(r, file=f.name) for r in record.read(f)]
        except ValueError as e:
            raise SystemExit(f"results_summary: {f} is not JSON: {e}")
    return sorted(recs, key=lambda r: r["date"], reverse=True)


INDEX_NEWEST = 3  # sections of each log file the index names
NEWEST_RECORDS = 10  # rows of the newest result-file records (RESULTS.md has a line budget: tests/test_docs.py)


def log_index() -> list[str]:
    out = []
    for f in sorted(LOG.glob("*.md")):
        lines = f.read_text().split("\n")
        # no blank line under the heading: RESULTS.md has a line budget (tests/test_docs.py) and the
        # index grows a line with every log section
        out.append(f"### [{lines[0].lstrip('# ').strip()}](log/{f.name})")
        sections = []
        for i, line in enumerate(lines):
            if line.startswith("## "):
                run = lines[i + 2] if i + 2 < len(lines) else ""
                m = re.match(r"\*(\S+) · recorded in (\w+) · ([^,(;]+)", run)
                where = f"{m.group(1)}, {m.group(3).strip()}" if m else "?"
                sections.append(f"- {where}: {line[3:]}")
        # a topic's newest sections (a file grows at its end): the index stays within the line budget
        if len(sections) > INDEX_NEWEST:
            out.append(f"- {len(sections) - INDEX_NEWEST} earlier section(s) in the file, then:")
        out += sections[-INDEX_NEWEST:] + [""]
    return out


def render() -> str:
    out = ["# Benchmark results", "",
           "Written by `python benchmarks/results_summary.py` from the result files in benchmarks/results/ (do not",
           "edit by hand). First where things stand on each machine, newest first; then the machines; then the index",
           "of the log (benchmarks/log/), where every measurement since 2026-11-29 is kept with its date, commit,",
           "machine and commands. How to read the figures, the method and the host's bandwidth phases:",
           "[docs/performance.md](../docs/performance.md). The tools: [README.md](README.md).", "",
           "## Where things stand", ""]
    for key in HEADLINE:
        h = HEADLINE[key]
        table, commits = headline_table(key)
        out += [f"### {MACHINES[key][0]}: {h['date']} (result files recorded in {', '.join(commits)})", "",
                f"{h['how']}.", ""] + table + [""]
    recs = schema_records()
    if recs:
        out += ["### Newest records in the result-file schema", "",
                "| date | commit | CPU | tool | arm | threads | median | probe GB/s | file |", "|---|---|---|---|---|---|---|---|---|"]
        for r in recs[:NEWEST_RECORDS]:
            out.append(f"| {r['date']} | {r['commit']} | {r['cpu_model']} | {r['tool']} | {r['arm']} | {r['threads']} | "
                       f"{fmt(r['median'])} {r['unit']} | {fmt(r['probe_gbs'])} | `{r['file']}` |")
        out.append("")
    else:
        out += ["No result file holds records of the schema (benchmarks/lib/record.py) yet.", ""]
    out += ["", "## Machines", ""]
    out += [f"- **{name}**: {desc}." for name, desc in MACHINES.values()]
    out += ["", "## The log, by topic", ""] + log_index()
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md differs from what would be written")
    args = ap.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("benchmarks/RESULTS.md is stale: run python benchmarks/results_summary.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
