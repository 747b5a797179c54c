"""The node agent (`rollouts node`): one per machine that hosts replicas. It reports the machine to
the node registry and starts and stops the replica processes there (replica/node/agent.py,
replica/node/activities.py)."""
