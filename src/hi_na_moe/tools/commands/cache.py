"""`hi-na-moe cache list` / `cache clear`: the packed-expert store's entries."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from ...core.config import (
    load_config,
)
from ...core.native import native_module
from ...core.store import _KEY_RE, PackedStore, _human
from .common import UserError


def _cache_store(cache_dir: str | None):
    """The store `cache list/clear` work on, or None when the default store does not exist yet.
    Never creates the directory: looking must not leave one behind, and a mistyped --cache-dir
    must be an error rather than an empty store."""
    if cache_dir:
        root = Path(cache_dir).expanduser()
        if not root.exists():
            raise UserError(f"--cache-dir {cache_dir!r} does not exist",
                            "pass the directory the store is in (the config's cache_dir, HINA_MOE_CACHE_DIR); "
                            "without --cache-dir the configured one is used")
    else:
        root = load_config().store_root()  # what enable_for_model would use: config file and env
        if not root.exists():
            return None
    if not root.is_dir():
        raise UserError(f"the store directory {str(root)!r} is not a directory",
                        "pass the packed-expert store's directory with --cache-dir")
    try:
        os.listdir(root)
    except OSError as exc:
        raise UserError(f"cannot read the store directory {str(root)!r}: {exc.strerror or exc}") from None
    return PackedStore(root)


def _n(count: int, word: str) -> str:
    """'1 entry', '2 entries', '1 file', '3 files'."""
    if count == 1:
        return f"1 {word}"
    return f"{count} {word[:-1]}ies" if word[-1] == "y" and word[-2] not in "aeiou" else f"{count} {word}s"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _values(vals: list, empty: str = "?") -> str:
    return ",".join(str(v) for v in vals) if vals else empty


def cache_report(store, verify: str = "header") -> dict:
    """What `hi-na-moe cache list` shows, as one JSON-serialisable dict: per key directory what
    its readable entries record (format, tier, layout version, group size, dtype, kind, entry
    names; the key itself is a one-way digest of the weights and these parameters), counts,
    bytes, last change and each unreadable file with the reason; then totals."""
    keys = []
    for ks in store.summary(verify):
        d = ks.describe()
        keys.append({
            "key": ks.key, "path": str(ks.path), **d,
            "entries": len(ks.entries), "unreadable": len(ks.unreadable),
            "size_bytes": ks.size_bytes, "size": _human(ks.size_bytes),
            "modified": None if ks.mtime is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ks.mtime)),
            "modified_epoch": ks.mtime, "problem": ks.problem,
            "files": [{"file": f.file, "kind": f.kind, "name": f.name, "status": f.status or None,
                       "reason": f.reason, "size_bytes": f.size,
                       "meta": None if f.meta is None else {k: v for k, v in f.meta.items() if k != "header"}}
                      for f in ks.files],
        })
    # related keys together: by what they hold (layer order), then format and tier; the key
    # digests themselves order nothing
    keys.sort(key=lambda k: ([str(v) for v in k["source"]], _natural(k["names"][0]) if k["names"] else [(2, "")],
                             [str(v) for v in k["format"]], [str(v) for v in k["tier"]], k["key"]))
    by_source: dict[str, dict] = {}  # which model the keys belong to, as far as the entries record it
    for k in keys:
        for src in k["source"] or ([NO_SOURCE] if k["entries"] > k["unreadable"] else []):
            slot = by_source.setdefault(src, {"keys": 0, "size_bytes": 0, "formats": set(), "tiers": set()})
            slot["keys"] += 1
            slot["size_bytes"] += k["size_bytes"]
            slot["formats"].update(str(v) for v in k["format"])
            slot["tiers"].update(str(v) for v in k["tier"])
    by_format: dict[str, dict] = {}  # what `cache clear --format F` would free, roughly
    for k in keys:
        fmt = ",".join(str(v) for v in k["format"]) or ("unreadable" if k["entries"] else "empty")
        slot = by_format.setdefault(fmt, {"keys": 0, "size_bytes": 0})
        slot["keys"] += 1
        slot["size_bytes"] += k["size_bytes"]
    foreign = sorted(n for n in os.listdir(store.root) if not _KEY_RE.match(n))
    layout = _current_layout()
    old = [k for k in keys if layout is not None and any(isinstance(v, int) and v != layout for v in k["layout_version"])]
    files = [f for k in keys for f in k["files"]]
    tmp = [f for f in files if f["kind"] == "tmp"]
    total = sum(k["size_bytes"] for k in keys)
    return {
        "root": str(store.root), "verify": verify, "keys": keys,
        "total": {"keys": len(keys), "entries": sum(k["entries"] for k in keys),
                  "unreadable": sum(k["unreadable"] for k in keys), "size_bytes": total, "size": _human(total),
                  "tmp_files": len(tmp), "tmp_bytes": sum(f["size_bytes"] for f in tmp),
                  "tmp_in_use": sum(f["status"] == "in use" for f in tmp),
                  "other_files": sum(f["kind"] == "other" for f in files), "other_in_root": foreign,
                  "by_format": dict(sorted(by_format.items())),
                  # entries of another packed layout version than this build's (None: unknown here)
                  "layout_version": layout, "old_layout": {"keys": len(old),
                                                           "size_bytes": sum(k["size_bytes"] for k in old)},
                  "by_source": {src: {**v, "formats": sorted(v["formats"]), "tiers": sorted(v["tiers"]),
                                      "size": _human(v["size_bytes"])} for src, v in sorted(by_source.items())}},
    }


# what `cache list` says of entries written before the store recorded their source
NO_SOURCE = "(not recorded: written before hi_na_moe kept it)"


def _natural(text: str) -> list[tuple[int, object]]:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", text) if t]


def _names(names: list[str], width: int = 60) -> str:
    if not names:
        return "-"
    text = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_cache_report(rep: dict) -> None:
    print(f"packed-expert store: {rep['root']}")
    if not rep["keys"]:
        print("  empty: no key directory")
    else:
        head = ("KEY", "KIND", "FORMAT", "GROUP", "TIER", "LAYOUT", "DTYPE", "ENTRIES", "SIZE", "MODIFIED", "HOLDS")
        rows = []
        for k in rep["keys"]:
            entries = str(k["entries"]) + (f" ({k['unreadable']} bad)" if k["unreadable"] else "")
            groups = [g for g in k["group_size"] if g]  # 0: not grouped (every format but int4)
            unknown = "?" if k["entries"] else "-"  # "?": no entry here could be read
            rows.append((k["key"][:12], _values(k["kind"], unknown), _values(k["format"], unknown),
                         _values(groups, "-"), _values(k["tier"], unknown), _values(k["layout_version"], unknown),
                         _values(k["dtype"], unknown), entries,
                         k["size"], _when(k["modified_epoch"]), _names(k["names"])))
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        print("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        for k, row in zip(rep["keys"], rows):
            print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if k["problem"]:
                print(f"      ! the directory: {k['problem']}")
            for f in k["files"]:
                if f["kind"] == "entry" and f["status"] != "ok":
                    print(f"      ! {f['status']} entry {f['file']} ({_human(f['size_bytes'])}): {f['reason']}")
                elif f["kind"] == "tmp":
                    state = ("being written (" + f["reason"] + ")" if f["status"] == "in use"
                             else "left by an interrupted write")
                    print(f"      ! temp file {f['file']} ({_human(f['size_bytes'])}): {state}")
                elif f["kind"] == "other":
                    print(f"      ! {f['file']}: not a store file, left alone")
    t = rep["total"]
    line = f"total: {_n(t['keys'], 'key')}, {_n(t['entries'], 'entry')}, {t['size']}"
    if t["unreadable"]:
        line += f"; {t['unreadable']} unreadable (corrupt, stale or unsafe)"
    if t["tmp_files"]:
        line += f"; {_n(t['tmp_files'], 'temp file')} ({_human(t['tmp_bytes'])})"
        if t["tmp_in_use"]:
            line += f", {t['tmp_in_use']} of a write in progress"
    print(line)
    if t["by_source"]:
        print("  by source (the checkpoint or model the entries were built from):")
        for src, v in t["by_source"].items():
            print(f"    {src}: {_n(v['keys'], 'key')}, {v['size']} ({', '.join(v['formats']) or '?'}; "
                  f"tier {', '.join(v['tiers']) or '?'})")
    if len(t["by_format"]) > 1:
        print("  by format: " + ", ".join(f"{fmt} {_human(v['size_bytes'])} ({_n(v['keys'], 'key')})"
                                          for fmt, v in t["by_format"].items()))
    if t["unreadable"] or t["tmp_files"] - t["tmp_in_use"]:
        print("  `hi-na-moe cache clear --stale` removes the unreadable entries and leftover temp files")
    if t["old_layout"]["keys"]:
        print(f"  {_n(t['old_layout']['keys'], 'key')} ({_human(t['old_layout']['size_bytes'])}) hold entries of another "
              f"packed layout than this build's ({t['layout_version']}), never read again: "
              "`hi-na-moe cache clear --old-layout` removes them")
    other = ([_n(t["other_files"], "file") + " in key directories"] if t["other_files"] else []) + \
        ([f"{_n(len(t['other_in_root']), 'name')} beside them ({_names(t['other_in_root'])})"]
         if t["other_in_root"] else [])
    if other:
        print(f"  not the store's, never touched: {'; '.join(other)}")
    if rep["verify"] == "header":
        print("  entries checked by their headers; --verify reads every byte (checksums)")


def cmd_cache_list(args) -> int:
    store = _cache_store(args.cache_dir)
    if store is None:
        root = str(load_config().store_root())
        if args.output == "json":
            print(json.dumps({"root": root, "exists": False, "keys": [], "total": {"keys": 0, "entries": 0,
                                                                                   "size_bytes": 0}}, indent=2))
        else:
            print(f"packed-expert store: {root} does not exist yet: nothing is cached")
        return 0
    rep = cache_report(store, "full" if args.verify else "header")
    if args.output == "json":
        print(json.dumps({**rep, "exists": True}, indent=2))
    else:
        _print_cache_report(rep)
    return 0


CLEAR_FILTERS = "--key KEY, --source S, --format F, --tier T, --old-layout, --stale, or --all"


def resolve_key(summaries, prefix: str) -> str:
    """The one key directory whose name starts with `prefix` (a full key or its first digits,
    as `cache list` shows them); UserError when none or several match."""
    want = prefix.strip().lower()
    if not want or any(c not in "0123456789abcdef" for c in want):
        raise UserError(f"--key {prefix!r} is not a key: keys are hexadecimal digests",
                        "copy one from the KEY column of `hi-na-moe cache list`")
    found = [s.key for s in summaries if s.key.startswith(want)]
    if not found:
        raise UserError(f"--key {prefix!r} matches no key directory in the store "
                        f"({len(summaries)} keys there)", "`hi-na-moe cache list` shows the keys")
    if len(found) > 1:
        shown = ", ".join(k[:16] for k in found[:5]) + (", ..." if len(found) > 5 else "")
        raise UserError(f"--key {prefix!r} matches {len(found)} keys: {shown}",
                        "give more of the key's digits")
    return found[0]


def _same_source(recorded, wanted: str) -> bool:
    """Whether an entry's recorded source is `wanted` (as given, or as an absolute path)."""
    if recorded is None:
        return False
    return str(recorded) in (wanted, str(Path(wanted).expanduser().resolve()))


