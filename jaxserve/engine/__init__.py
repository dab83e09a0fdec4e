"""The engine: requests in, outputs out, on the host.

`llm_engine` owns the loop (admit, schedule, run a step, process its output); `input_processor`
validates and tokenizes what callers send; `output_processor` turns the worker's token ids into
`RequestOutput`s (`outputs`), with the incremental `detokenizer` and stop strings. The device work
is the worker's (`jaxserve.worker`); the scheduling is the `scheduler` package's.
"""
