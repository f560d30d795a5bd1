"""The docs stay a reference: their links and file paths resolve, their lengths stay within the
bounds README, RESULTS.md and design.md promise, no numbered work period is cited (dates and
commits are), and benchmarks/RESULTS.md is what its generator writes from the result files.
Reads text files only (no model, no native code): well under a second."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
NO_WORK_PERIODS = [*REFERENCE, ROOT / "benchmarks" / "LLAMACPP.md", *sorted((ROOT / "benchmarks" / "log").glob("*.md"))]
LIMITS = {"README.md": 200, "benchmarks/RESULTS.md": 150, "docs/design.md": 400}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.-])((?:src|tests|csrc|docs|benchmarks|scripts|models|data)/[\w./-]*[\w/])")
SCRIPT = re.compile(r"(?<![\w/.-])((?:bench|study|ab|make|quality|weight|results)_[a-z0-9_]+\.py)\b")
WORK_PERIOD = re.compile(r"\bsessions? ?[-#]?\d+|\bsession-\d+|\bs\d+[-_]\d|[-_]s\d+\.json", re.IGNORECASE)


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def broken_links(path: Path) -> list[str]:
    """Relative markdown links of `path` whose file or folder does not exist (anchors ignored)."""
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            out.append(target)
    return out


def missing_paths(path: Path) -> list[str]:
    """Repository paths and benchmark script names `path` cites that do not exist (templates
    with <...>, {...} or * are not paths)."""
    text = path.read_text()
    out = [p for p in PATH.findall(text) if not re.search(r"[<>{}*]", p) and not (ROOT / p.rstrip(".")).exists()]
    bench = ROOT / "benchmarks"
    out += [s for s in SCRIPT.findall(text)
            if not any((d / s).exists() for d in (bench, bench / "studies", bench / "lib"))]
    return out


@pytest.mark.parametrize("path", REFERENCE, ids=rel)
def test_links_and_paths_resolve(path):
    assert path.is_file(), f"{rel(path)} is missing"
    assert broken_links(path) == [], f"{rel(path)}: links to nothing"
    assert missing_paths(path) == [], f"{rel(path)}: cites paths that do not exist"


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_length_limits(name):
    n = len((ROOT / name).read_text().splitlines())
    assert n <= LIMITS[name], f"{name} has {n} lines, over its {LIMITS[name]}: move detail to docs/ or benchmarks/log/"


@pytest.mark.parametrize("path", NO_WORK_PERIODS, ids=rel)
def test_no_numbered_work_periods(path):
    hits = [m.group(0) for m in WORK_PERIOD.finditer(path.read_text())]
    assert hits == [], f"{rel(path)} cites numbered work periods {hits[:5]}: cite the date and commit instead"


def test_results_md_is_generated():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_summary.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_checks_catch_what_they_look_for(tmp_path):
    """The checks above fail on a document that breaks them."""
    doc = tmp_path / "doc.md"
    doc.write_text("[gone](no_such_file.md) and src/hi_na_moe/no_such_module.py, benchmarks/bench_nothing.py, "
                   "bench_nope.py; measured in " + "session" + " 12.\n")  # split: a grep of the project for the pattern finds none
    assert broken_links(doc) == ["no_such_file.md"]
    assert set(missing_paths(doc)) == {"src/hi_na_moe/no_such_module.py", "benchmarks/bench_nothing.py",
                                       "bench_nope.py"}
    assert WORK_PERIOD.search(doc.read_text())