def select_for_clear(summaries, key: str | None = None, format: str | None = None, tier: str | None = None,
                     stale: bool = False, all: bool = False, source: str | None = None,
                     old_layout: int | None = None) -> list:
    """The store files `cache clear` with these filters removes (store.StoreFile, from
    `PackedStore.summary`). Filters combine (and). `all`: every store file. A key alone: all of
    its files. `stale`: entries that are not readable (corrupt, another store format version,
    unsafe), temp files and lock files without an entry. format / tier: the readable entries
    that record them. old_layout (this build's packed layout version): the readable entries
    recording another one, which this build never reads (their keys differ). An entry is chosen
    alone; `PackedStore.delete` takes its lock file along. Files that are not the store's are
    never chosen."""
    if all:
        return [f for s in summaries for f in s.files if f.kind != "other"]
    chosen = []
    for s in summaries:
        if key is not None and s.key != key:
            continue
        if not (format or tier or stale or source or old_layout is not None):  # a key alone: the whole key directory
            chosen += [f for f in s.files if f.kind != "other"]
            continue
        for f in s.entries:
            if stale and f.readable:
                continue
            if format and f.meta_value("format") != format:
                continue
            if tier and f.meta_value("tier") != tier:
                continue
            if source and not _same_source(f.meta_value("source"), source):
                continue
            if old_layout is not None:
                v = f.meta_value("layout_version")
                if not isinstance(v, int) or v == old_layout:
                    continue
            chosen.append(f)
        if stale and not (format or tier or source or old_layout is not None):
            have = {f.file for f in s.entries}
            chosen += [f for f in s.files if f.kind == "tmp"
                       or (f.kind == "lock" and f.file[: -len(".lock")] not in have)]
    return chosen


