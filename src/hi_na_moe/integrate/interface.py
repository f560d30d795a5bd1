"""transformers' own switch: experts_implementation="hi_na_moe" (its ExpertsInterface)."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

from torch import nn

from ..core import ops
from ..core import trim as trim_mod
from ..core.config import load_config
from . import adapters
from .patching import _guarded, _TrimHolder, _trimmed_reference

# ---------------------------------------------------------------------------------------------
# transformers' own switch: experts_implementation="hi_na_moe"
# ---------------------------------------------------------------------------------------------
INTERFACE_NAME = "hi_na_moe"


_SPECS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, ops.Choice, Any]]" = weakref.WeakKeyDictionary()


def _weights_key(m: nn.Module) -> tuple:
    return tuple((n, p.data_ptr(), tuple(p.shape), p.dtype) for n, p in m.named_parameters(recurse=False))


def interface_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights):
    """The function registered in transformers' ExpertsInterface under "hi_na_moe"."""
    key = _weights_key(self)
    cached = _SPECS.get(self)
    if cached is None or cached[0] != key:
        spec, why = adapters.spec_from_interface(self)
        if spec is None:
            raise RuntimeError(f"hi_na_moe cannot run {type(self).__name__}: {why}")
        cfg = load_config()
        choice = ops.choose(spec, cfg)
        # top_k: the config's, as enable_for_model applies it (renorm from this module's config)
        trim = trim_mod.from_config(cfg, self)
        if isinstance(choice.runner, ops.NativeExperts):
            ops.apply_pool(cfg)
            choice.runner.trim = trim
            choice.runner.pack()  # the model keeps its own weights here (no release on this path)
        elif trim is not None:
            choice = replace(choice, runner=_trimmed_reference(_TrimHolder(trim)))
        cached = (key, choice, spec)
        _SPECS[self] = cached
    _, choice, spec = cached
    shape = hidden_states.shape
    out = _guarded(choice.runner, self)(spec, hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out.reshape(shape)


def register_experts_interface() -> None:
    """Make `experts_implementation="hi_na_moe"` valid in from_pretrained/set_experts_implementation."""
    try:
        from transformers.integrations.moe import ExpertsInterface  # optional dependency: transformers >= 5 only
    except ImportError:  # transformers < 5: only enable_for_model is available
        return
    ExpertsInterface.register(INTERFACE_NAME, interface_experts_forward)
