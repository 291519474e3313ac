"""The inference engines agl runs itself: the embedded transformers engine and the managed vLLM server.

Runs in the gateway's process (the embedded engine serves there, on a worker thread) or, for the
managed vLLM server, as the parent of a vLLM process. The gateway's backends
(:mod:`agl.gateway.backends`) are thin adapters from an HTTP call to these engines; nothing outside
this package reaches into it but through its public modules:

- :mod:`agl.engine.settings`: ``EngineSettings``, every setting of the embedded engine with its default;
- :mod:`agl.engine.batching`: continuous batching, one running batch that requests join and leave;
- :mod:`agl.engine.kv`: the KV cache that grows without copying;
- :mod:`agl.engine.prefix_cache`: recent prompts' KV, so a repeated prefix is not prefilled again;
- :mod:`agl.engine.merged_lora`, :mod:`agl.engine.batched_lora`, :mod:`agl.engine.loras`: a LoRA
  merged into the weights, a batched product for mixed-LoRA batches, named LoRAs per agent;
- :mod:`agl.engine.dtype`: which dtype the engine serves in;
- :mod:`agl.engine.swaps`: weight swaps between decode steps;
- :mod:`agl.engine.vllm_server`: a vLLM server process agl starts, watches and stops.
"""

from agl.engine.settings import EngineSettings

__all__ = ["EngineSettings"]
