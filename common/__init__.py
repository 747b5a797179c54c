"""Shared infrastructure every process uses (settings, processes, telemetry, tokens, buckets,
REST error classes, ids); it imports no other package of the project."""