def _filters_text(args) -> str:
    parts = [f"--key {args.key}" if args.key else "", f"--source {args.source}" if args.source else "",
             f"--format {args.format}" if args.format else "",
             f"--tier {args.tier}" if args.tier else "", "--old-layout" if args.old_layout else "",
             "--stale" if args.stale else "", "--all" if args.all else ""]
    return " ".join(p for p in parts if p)


def _confirm(prompt: str) -> bool:
    sys.stderr.write(prompt)  # stderr: stdout stays clean for --output json
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _current_layout() -> int | None:
    """This build's packed layout version, or None without the native extension."""
    native, _ = native_module()
    return None if native is None else int(native.PACKED_LAYOUT_VERSION)


def _layout_version() -> int:
    """This build's packed layout version, for --old-layout; UserError without the native extension."""
    layout = _current_layout()
    if layout is None:
        raise UserError(f"--old-layout compares entries with this build's packed layout version, which the "
                        f"native extension holds, and it could not be loaded ({native_module()[1]})",
                        "`hi-na-moe check` says more; or select the old entries with --key or --format")
    return layout


def cmd_cache_clear(args) -> int:
    if not (args.key or args.source or args.format or args.tier or args.old_layout or args.stale or args.all):
        raise UserError(f"cache clear needs a filter saying what to remove: {CLEAR_FILTERS}",
                        "`hi-na-moe cache list` shows what is there; add --dry-run to see what would go")
    if args.all and (args.key or args.source or args.format or args.tier or args.old_layout or args.stale):
        raise UserError("--all removes every store file; it cannot be combined with --key, --source, --format, "
                        "--tier, --old-layout or --stale",
                        "drop --all to remove only what the other filters select")
    store = _cache_store(args.cache_dir)
    if store is None:
        print(f"packed-expert store: {load_config().store_root()} does not exist yet: nothing to clear")
        return 0
    summaries = store.summary("full" if args.verify else "header")
    key = resolve_key(summaries, args.key) if args.key else None
    chosen = select_for_clear(summaries, key, args.format, args.tier, args.stale, args.all, args.source,
                              _layout_version() if args.old_layout else None)
    dry = store.delete(chosen, dry_run=True)  # the same checks as the real run: what is in use
    data = {"root": str(store.root), "filters": _filters_text(args), "dry_run": bool(args.dry_run),
            "files": len(dry.removed), "bytes": dry.freed}
    if not dry.removed:
        why = "" if not dry.skipped else f" ({_n(len(dry.skipped), 'file')} skipped, below)"
        held = {what: sorted({str(v) for s in summaries for v in s.describe()[what]})
                for what in ("format", "tier", "source")}
        hint = "; ".join(f"{k}s in the store: {', '.join(v)}" for k, v in held.items() if v and getattr(args, k))
        if args.output == "json":
            print(json.dumps({**data, "removed": [], "skipped": _skipped_json(dry.skipped), "freed_bytes": 0},
                             indent=2))
        else:
            print(f"nothing to clear in {store.root} for {data['filters']}{why}" + (f" ({hint})" if hint else ""))
            _print_skipped(dry.skipped)
        return 1 if dry.skipped else 0
    if args.output != "json":
        print(f"packed-expert store: {store.root}; {data['filters']} selects:")
        _print_selection(dry.removed)
        _print_skipped(dry.skipped)
    if args.dry_run:
        if args.output == "json":
            print(json.dumps({**data, "removed": [_file_json(f) for f in dry.removed],
                              "skipped": _skipped_json(dry.skipped), "freed_bytes": 0}, indent=2))
        else:
            print(f"dry run: would remove {_n(len(dry.removed), 'file')}, {_human(dry.freed)} ({dry.freed} bytes); "
                  "nothing was removed")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError("refusing to remove files without confirmation: stdin is not a terminal",
                            "pass --yes to clear without asking (--dry-run shows what would go)")
        if not _confirm(f"remove {_n(len(dry.removed), 'file')}, {_human(dry.freed)}? [y/N] "):
            print("cancelled; nothing was removed", file=sys.stderr)
            return 1
    res = store.delete(dry.removed)
    if args.output == "json":
        print(json.dumps({**data, "removed": [_file_json(f) for f in res.removed],
                          "skipped": _skipped_json(dry.skipped + res.skipped), "freed_bytes": res.freed,
                          "key_dirs_removed": res.dirs_removed}, indent=2))
    else:
        _print_skipped(res.skipped)
        print(f"removed {_n(len(res.removed), 'file')}, freed {_human(res.freed)} ({res.freed} bytes)"
              + (f"; {_n(len(res.dirs_removed), 'emptied key directory')} removed" if res.dirs_removed else ""))
    return 1 if (dry.skipped or res.skipped) else 0


