"""tokenspeed: serving hybrid KDA / latent-attention MoE models (Kimi K3, Kimi Linear).

    from tokenspeed import LLM, SamplingParams

The top-level names load lazily, so `import tokenspeed.sched` (pure logic) does not pull in the
model and the runtime.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tokenspeed' has no attribute {name!r}")
