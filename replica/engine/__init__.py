"""What runs inside a replica's vLLM processes (never imports `replica.agent`).

- `extension`: the worker extension, a thin RPC surface (``/collective_rpc``) over the free
  functions of the modules below;
- `tensors`: the one dtype table and the one checksum helper (Adler-32 of a tensor's bytes);
  `device_checksum`: the same Adler-32 computed on an accelerator;
- `weight_map` (with `landings`): checkpoint names mapped to where vLLM's loader puts them, and
  what may load;
- `stage`: the one lifecycle of an update, stage -> swap -> commit | discard, all or nothing;
  `scatter`: how its tensors cross into the engine (changed elements only where that is less);
- `jobs`, `shared_memory`, `files`: background jobs, the agent's shared memory, safetensors and
  plain files;
- `peer_group`: the broadcast of tensors or files between engines (gloo or NCCL);
- `cpu_gemm`: CPU engines keep their linear weights as parameters;
- `plugin`: the ``vllm.general_plugins`` entry point; `server`: the OpenAI server with weight
  version spans; `guard`: the secret and the route list in front of the server.
"""
