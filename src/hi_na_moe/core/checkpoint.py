"""Checkpoint files without pickles: safetensors-only loading, damaged-file checks, and the
interception of transformers' weight conversions (WeightTransform.convert) that from_pretrained
streams experts through and that reads a never-loaded block's originals back (load_originals).
The interception point is an internal API of transformers: checked against the pinned version
at call time, a mismatch is a clear error, never a silent full load."""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

_LOAD_LOCK = threading.Lock()  # the interception is process-wide: one load at a time


class PickleRefused(RuntimeError):
    """A checkpoint file that is not safetensors (a pickle: *.bin, *.pt) would have been read."""


_GUARD_LOCK = threading.Lock()
_GUARD = {"depth": 0, "original": None}


@contextlib.contextmanager
def safetensors_only():
    """While active, transformers' checkpoint reader (`modeling_utils.load_state_dict`, which
    falls back to `torch.load` for anything not named *.safetensors) refuses every file that is
    not safetensors, so nothing in a model directory is ever unpickled: not a pytorch_model.bin
    beside safetensors, not a .bin shard named by a *.safetensors.index.json, not the
    `adapter_model.bin` a config.json may name in `transformers_weights`. Loads pass
    `use_safetensors=True` as well, so transformers itself never looks for pickles; this guard
    covers the paths that ignore that flag. Process-wide while active (other threads' loads
    through transformers refuse pickles too), restored after the last nested use."""
    import transformers.modeling_utils as mu  # import cost: 0.48 s (measured 2026-12-07)

    with _GUARD_LOCK:
        if _GUARD["depth"] == 0:
            original = mu.load_state_dict

            def load_state_dict(checkpoint_file, *args, **kwargs):
                if not os.fspath(checkpoint_file).endswith(".safetensors"):
                    raise PickleRefused(
                        f"hi_na_moe reads only safetensors checkpoints; refusing to unpickle {os.fspath(checkpoint_file)!r} "
                        "(a pickle can run code when loaded). Convert the checkpoint to safetensors (save_pretrained "
                        "writes them by default) or load it with transformers yourself"
                    )
                return original(checkpoint_file, *args, **kwargs)

            _GUARD["original"] = original
            mu.load_state_dict = load_state_dict
        _GUARD["depth"] += 1
    try:
        yield
    finally:
        with _GUARD_LOCK:
            _GUARD["depth"] -= 1
            if _GUARD["depth"] == 0:
                mu.load_state_dict = _GUARD["original"]
                _GUARD["original"] = None


