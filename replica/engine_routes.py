"""The control routes of a replica engine, by name: the one list both sides read.

The engine side serves them (`replica.engine.control`): our vLLM server at ``VLLM_PREFIX + name``
(`replica.engine.server`), a Dynamo worker's system server at ``DYNAMO_PREFIX + name``
(`replica.engine.dynamo_routes`, which adds :data:`DYNAMO_ROUTES`). The agent side calls them by
name through its engine's transport (`replica.agent.transport`). Every route takes and answers
a JSON object; a failure answers ``{"error": {"code", "message"}}``.
"""

# Served by every engine kind, over vLLM's AsyncLLM (replica/engine/control.py).
ENGINE_ROUTES = (
    "pause",
    "resume",
    "is_paused",
    "reset_prefix_cache",
    "collective_rpc",
    "update_weight_version",
    "weight_info",
    "swap_in_pause",
    "swap_hook",
)
# A Dynamo worker's alone: its place in the frontend's routing pool, its id, its gate.
DYNAMO_ROUTES = ("leave", "join", "instance", "instances", "open")
# Where our vLLM server serves ENGINE_ROUTES (POST, JSON body).
VLLM_PREFIX = "/rollouts/"
# The engine route names a Dynamo worker registers with its runtime, and where its system server
# serves them (POST, JSON body carrying the engine's secret).
DYNAMO_NAME_PREFIX = "rollouts/"
DYNAMO_PREFIX = "/engine/" + DYNAMO_NAME_PREFIX
