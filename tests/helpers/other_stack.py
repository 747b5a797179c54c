"""Another stack's variables, as a shell that sourced its stack.env holds them: what the tests of
a home's own settings and stack set to show that they do not redirect it."""

from __future__ import annotations

from pathlib import Path

from common.settings import Settings


def other_stack_env(tmp_path: Path) -> dict[str, str]:
    """What a shell that sourced another stack's stack.env holds, and the rest of what a cluster
    install's shell could set (its tokens file, engine key, discovery, TLS for the temporal CLI)."""
    other = Settings.create(tmp_path / "other", 18000, host="10.9.9.9")
    other.namespace, other.bucket, other.gateway_id = "other-ns", "other-bucket", "gw-other"
    return {
        **other.stack_env(),
        "ROLLOUTS_TOKENS_FILE": "/other/tokens.json",
        "ROLLOUTS_ENGINE_KEY": "other-key",
        "ROLLOUTS_DYNAMO_DISCOVERY_DIR": "/other/discovery",
        "ROLLOUTS_DYNAMO_DISCOVERY": "kubernetes",
        "ROLLOUTS_DYNAMO_ROUTER_MODE": "kv",
        "ROLLOUTS_API_PORT": "18080",
        "ROLLOUTS_HOST": "10.9.9.9",
        "TEMPORAL_TLS_CERT": "/other/cert.pem",
        "AWS_PROFILE": "other",
    }
