"""One inference replica, by process: `replica.engine` runs inside the vLLM engine's processes,
`replica.agent` in the replica's agent process; neither imports the other (import-linter).
What both need sits here: `launch` (how the agent starts the engine), `stage_arena` (the shared
memory the agent decodes into and the engine maps), `faults` (test fault points of the agent's
steps).
"""
