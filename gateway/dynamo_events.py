"""The relay of Dynamo's event plane for the embedded stack: ``rollouts dynamo-events`` runs it.

Dynamo 1.6.1's processes publish their events (the workers' ``kv_metrics`` and
``active_sequences_events``, the frontend's ``session_affinity_events``) over ZMQ. Left to
themselves, each binds its publisher on ``tcp://0.0.0.0``, hard-coded, on every interface of its
host. In broker mode (``DYN_ZMQ_BROKER_URL``, ``"xsub=<url> , xpub=<url>"``) they bind nothing:
each publisher connects to a relay's XSUB socket and each subscriber to its XPUB socket. This is
that relay: :func:`serve` binds XSUB on ``inbound`` and XPUB on ``outbound`` (the stack's host
and its ``dynamo_events_in`` / ``dynamo_events_out`` ports; ``Settings.dynamo_event_broker`` is
the URL every Dynamo process is given: ``common.dynamo_planes``) and
forwards every message and subscription between them (``zmq.proxy``, in C, off the GIL) until
the process is stopped. It stores nothing; a subscriber that connects late misses what came
before, as with Dynamo's own publishers.

The relay's sockets are no more open than the configured host: anyone who reaches that address
may publish or read Dynamo's routing events, as anyone could reach Dynamo's own publishers on
every address before (design.md, "Security").
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
