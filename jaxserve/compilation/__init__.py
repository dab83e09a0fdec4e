"""Compilation tooling over the worker's step programs.

`warmup` compiles every planned shape (`worker.compile_plan`) at start-up through the persistent
cache; `aot` compiles, reports memory for and serializes the same programs for a target chosen
by name (`targets`, with `gpu_specs` for GPUs) on a machine without that accelerator
(`jaxserve compile`); `executable_store` saves and reloads them; `isolate` compiles a shape in a
child process so that a compiler crash costs that shape only.
"""
