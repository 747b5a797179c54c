"""SIMULATED replicas, a stand-in for scale runs (bench/scale.py): no engine, no vLLM, no GPU.

A simulated node agent (`rollouts sim-node`, replica/simulated/node.py) registers with the node
registry like a real one and runs many simulated replicas in one process; each polls its own
replica task queue and answers the real replica steps (replica/simulated/replica.py), so the
real API, control worker, deployment and hot-load workflows drive them over the real Temporal
server. Nothing a simulated replica does proves anything about an engine: it exists to measure
the control plane at sizes one machine cannot run for real.
"""
