"""Multi-LoRA serving: PEFT adapters in fixed device slots, mixed per token in one batch
(docs/lora.md). `adapter` reads PEFT directories, `registry` keeps them on the host, `slots`
holds them on the devices; `models.lora` applies them inside the step."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
