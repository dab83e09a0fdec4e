"""The worker: one scheduled step on the devices.

`runner` turns a `SchedulerOutput` into padded arrays (`input_batch`, `batch`), runs the jitted
step programs (`step_programs`) planned for fixed shapes (`buckets`, `compile_plan`, compiled
through `compile_cache`), samples (`sampler`, `prompt_logprobs`) and returns a
`ModelRunnerOutput` (`runner_output`). `parallel` places params and the KV cache on a mesh,
`distributed` runs the same step on every process of a multi-host group, and `kernel_choice`
picks the attention, matmul and MoE kernels per platform.
"""
