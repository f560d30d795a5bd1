"""The package's layers, read from its source with `ast` (nothing is imported):

    core < fastpath < integrate < serve < tools < the package root (hi_na_moe/__init__.py, __main__.py)

A module imports only from its own layer or lower ones; no import cycle among modules, counting
imports inside functions too; every import sits at module top unless a comment on it names a
measured import cost ("import cost") or an optional dependency ("optional")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hi_na_moe"
LAYERS = ("core", "fastpath", "integrate", "serve", "tools")
ROOT_RANK = len(LAYERS)  # __init__ and __main__: above every layer
EXCUSES = ("import cost", "optional")
EXTENSIONS = ("_native",)  # the compiled core: below every layer


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(("hi_na_moe",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def _sources(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _rank(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else ROOT_RANK


def _imports(name: str, path: Path, modules: set[str]):
    """(line, imported module of the package, at module top, the import's source lines) for every
    import of `path` that names a module of the package."""
    tree = ast.parse(path.read_text(), str(path))
    lines = path.read_text().splitlines()
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
              for n in ast.walk(f) if n is not f}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule sub; `from mod import name` the module mod
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
                       if a.name not in EXTENSIONS]
        else:
            continue
        text = "\n".join(lines[node.lineno - 2 if node.lineno > 1 else 0:node.end_lineno])
        yield node.lineno, targets, id(node) not in nested, text


def _graph(package: Path = PACKAGE):
    sources = _sources(package)
    edges: dict[str, set[str]] = {n: set() for n in sources}
    problems = []
    for name, path in sources.items():
        for line, targets, top, text in _imports(name, path, set(sources)):
            if not top and not any(e in text for e in EXCUSES):
                problems.append(f"{path.relative_to(package.parent)}:{line}: an import inside a function or class "
                                f"without a comment naming its import cost or an optional dependency: {text.strip()}")
            for t in targets:
                if t in sources and t != name:
                    edges[name].add(t)
    return sources, edges, problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer():
    stray = [n for n in _sources() if n.count(".") == 1 and n.split(".")[1] not in LAYERS + ("__main__",)
             and not n.split(".")[1].startswith("_")]
    assert not stray, f"modules outside core/, fastpath/, integrate/, tools/: {stray}"


def test_lower_layers_never_import_higher_ones():
    _, edges, _ = _graph()
    wrong = sorted(f"{a} (a {LAYERS[_rank(a)] if _rank(a) < ROOT_RANK else 'root'} module) imports {b}"
                   for a, bs in edges.items() for b in bs if _rank(b) > _rank(a))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    _, edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, f"modules importing each other (directly or around a loop): {cycles}"


def test_imports_at_module_top_unless_a_comment_says_why():
    _, _, problems = _graph()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", ["upward", "cycle", "inner"])
def test_the_checks_find_what_they_look_for(tmp_path, case):
    """The three checks on a small package laid out the same way, each with one fault."""
    pkg = tmp_path / "hi_na_moe"
    for layer in LAYERS:
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .tools import cli\n")
    (pkg / "tools" / "cli.py").write_text("from ..core import a\n")
    a = {"upward": "from ..integrate import b\n", "cycle": "from . import c\n",
         "inner": "def f():\n    from . import c\n"}[case]
    (pkg / "core" / "a.py").write_text(a)
    (pkg / "core" / "c.py").write_text("from . import a\n" if case == "cycle" else "")
    (pkg / "integrate" / "b.py").write_text("")
    _, edges, problems = _graph(pkg)
    upward = [(x, y) for x, ys in edges.items() for y in ys if _rank(y) > _rank(x)]
    assert bool(upward) == (case == "upward")
    assert bool(_cycles(edges)) == (case == "cycle")
    assert bool(problems) == (case == "inner")
    (pkg / "core" / "a.py").write_text("def f():\n    from . import c  # import cost: 1 s\n")
    assert not _graph(pkg)[2]
