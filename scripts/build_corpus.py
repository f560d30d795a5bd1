#!/usr/bin/env python3
"""Build the English text corpus for hina-tiny-moe from CPython's own standard library.

The corpus needs nothing beyond a CPython 3.11 installation (no network, no model hub):

* every docstring (module, class, function, async function) found by parsing -- never importing --
  the ``.py`` files of the standard library directory (``sysconfig.get_paths()["stdlib"]``),
  walked in sorted order, skipping ``site-packages``/``dist-packages``/``__pycache__``;
* the help topics of ``pydoc_data.topics`` (the text behind ``help("assignment")`` etc.,
  generated from the Python reference documentation), in sorted topic order.

Docstrings are taken with ``ast.get_docstring(clean=True)``; documents shorter than
``MIN_CHARS`` characters are dropped and exact duplicates are kept only at their first
occurrence (in the fixed order above). Parsing instead of importing means no module side
effects (``antigravity``, ``this``, GUI toolkits) and a result that does not depend on which
optional C extensions happen to be built.

Split: a whole source file (or a whole pydoc topic) goes to the held-out split when
``int(sha256(key)[:8], 16) % HELDOUT_MODULUS == 0``, where ``key`` is the file's path relative
to the stdlib directory with ``/`` separators (or ``pydoc_data/topics.py::<topic>``).
Splitting by file keeps near-duplicate docstrings of one module on one side.

Licence: Python software and documentation are licensed under the PSF License Agreement
(PSF-2.0); see ``LICENSE.txt`` in the stdlib directory.

Document stream format (used for training and for ``data/heldout.txt``): each document is
preceded by the special token ``<|endoftext|>``, with nothing else added:
``<|endoftext|>doc1<|endoftext|>doc2...``.

Run as a script to (re)write ``data/heldout.txt`` and ``data/corpus_manifest.json``.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

EOS = "<|endoftext|>"
MIN_CHARS = 24
HELDOUT_MODULUS = 16
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Doc:
    key: str  # split key: relative file path or pydoc topic key
    where: str  # key plus qualified name, for the manifest/debugging
    text: str


def _sha_int(key: str) -> int:
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16)


def is_heldout(key: str) -> bool:
    return _sha_int(key) % HELDOUT_MODULUS == 0


def _docstrings(tree: ast.AST, prefix: str = ""):
    """Yield (qualname, docstring) in source order (depth first)."""
    if isinstance(tree, DOC_NODES):
        doc = ast.get_docstring(tree, clean=True)
        if doc:
            yield prefix or "<module>", doc
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(child, f"{prefix}.{child.name}" if prefix else child.name)
        elif not isinstance(child, DOC_NODES):
            # docstrings of defs nested in if/try/with blocks at any depth
            yield from _docstrings(child, prefix)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def iter_source_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def extract_documents() -> tuple[list[Doc], dict]:
    root = stdlib_dir()
    docs: list[Doc] = []
    seen: set[str] = set()
    stats = {"files_parsed": 0, "files_unparseable": 0, "docstrings_found": 0,
             "dropped_short": 0, "dropped_duplicate": 0}

    def add(key: str, where: str, text: str) -> None:
        text = text.strip()
        stats["docstrings_found"] += 1
        if len(text) < MIN_CHARS:
            stats["dropped_short"] += 1
            return
        if EOS in text:  # cannot happen in the stdlib, but keep the stream format unambiguous
            text = text.replace(EOS, "")
        if text in seen:
            stats["dropped_duplicate"] += 1
            return
        seen.add(text)
        docs.append(Doc(key, where, text))

    for path in iter_source_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_bytes(), filename=rel)
        except (SyntaxError, ValueError):  # e.g. lib2to3 test data written in Python 2
            stats["files_unparseable"] += 1
            continue
        stats["files_parsed"] += 1
        for qualname, doc in _docstrings(tree):
            add(rel, f"{rel}::{qualname}", doc)

    from pydoc_data.topics import topics  # part of the stdlib

    for name in sorted(topics):
        key = f"pydoc_data/topics.py::{name}"
        add(key, key, topics[name])
    return docs, stats


def stream_text(docs: list[Doc]) -> str:
    return "".join(EOS + d.text for d in docs)


def build(write: bool = True) -> dict:
    """Extract and split the corpus. Returns a dict with train/heldout docs and the manifest."""
    docs, stats = extract_documents()
    train = [d for d in docs if not is_heldout(d.key)]
    heldout = [d for d in docs if is_heldout(d.key)]
    train_text, heldout_text = stream_text(train), stream_text(heldout)
    manifest = {
        "name": "python-stdlib-docstrings",
        "description": "Docstrings of CPython's standard library (parsed with ast, not imported) "
                       "plus pydoc_data.topics help texts; see scripts/build_corpus.py.",
        "licence": "PSF-2.0 (Python Software Foundation License Agreement; Python software and "
                   "documentation). See LICENSE.txt in the stdlib directory.",
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "python_implementation": sys.implementation.name,
        "stdlib_dir_note": "sysconfig.get_paths()['stdlib']; site-packages, dist-packages, "
                           "__pycache__ skipped",
        "min_chars": MIN_CHARS,
        "split_rule": f"whole file/topic held out iff int(sha256(key)[:8],16) % {HELDOUT_MODULUS} == 0",
        "stream_format": f"'{EOS}' before every document, nothing else added",
        **stats,
        "documents": len(docs),
        "train_documents": len(train),
        "heldout_documents": len(heldout),
        "train_files": len({d.key for d in train}),
        "heldout_files": sorted({d.key for d in heldout}),
        "train_chars": len(train_text),
        "heldout_chars": len(heldout_text),
        "train_sha256": hashlib.sha256(train_text.encode("utf-8")).hexdigest(),
        "heldout_sha256": hashlib.sha256(heldout_text.encode("utf-8")).hexdigest(),
    }
    if write:
        data = REPO / "data"
        data.mkdir(exist_ok=True)
        (data / "heldout.txt").write_text(heldout_text, encoding="utf-8")
        (data / "corpus_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n",
                                                    encoding="utf-8")
    return {"train": train, "heldout": heldout, "train_text": train_text,
            "heldout_text": heldout_text, "manifest": manifest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="only print the summary")
    args = ap.parse_args()
    out = build(write=not args.no_write)
    m = dict(out["manifest"])
    m["heldout_files"] = len(m["heldout_files"])
    print(json.dumps(m, indent=2))


if __name__ == "__main__":
    main()
