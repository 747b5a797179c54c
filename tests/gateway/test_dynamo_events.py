"""gateway/dynamo_events.py, the relay of Dynamo's event plane, with plain ZMQ peers (Dynamo's
own processes use it in tests/gateway/test_listening_sockets.py): what a publisher sends to its
inbound socket reaches a subscriber of its outbound socket, subscriptions included, and it binds
the host it is given."""

from __future__ import annotations

import threading

import psutil
import zmq

from common.dynamo_planes import broker_url
from common.processes import free_port
from gateway.dynamo_events import serve


def test_a_publisher_reaches_a_subscriber_through_the_relay_on_the_given_host() -> None:
    host, inbound, outbound = "127.0.0.1", free_port(), free_port()
    assert broker_url(host, inbound, outbound) == f"xsub=tcp://{host}:{inbound} , xpub=tcp://{host}:{outbound}"
    relay_context, context = zmq.Context(), zmq.Context()
    relay = threading.Thread(target=serve, args=(host, inbound, outbound, relay_context), daemon=True)
    relay.start()
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv_metrics")
        sub.connect(f"tcp://{host}:{outbound}")
        pub.connect(f"tcp://{host}:{inbound}")
        # A subscription travels to the publisher through the relay before the first message
        # passes (ZMQ drops what a PUB sends before it knows of a subscriber): publish until one
        # arrives, each once, then one the subscriber did not ask for must not.
        received = None
        for i in range(200):
            pub.send_multipart([b"kv_metrics", str(i).encode()])
            if sub.poll(50):
                received = sub.recv_multipart()
                break
        assert received is not None and received[0] == b"kv_metrics", received
        pub.send_multipart([b"other_topic", b"x"])
        pub.send_multipart([b"kv_metrics", b"last"])
        while sub.poll(2000):
            topic, body = sub.recv_multipart()
            assert topic == b"kv_metrics"
            if body == b"last":
                break
        else:
            raise AssertionError("the last kv_metrics message did not pass")
        bound = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert {(host, inbound), (host, outbound)} <= bound, bound
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        context.term()
        relay_context.term()
        relay.join(5)
    assert not relay.is_alive()
