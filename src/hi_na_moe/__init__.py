"""hi_na_moe: a non-intrusive CPU accelerator for Mixture-of-Experts models in transformers.

    import hi_na_moe
    report = hi_na_moe.enable_for_model(model)   # every MoE block, found automatically
    hi_na_moe.disable_for_model(model)           # exact restore

    # quantised experts straight from a checkpoint, never holding the bf16 experts in memory
    model = hi_na_moe.from_pretrained("path/to/checkpoint", weights="int4")

Importing the package also registers `experts_implementation="hi_na_moe"` with transformers.
"""

from .core.config import ConfigError, HinaConfig, load_config
from .integrate.generate import GenerateFallbackWarning, generate
from .integrate.interface import register_experts_interface
from .integrate.loading import from_pretrained as _from_pretrained
from .integrate.patching import (
    BlockReport,
    EnableReport,
    disable_for_model,
    enable_for_model,
    inspect_model,
    is_enabled,
    report_for,
    set_top_k,
    stats,
)
from .tools.capabilities import capabilities


def from_pretrained(path, weights: str = "int4", **kwargs):
    """See hi_na_moe.integrate.loading.from_pretrained."""
    return _from_pretrained(path, weights, **kwargs)


__version__ = "0.1.0"

__all__ = [
    "BlockReport",
    "ConfigError",
    "EnableReport",
    "GenerateFallbackWarning",
    "HinaConfig",
    "capabilities",
    "disable_for_model",
    "enable_for_model",
    "from_pretrained",
    "generate",
    "inspect_model",
    "is_enabled",
    "load_config",
    "report_for",
    "set_top_k",
    "stats",
]

register_experts_interface()
