"""jaxserve: a JAX LLM serving engine.

    from jaxserve import LLM, SamplingParams
    llm = LLM()
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.lora.request import LoRARequest
from scheduler import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # The engine pulls in jax and the model code: import it only when asked for.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "Engine":
        from jaxserve.engine.llm_engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
