"""The handlers of `rollouts` subcommands (workers/cli.py), one module per command or group: a
command imports only what its process runs, so `rollouts --help` or `rollouts status` load
neither Temporal, FastAPI, torch nor the replica's engine client. Each handler takes the parsed
arguments (``args.home`` already resolved) and returns the exit status."""

from __future__ import annotations

import argparse
import logging

from common.settings import Settings

# How long the API and the gateway keep an idle client connection open (uvicorn's default is 5 s).
# Clients pool connections and reuse them; httpx drops its own idle ones after 5 s. With the
# server's limit at the client's, a request sent on a pooled connection as the server closes it
# meets a reset (ECONNRESET: the request's bytes were unread when the socket closed), and a
# client stalled a few seconds (docs/field-notes.md) finds every connection at that edge. Longer
# than any common client's idle expiry: the client closes first.
KEEP_ALIVE_S = 75


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings.load(args.home)


def service_logging(verbose: bool = False) -> None:
    """Log lines for a service process (api, worker, gateway, replica)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per engine call is noise in the replica and gateway logs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
