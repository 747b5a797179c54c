"""replica.vllm_plugin: the capped idle busy-poll (the engine side: tests/replica/test_engine.py)."""

from __future__ import annotations

import pytest

from replica.vllm_plugin import DEFAULT_SPIN_S, idle_spin_cap, shorten_idle_spin


def test_readers_stop_spinning_after_the_cap() -> None:
    zmq = pytest.importorskip("zmq")
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    assert shorten_idle_spin() is True  # a CPU platform here
    assert shorten_idle_spin() is True and idle_spin_cap() == DEFAULT_SPIN_S  # idempotent
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    assert reader.busy_loop_s == 1  # vLLM's default
    reader.wait(timeout_ms=0)
    assert reader.busy_loop_s == DEFAULT_SPIN_S
    writer.local_notify_socket.close(0)
    for sock in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
        sock.close(0)
    context.term()

