"""mlaserve: a serving engine for Multi-head Latent Attention models.

The public names are imported on first use (PEP 562), so that `import mlaserve` and the
command line's argument parsing do not pay for torch and transformers.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "mlaserve.llm",
    "RequestOutput": "mlaserve.engine.request",
    "SamplingParams": "mlaserve.engine.request",
}

if TYPE_CHECKING:
    from mlaserve.engine.request import RequestOutput, SamplingParams
    from mlaserve.llm import LLM


def __getattr__(name: str) -> Any:
    """Import a public name the first time it is asked for, then keep it in the module."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mlaserve' has no attribute '{name}'")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
