"""The gated delta rule's chunked (WY) form over a step's chunks (Gated DeltaNet: Qwen3-Next,
Qwen3.5): a Mosaic TPU kernel and the jnp reference."""
