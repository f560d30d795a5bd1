"""The MoE model families of the installed transformers, found from transformers itself (not a
hand-kept list), so that a newer transformers is covered by the same code and tests."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass

# Config attributes that count routed experts, across families.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str
    modeling_module: str
    uses_experts_interface: bool  # has a class decorated with @use_experts_implementation
    causal_lm: bool  # has an AutoModelForCausalLM mapping


def _modeling_source(model_type: str) -> tuple[str, str] | None:
    pkg = model_type.replace("-", "_")
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


@functools.lru_cache(maxsize=1)
def moe_families() -> tuple[Family, ...]:
    """Every model type whose modeling code has routed experts: a class using the experts
    interface, or a config counting routed experts together with top-k routing in the code."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    from transformers.utils import logging as hf_logging

    found = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs of some families warn about token ids
    try:
        for model_type, config_name in sorted(CONFIG_MAPPING_NAMES.items()):
            src = _modeling_source(model_type)
            if src is None:
                continue
            module_name, code = src
            decorated = "@use_experts_implementation" in code
            routed = decorated or (
                re.search(r"^class \w*(Expert|MoE|Moe|Sparse)\w*\(", code, re.MULTILINE) is not None
                and _counts_experts(CONFIG_MAPPING[model_type])
            )
            if not routed:
                continue
            found.append(Family(
                model_type=model_type, config_class=config_name, modeling_module=module_name,
                uses_experts_interface=decorated,
                causal_lm=model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            ))
    finally:
        hf_logging.set_verbosity(verbosity)
    return tuple(found)
