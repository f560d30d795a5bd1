"""hi_na_moe: a non-intrusive CPU accelerator for Mixture-of-Experts models in transformers.

    import hi_na_moe
    report = hi_na_moe.enable_for_model(model)   # every MoE block, found automatically
    hi_na_moe.disable_for_model(model)           # exact restore

Importing the package also registers `experts_implementation="hi_na_moe"` with transformers.
"""

from .hardware import capabilities
from .config import ConfigError, HinaConfig, load_config
from .patching import (
    BlockReport,
    EnableReport,
    disable_for_model,
    enable_for_model,
    inspect_model,
    is_enabled,
    register_experts_interface,
)

__version__ = "0.1.0"

__all__ = [
    "BlockReport",
    "ConfigError",
    "EnableReport",
    "HinaConfig",
    "capabilities",
    "disable_for_model",
    "enable_for_model",
    "inspect_model",
    "is_enabled",
    "load_config",
]

register_experts_interface()
