"""The MoE model families of the installed transformers, found from transformers itself (not a
hand-kept list), so that a newer transformers is covered by the same code and tests."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass

from transformers.utils import logging as hf_logging

# Config attributes that count routed experts, across families.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str
    modeling_module: str
    uses_experts_interface: bool  # has a class decorated with @use_experts_implementation
    causal_lm: bool  # has an AutoModelForCausalLM mapping


def _modeling_source(pkg: str) -> tuple[str, str] | None:
    name = f"transformers.models.{pkg}.modeling_{pkg}"
    try:
        mod = importlib.import_module(name)
        return name, inspect.getsource(mod)
    except Exception:  # optional dependency missing, or no modeling file: not a family we can run
        return None


def _counts_experts(config_cls: type) -> bool:
    try:
        cfg = config_cls()
    except Exception:
        return False
    configs = [cfg] + [getattr(cfg, k) for k in getattr(cfg, "sub_configs", {}) if getattr(cfg, k, None) is not None]
    for c in configs:
        for key in EXPERT_COUNT_KEYS:
            v = getattr(c, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return True
    return False


def _sub_config_classes(config_cls: type) -> set[type]:
    """The config classes a config class nests (sub_configs, recursively)."""
    out: set[type] = set()
    todo = [config_cls]
    while todo:
        cls = todo.pop()
        for attr in ("sub_configs", "sub_configs_defaults"):
            for sub in (getattr(cls, attr, None) or {}).values():
                if isinstance(sub, type) and sub not in out:
                    out.add(sub)
                    todo.append(sub)
    return out


def _top_model_types(pkg: str, model_types: list[str]) -> list[str]:
    """The model types of one modeling package a checkpoint names: the package's own name, else
    every type that is not a sub-config of another type of the package (Inkling's package
    `inkling` has no type of that name; its checkpoints are `inkling_mm_model`, which nests
    `inkling_text`, `inkling_vision` and `inkling_audio`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # import cost: 0.26 s (measured 2026-12-07)

    own = [t for t in model_types if t.replace("-", "_") == pkg]
    if own:
        return own
    nested: set[type] = set()
    for t in model_types:
        nested |= _sub_config_classes(CONFIG_MAPPING[t])
    return [t for t in model_types if CONFIG_MAPPING[t] not in nested]


@functools.lru_cache(maxsize=1)
def moe_families() -> tuple[Family, ...]:
    """Every model type whose modeling code has routed experts: a class using the experts
    interface, or a config counting routed experts together with top-k routing in the code.
    One a modeling package: the type its checkpoints name (_top_model_types), found through the
    package transformers maps each type to (a type's name is not always its package's)."""
    from transformers.models.auto import modeling_auto  # import cost: 0.26 s (measured 2026-12-07)
    from transformers.models.auto.configuration_auto import (  # import cost: as above
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )


    packages: dict[str, list[str]] = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        packages.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    found = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs of some families warn about token ids
    try:
        for pkg, model_types in sorted(packages.items()):
            src = _modeling_source(pkg)
            if src is None:
                continue
            module_name, code = src
            decorated = "@use_experts_implementation" in code
            sparse_classes = re.search(r"^class \w*(Expert|MoE|Moe|Sparse)\w*\(", code, re.MULTILINE) is not None
            if not (decorated or sparse_classes):
                continue
            for model_type in _top_model_types(pkg, model_types):
                if not (decorated or _counts_experts(CONFIG_MAPPING[model_type])):
                    continue
                found.append(Family(
                    model_type=model_type, config_class=CONFIG_MAPPING_NAMES[model_type], modeling_module=module_name,
                    uses_experts_interface=decorated,
                    causal_lm=model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                ))
    finally:
        hf_logging.set_verbosity(verbosity)
    return tuple(sorted(found, key=lambda f: f.model_type))