def _file_json(f) -> dict:
    return {"key": f.key, "file": f.file, "kind": f.kind, "name": f.name, "status": f.status or None,
            "size_bytes": f.size}


def _skipped_json(skipped) -> list[dict]:
    return [{**_file_json(f), "skipped_because": why} for f, why in skipped]


def _print_selection(files) -> None:
    """One line per key: what goes from it (entries by state, other files), bytes, names."""
    by_key: dict[str, list] = {}
    for f in files:
        by_key.setdefault(f.key, []).append(f)
    for key, fs in by_key.items():
        entries = [f for f in fs if f.kind == "entry"]
        ok = [f for f in entries if f.readable]
        fmt = sorted({str(f.meta_value("format")) for f in ok} | {str(f.meta_value("tier")) for f in ok})
        bad = len(entries) - len(ok)
        parts = [_n(len(entries), "entry") + (f" ({bad} unreadable)" if bad else "")]
        tmp = sum(f.kind == "tmp" for f in fs)
        if tmp:
            parts.append(_n(tmp, "temp file"))
        locks = sum(f.kind == "lock" for f in fs)
        if locks:
            parts.append(_n(locks, "lock file"))
        names = sorted({f.name for f in entries if f.name})
        print(f"  {key[:12]}  {' '.join(fmt) or '-'}  {', '.join(parts)}, {_human(sum(f.size for f in fs))}"
              f"  {_names(names)}")


def _print_skipped(skipped) -> None:
    for f, why in skipped:
        print(f"  skipped {f.file} (key {f.key[:12]}): {why}")
