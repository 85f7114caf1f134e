"""mlaserve: a serving engine for Multi-head Latent Attention models."""

__version__ = "0.1.0"

from mlaserve.engine.request import RequestOutput, SamplingParams  # noqa: E402
from mlaserve.llm import LLM  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
