"""pagellm: a self-hosted, high-throughput LLM inference engine and server."""

from pagellm.openmp_env import apply_openmp_defaults

apply_openmp_defaults()

from pagellm.config import EngineConfig  # noqa: E402
from pagellm.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing pagellm must not import torch
        from pagellm.llm import LLM

        return LLM
    raise AttributeError(name)
