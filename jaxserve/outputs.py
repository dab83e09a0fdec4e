"""What `LLM.generate` returns, at the path vLLM users know (`vllm.outputs`); defined in
`jaxserve.engine.outputs`."""

from jaxserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    Usage,
)

__all__ = ["CompletionOutput", "Logprob", "OutputKind", "RequestMetrics", "RequestOutput", "Usage"]
