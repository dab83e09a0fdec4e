"""Compile planning: which step shapes a configuration needs, and getting them compiled.

`buckets` and `compile_plan` turn an `EngineConfig` into the fixed set of padded step shapes
(token and request buckets, sampler variants) that a warmed-up server never leaves;
`step_programs` builds the jitted step functions for them; `warmup` compiles every planned
shape at start-up through the persistent cache (`compile_cache`); `aot` compiles, reports
memory for and serializes the same programs for a target chosen by name (`targets`, with
`gpu_specs` for GPUs) on a machine without that accelerator (`jaxserve compile`).
"""
