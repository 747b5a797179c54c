"""Multi-host tests on one machine: each host a network namespace plus a mount namespace (hosts.py)."""
