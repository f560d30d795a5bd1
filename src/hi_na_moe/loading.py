"""`hi_na_moe.from_pretrained`: load a checkpoint with its experts packed (or quantised) straight
from the files, never holding the model's full set of expert weights in memory.

How: transformers loads the model as usual (its own classes, config, key renames and weight
conversions, dense weights), but while it runs, the conversion step of every expert parameter
of an MoE block is intercepted. The converted tensor goes to the block's packer instead of the
model; once a block's tensors are all there, it is packed into the packed-expert store and the
tensors are dropped, so at most one block's original weights are in memory at a time. The model
gets zero-byte placeholders of the right shape and dtype in their place. A block already in the
store (keyed by the checkpoint's identity, the block and the format) is not read from the files
at all: its conversion is skipped.

transformers 5 loads tensors on worker threads, all submitted up front; for the interception to
bound memory, loading runs with `HF_DEACTIVATE_ASYNC_LOAD=1` (tensors are read when converted).
The interception point is `transformers.core_model_loading`'s `WeightTransform.convert`, an
internal API: it is checked against the pinned transformers version at call time, and a
mismatch is a clear error, never a silent full load.

`disable_for_model` on such a model reads the blocks' original weights back from the checkpoint
the same way (every other tensor is skipped).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

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
    import transformers.modeling_utils as mu

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
    import json

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
    import json
    import math

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
    try:
        from transformers import core_model_loading as cml
    except ImportError as exc:  # pragma: no cover - transformers < 5
        raise RuntimeError(f"hi_na_moe.from_pretrained needs transformers 5 ({exc})") from None
    classes = [c for c in (getattr(cml, "WeightConverter", None), getattr(cml, "WeightRenaming", None)) if c]
    if len(classes) != 2 or not all(callable(getattr(c, "convert", None)) for c in classes):
        import transformers

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


@dataclass
class _Block:
    name: str
    match: Any  # adapters.BlockMatch on the meta model
    params: dict[str, tuple[nn.Module, str]]  # full name -> (meta module, attribute)
    cached: bool = False
    got: dict[str, torch.Tensor] = field(default_factory=dict)
    sqnr_db: float | None = None
    event: str | None = None


def _plan_blocks(meta_model: nn.Module, cfg) -> list[_Block]:
    from . import adapters, ops

    names = {id(m): n for n, m in meta_model.named_modules()}
    blocks = []
    for match in adapters.discover(meta_model):
        if match.spec is None:
            continue
        choice = ops.choose(match.spec, cfg, dry_run=True, name=match.name)
        if not isinstance(choice.runner, ops.NativeExperts):
            continue
        owned = _covering_params(match.module, match.spec)
        if not owned:
            continue  # loaded by transformers as usual, packed by enable_for_model afterwards
        params = {}
        for mod, pname in owned:
            full = names[id(mod)] + "." + pname if names[id(mod)] else pname
            params[full] = (mod, pname)
        blocks.append(_Block(match.name, match, params))
    return blocks


def _covering_params(module: nn.Module, spec) -> list[tuple[nn.Module, str]] | None:
    """The (module, name) of the parameters a spec's tensors are whole views of, on the meta
    device (where data pointers cannot tell tensors apart: the view's base is compared
    instead). None when some spec tensor is not a whole parameter (e.g. LongCat's expert rows
    inside a larger tensor): such a block is not streamed, transformers loads it."""
    params = {id(p): (mod, name) for mod in module.modules() for name, p in mod.named_parameters(recurse=False)}
    sizes = {id(p): p.numel() for mod in module.modules() for _, p in mod.named_parameters(recurse=False)}
    owned: dict[int, tuple[nn.Module, str]] = {}
    for t in spec.weight_tensors():
        base = t if t._base is None else t._base
        if id(base) not in params or sizes[id(base)] != t.numel():
            return None
        owned[id(base)] = params[id(base)]
    return list(owned.values())


def _runner_for(block: _Block, spec, cfg, origin: CheckpointOrigin, store):
    from . import ops

    native_isa = ops._isa_name(cfg)
    r = ops.NativeExperts(spec, native_isa, cfg.threads, cfg.weights, cfg.group_size, store, block.name,
                          qdot=cfg.qdot, memory=cfg.memory)
    r.origin = origin
    return r


def from_pretrained(path: str | os.PathLike, weights: str = "int4", *, group_size: int | None = None,
                    config=None, model_class=None, progress: bool = True, **kwargs: Any):
    """Load a local transformers MoE checkpoint with hi_na_moe already enabled, packing (or
    quantising) its experts straight from the safetensors files into the packed-expert store.

    Args:
        path: a local checkpoint directory (config.json + *.safetensors); no hub downloads. Only
            safetensors are read: a pickle (*.bin) in the directory is never loaded (PickleRefused
            if transformers would need one, or the directory has no other weights). A damaged
            safetensors file (truncated, say) is a CheckpointError naming it, before any is read.
        weights: "int4" (default), "int8", "lossless" or "lossless12" (bfloat16 weights bit for bit
            in about 75 % of their bytes; see HinaConfig.weights).
        group_size: int4 group size (default: the config's, 32).
        config: a HinaConfig for the other keys (isa, threads, cache_dir, ...); `cache` must be on.
        model_class: the transformers class to load with (default AutoModelForCausalLM).
        progress: show a progress bar over the blocks being packed.
        **kwargs: hi_na_moe config keys (scope, cache_dir, threads, isa, dense_lossless, ...: the
            names of HinaConfig's fields) override `config`, as enable_for_model's do; the rest
            go to transformers' from_pretrained (dtype, attn_implementation, ...). `cache_dir` is
            the packed-expert store's: transformers' hub cache has no use for a local directory.

    Returns the model, enabled; its EnableReport is `hi_na_moe.report_for(model)`. A second load of the same checkpoint and format reads the
    packed experts from the store without reading the experts from the files.
    """
    import transformers

    from . import ops, patching
    from .config import KEYS as HINA_KEYS
    from .config import load_config
    from .store import PackedStore, checkpoint_identity, recording_source

    path = checkpoint_dir(path)
    extra = {"weights": weights}
    if group_size is not None:
        extra["group_size"] = group_size
    extra.update({k: kwargs.pop(k) for k in list(kwargs) if k in HINA_KEYS})
    cfg = load_config(config, **extra)
    if not cfg.cache:
        raise ValueError("hi_na_moe.from_pretrained streams experts into the packed-expert store: cache must be on")
    if cfg.backend == "reference":
        raise ValueError("hi_na_moe.from_pretrained packs experts for the native kernels; backend='reference' "
                         "cannot use them (load with transformers and enable_for_model instead)")
    safetensors_kwargs(kwargs)  # refuse use_safetensors=False before anything is read
    cls = model_class or transformers.AutoModelForCausalLM
    hf_config = transformers.AutoConfig.from_pretrained(path)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
    if dtype == "auto" or dtype is None:
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        meta_model = cls.from_config(hf_config, dtype=dtype)
    store = PackedStore(cfg.store_root())
    origin = CheckpointOrigin(str(path), checkpoint_identity(path), cls, dict(kwargs))
    blocks = _plan_blocks(meta_model, cfg)
    owner = {full: b for b in blocks for full in b.params}

    # which blocks the store already has (valid entries)
    for b in blocks:
        probe = _runner_for(b, b.match.spec, cfg, origin, store)
        try:
            store.open(probe._key(cfg.weights), b.name, expect=probe._expect(cfg.weights)).close()
            b.cached = True
            b.event = "reused"
        except Exception:
            b.cached = False

    bar = None
    todo = [b for b in blocks if not b.cached]
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"hi_na_moe: packing experts ({cfg.weights})", unit="block")

    def pack_block(b: _Block) -> None:
        # the block's real tensors go into the meta model's module just long enough to build the
        # spec the packer reads; then everything is dropped again
        saved = {}
        for full, t in b.got.items():
            mod, pname = b.params[full]
            saved[full] = mod._parameters[pname]
            mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
        try:
            spec = b.match.rebuild()
            runner = _runner_for(b, spec, cfg, origin, store)
            runner.pack()  # builds and writes the store entry, measures SQNR on the originals
            b.sqnr_db = runner.sqnr_db
            b.event = runner.cache_event
            runner.restore(lambda: None)  # frees the packed copy (nothing was released)
        finally:
            for full, p in saved.items():
                mod, pname = b.params[full]
                mod._parameters[pname] = p
            b.got.clear()
        if bar is not None:
            bar.update(1)

    def policy(transform, layer_name, run, model):
        names = _target_names(transform, layer_name)
        mine = [n for n in names if n in owner]
        if not mine:
            return run()
        if len(mine) == len(names) and all(owner[n].cached for n in mine):
            return {n: placeholder(*_meta_shape_dtype(model, n)) for n in names}  # not read at all
        out = run()
        for n in list(out):
            b = owner.get(n)
            if b is None:
                continue
            t = _first(out[n])
            out[n] = placeholder(t.shape, t.dtype)
            if b.cached:
                continue
            b.got[n] = t
            if len(b.got) == len(b.params):
                pack_block(b)
        return out

    source = str(path.resolve())  # what the store's entries record they were built from
    try:
        with intercept_conversions(policy), safetensors_only(), recording_source(source):
            model = cls.from_pretrained(path, **safetensors_kwargs(kwargs))
    finally:
        if bar is not None:
            bar.close()
    incomplete = [b.name for b in blocks if not b.cached and b.event is None]
    if incomplete:
        raise RuntimeError(
            f"hi_na_moe.from_pretrained: the checkpoint did not provide every expert tensor of {incomplete[:3]} "
            "(a key layout this loader does not recognise); load with transformers and call enable_for_model"
        )
    model.eval()
    # enable: every block's packed experts are in the store now; the runners only map them
    by_name = {b.name: b for b in blocks}

    def prepare(runner: ops.NativeExperts) -> None:
        b = by_name.get(runner.name)
        if b is None:
            return
        runner.origin = origin
        runner.store = store  # lossless blocks too: they were packed into the store at load
        runner.allow_build = False
        runner.preset_sqnr = b.sqnr_db
        runner.preset_event = b.event

    with recording_source(source):
        patching.enable_for_model(model, cfg, _prepare=prepare)
    return model


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