def check_no_pickles(path: str | os.PathLike) -> None:
    """Refuse (PickleRefused) a local checkpoint directory whose config.json or safetensors
    index names a weights file that is not safetensors, before transformers opens anything: a
    clear error instead of an unpickling (stopped by `safetensors_only`) or a parse error."""
    path = Path(path)
    names = []
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if isinstance(cfg, dict) and isinstance(cfg.get("transformers_weights"), str):
            names.append(("config.json (transformers_weights)", cfg["transformers_weights"]))
    except (OSError, ValueError):
        pass  # transformers reports an unreadable config itself
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(weight_map, dict):
            names += [(index.name, f) for f in sorted(set(map(str, weight_map.values())))]
    for where, name in names:
        if not (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
            raise PickleRefused(
                f"{where} in {str(path)!r} names the weights file {name!r}, which is not safetensors; hi_na_moe "
                "reads only safetensors checkpoints (a pickle can run code when loaded)"
            )


class CheckpointError(ValueError):
    """A checkpoint file is damaged: a safetensors file whose header does not describe its bytes
    (a download or copy cut short, most often). The message names the file."""


# bits an element of each safetensors dtype takes (the format's names); a dtype not here (a newer
# one) is left to the safetensors library, its offsets still checked against the file
_ST_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
            "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
            "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_ST_MAX_HEADER = 100 << 20  # the safetensors library refuses longer headers


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with `file` as a safetensors file, or None: the header's length and JSON,
    then every tensor's data_offsets against the file's size, its shape's bytes, and one tensor
    after another from the data's start to the file's end (what the safetensors library
    requires). Reads the header only."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            return f"only {size} bytes, not even the 8 of a safetensors header's length"
        n = int.from_bytes(first, "little")
        if n > size - 8 or n > _ST_MAX_HEADER:
            return f"header of {n} bytes does not fit the file's {size} bytes"
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"header is not JSON ({exc})"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if (not isinstance(info.get("dtype") if isinstance(info, dict) else None, str)
                or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has a malformed entry {info!r}"
        spans.append((offsets[0], offsets[1], name, info["dtype"], shape))
    spans.sort()
    past = [sp for sp in spans if sp[1] > data]
    if past:
        more = f" (and {len(past) - 1} after it)" if len(past) > 1 else ""
        return f"tensor {past[0][2]!r}{more} ends at byte {8 + n + past[0][1]} but the file has {size} bytes"
    end, prev = 0, None
    for begin, stop, name, dtype, shape in spans:
        bits = _ST_BITS.get(dtype)
        need = math.prod(shape) * bits if bits else None
        if need is not None and need != 8 * (stop - begin):
            return (f"tensor {name!r} has shape {shape} of {dtype} ({need / 8:g} bytes) but data_offsets of "
                    f"{stop - begin} bytes")
        if begin != end:
            where = f"where {prev!r} ends at byte {end}" if prev is not None else "not at 0"
            return f"tensor {name!r} starts at byte {begin} of the data, {where}"
        end, prev = stop, name
    if end != data:
        return f"{data - end} bytes after the last tensor that no tensor covers"
    return None


def check_safetensors(file: str | os.PathLike) -> None:
    """CheckpointError naming `file` unless its safetensors header describes its bytes (see
    _safetensors_problem): before transformers opens it, whose reader says only
    "incomplete metadata, file not fully covered", naming no file, six frames down."""
    problem = _safetensors_problem(Path(file))
    if problem is not None:
        raise CheckpointError(
            f"{os.fspath(file)!r} is truncated or corrupt: {problem}; download it again or save the checkpoint "
            "again (save_pretrained)"
        )


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """check_safetensors on every *.safetensors file of a checkpoint directory (the files
    store.checkpoint_identity reads the headers of, too)."""
    for f in sorted(Path(path).glob("*.safetensors")):
        if f.is_file():
            check_safetensors(f)


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".bin.index.json")


def checkpoint_dir(path: str | os.PathLike, weights: bool = True) -> Path:
    """`path` as a local checkpoint directory hi_na_moe can load, after checking, in this order,
    that it exists (FileNotFoundError), is a directory (NotADirectoryError), has config.json
    (FileNotFoundError), and with `weights` (false: only the config will be read) that it names
    no pickle (check_no_pickles), has safetensors weights (PickleRefused when it has only
    pickles, FileNotFoundError when none at all) and that each is whole (CheckpointError): each
    its own message, naming the path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"{str(p)!r} does not exist; hi_na_moe loads a local checkpoint directory (config.json and *.safetensors) "
            "and never fetches from a hub: download it first (e.g. `hf download ORG/MODEL --local-dir DIR`)"
        )
    if not p.is_dir():
        holder = f" ({str(p.parent)!r})" if (p.parent / "config.json").is_file() else ""
        raise NotADirectoryError(
            f"{str(p)!r} is a file, not a checkpoint directory: pass the directory that holds it{holder}, "
            "with config.json and the *.safetensors files"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{str(p)!r} has no config.json: not a transformers checkpoint directory "
                                "(save_pretrained writes one; a hub download has one)")
    if not weights:
        return p
    check_no_pickles(p)
    if not any(f.is_file() for f in p.glob("*.safetensors")):
        pickles = sorted(f.name for f in p.iterdir() if f.name.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise PickleRefused(
                f"{str(p)!r} has no *.safetensors weights, only {', '.join(pickles[:3])}"
                f"{' ...' if len(pickles) > 3 else ''}: hi_na_moe reads only safetensors checkpoints (a pickle can "
                "run code when loaded). Download the model's safetensors files, or convert it once where you trust "
                "the file (transformers: from_pretrained, then save_pretrained, which writes safetensors)"
            )
        raise FileNotFoundError(f"{str(p)!r} has config.json but no *.safetensors weights: download them too "
                                "(hi_na_moe never fetches from a hub)")
    check_checkpoint_files(p)
    return p


def safetensors_kwargs(kwargs: dict) -> dict:
    """transformers from_pretrained kwargs with use_safetensors=True (an explicit False is refused)."""
    if kwargs.get("use_safetensors", True) is not True:
        raise ValueError("hi_na_moe loads safetensors checkpoints only (use_safetensors=False would allow pickles)")
    return {**kwargs, "use_safetensors": True}


def placeholder(shape, dtype) -> torch.Tensor:
    """A zero-byte stand-in with the shape and dtype of a tensor (what released weights hold)."""
    return torch.zeros((), dtype=dtype).expand(tuple(shape))


def refuse_loading(module: torch.nn.Module, name: str):
    """A load_state_dict pre-hook for a module whose weights are released placeholders: loading
    weights into it raises an error that says what to do, instead of PyTorch's about writing into
    a tensor whose elements share one memory location. Returns the hook's handle."""

    def hook(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        keys = [k for k in state_dict if k.startswith(prefix)]
        if keys:
            raise RuntimeError(
                f"hi_na_moe: cannot load {keys[0]!r} into {name!r}: while hi_na_moe runs it, its own weights are "
                "released (it runs on a packed copy). Call hi_na_moe.disable_for_model(model) first (the weights "
                "come back exactly), load, then enable again")

    return module.register_load_state_dict_pre_hook(hook)


@dataclass(frozen=True)
class CheckpointOrigin:
    """Where a model's expert weights live when they were never loaded: the checkpoint."""

    path: str
    identity: str  # store.checkpoint_identity(path)
    model_class: Any  # the transformers class from_pretrained was called on
    kwargs: dict = field(default_factory=dict, hash=False, compare=False)  # from_pretrained kwargs


def _target_names(transform, layer_name: str) -> list[str]:
    """The full parameter names `transform.convert(layer_name)` produces, computed without
    running it (mirrors how transformers expands target patterns to full names)."""
    targets = list(getattr(transform, "target_patterns", None) or [])
    if len(targets) <= 1:
        return [layer_name]
    full = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    first = next((t for t in targets if t in full), None)
    if first is None:
        return [layer_name]
    prefix, _, suffix = full.partition(first)
    return [prefix + t + suffix for t in targets]


@contextlib.contextmanager
def intercept_conversions(policy: Callable[[Any, str, Callable[[], dict], Any], dict]):
    """While active, every `WeightTransform.convert(layer_name, model=...)` call transformers makes
    goes through policy(transform, layer_name, run_original, model) -> {full name: tensor}."""
    try:  # optional dependency: an internal module of transformers, which other versions may lack
        from transformers import core_model_loading as cml
    except ImportError as exc:  # pragma: no cover - transformers < 5
        raise RuntimeError(f"hi_na_moe.from_pretrained needs transformers 5 ({exc})") from None
    classes = [c for c in (getattr(cml, "WeightConverter", None), getattr(cml, "WeightRenaming", None)) if c]
    if len(classes) != 2 or not all(callable(getattr(c, "convert", None)) for c in classes):
        raise RuntimeError(
            f"hi_na_moe.from_pretrained does not know this transformers version ({transformers.__version__}): "
            "its weight-conversion API changed; load with transformers' from_pretrained and call "
            "hi_na_moe.enable_for_model instead"
        )
    with _LOAD_LOCK:
        originals = {c: c.__dict__["convert"] for c in classes if "convert" in c.__dict__}

        def make(orig):
            def convert(self, layer_name, model=None, **kw):
                return policy(self, layer_name, lambda: orig(self, layer_name, model=model, **kw), model)

            return convert

        old_env = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
        for c, orig in originals.items():
            setattr(c, "convert", make(orig))
        try:
            yield
        finally:
            for c, orig in originals.items():
                setattr(c, "convert", orig)
            if old_env is None:
                os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
            else:
                os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = old_env


def _first(v):
    return v[0] if isinstance(v, list) else v


def _meta_shape_dtype(model, name: str):
    try:
        p = model.get_parameter(name)
    except AttributeError:
        p = model.get_buffer(name)
    return p.shape, p.dtype


# ---------------------------------------------------------------------------------------------


def load_originals(origin: CheckpointOrigin, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` (full parameter names) as transformers would load them from the
    checkpoint, reading nothing else: every other tensor's conversion is skipped."""
    got: dict[str, torch.Tensor] = {}

    def policy(transform, layer_name, run, model):
        targets = _target_names(transform, layer_name)
        if not any(n in names for n in targets):
            return {n: placeholder(*_meta_shape_dtype(model, n)) for n in targets}
        out = run()
        for n in list(out):
            t = _first(out[n])
            if n in names:
                got[n] = t
            out[n] = placeholder(t.shape, t.dtype)
        return out

    check_no_pickles(origin.path)
    check_checkpoint_files(origin.path)  # damaged since the load: named, not a SafetensorError
    with intercept_conversions(policy), safetensors_only():
        origin.model_class.from_pretrained(origin.path, **safetensors_kwargs(origin.kwargs))
    missing = names - set(got)
    if missing:
        raise RuntimeError(f"the checkpoint {origin.path!r} did not provide {sorted(missing)[:3]}")
    return got
