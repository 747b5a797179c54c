"""What runs inside a replica's engine processes (never imports `replica.agent`).

`extension` (the worker RPC surface) over `weight_map`/`landings` (where vLLM's loader puts each
checkpoint tensor), `stage` (stage -> swap -> commit | discard) with `scatter`, `updates`,
`tensors` and `device_checksum` (Adler-32 on host or accelerator), `jobs`, `shared_memory`,
`files`, `peer_group` (broadcast between engines), and the CPU patches `cpu_gemm`, `cpu_moe`,
`post_load`. Served by `server` (vLLM's OpenAI server, behind `guard`) or `dynamo_worker`
(with `dynamo_routes`, `dynamo_card`, `dynamo_compat`); both serve `control`'s routes, the swap
transaction in `swap`. `plugin` is the ``vllm.general_plugins`` entry point.
"""
