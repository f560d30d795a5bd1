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

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm

from ..core import ops
from ..core.checkpoint import (
    CheckpointOrigin,
    _first,
    _meta_shape_dtype,
    _target_names,
    checkpoint_dir,
    intercept_conversions,
    placeholder,
    safetensors_kwargs,
    safetensors_only,
)
from ..core.config import KEYS as HINA_KEYS
from ..core.config import load_config
from ..core.store import PackedStore, checkpoint_identity, recording_source
from . import adapters, patching


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
