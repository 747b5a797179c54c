"""The relay of Dynamo's event plane for the embedded stack: ``rollouts dynamo-events`` runs it.

Dynamo's processes otherwise bind their ZMQ publishers on ``tcp://0.0.0.0``; in broker mode
(``DYN_ZMQ_BROKER_URL``, ``Settings.dynamo_event_broker``, `common.dynamo_planes`) they bind
nothing and connect here. :func:`serve` binds XSUB on ``inbound`` and XPUB on ``outbound`` (the
stack's host) and forwards every message and subscription (``zmq.proxy``) until stopped. It
stores nothing (a late subscriber misses what came before), and its sockets are as open as the
configured host (docs/design.md, "Security").
"""

from __future__ import annotations

import zmq

from common.addresses import host_port


def serve(host: str, inbound_port: int, outbound_port: int, context: zmq.Context | None = None) -> None:
    """Bind and relay until the process ends or ``context`` is terminated (module docstring)."""
    context = context or zmq.Context.instance()
    inbound = context.socket(zmq.XSUB)
    outbound = context.socket(zmq.XPUB)
    try:
        for sock in (inbound, outbound):
            sock.setsockopt(zmq.IPV6, 1 if ":" in host else 0)
        inbound.bind(f"tcp://{host_port(host, inbound_port)}")
        outbound.bind(f"tcp://{host_port(host, outbound_port)}")
        zmq.proxy(inbound, outbound)
    except zmq.ContextTerminated:
        pass
    finally:
        inbound.close(linger=0)
        outbound.close(linger=0)
