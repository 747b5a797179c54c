"""A sender that cannot read the files (or the engine's tensors) it offered still joins its group
and says so (`PeerGroup.send_failure`), so every receiver fails with that reason instead of
waiting out the group's timeout (replica/engine/updates.py `send_files`, `send_views`). Three
members in this process (threads), no engine, loopback only.

Premise: the group's timeout is long (10 minutes), so a receiver that fails with the sender's
reason did not wait for it; a receiver that timed out would say so instead.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.processes import free_port
from replica.engine import updates
from replica.engine.peer_group import PeerGroup


def _join(port: int, rank: int) -> updates.Join:
    return lambda: PeerGroup.create("127.0.0.1", port, rank, 3, "gloo", timeout_s=600, device_host="127.0.0.1")


def test_receivers_fail_with_the_senders_reason_when_it_cannot_read_its_files(tmp_path: Path) -> None:
    port = free_port()
    missing = str(tmp_path / "links" / "step-1" / "model.safetensors")
    specs = [["model.safetensors", "uint8", [11]]]
    expected = {"model.safetensors": f"{zlib.adler32(b'delta bytes'):08x}"}
    with ThreadPoolExecutor(3) as pool:
        send = pool.submit(updates.send_files, [missing], _join(port, 0))
        receives = [
            pool.submit(updates.receive_files, specs, expected, str(tmp_path / f"out-{r}"), _join(port, r))
            for r in (1, 2)
        ]
        with pytest.raises(FileNotFoundError):
            send.result()
        for receive in receives:
            with pytest.raises(ValueError, match="the sender failed before it sent anything"):
                receive.result()
    assert not any((tmp_path / f"out-{r}").exists() for r in (1, 2))


def test_a_sender_that_reads_its_files_sends_them(tmp_path: Path) -> None:
    """The same group with the file in place: the receivers get its bytes (the failure path's
    counterpart, so the test above fails for the reason it names)."""
    port = free_port()
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"delta bytes")
    specs = [["model.safetensors", "uint8", [11]]]
    expected = {"model.safetensors": f"{zlib.adler32(b'delta bytes'):08x}"}
    with ThreadPoolExecutor(3) as pool:
        send = pool.submit(updates.send_files, [str(path)], _join(port, 0))
        receives = [
            pool.submit(updates.receive_files, specs, expected, str(tmp_path / f"out-{r}"), _join(port, r))
            for r in (1, 2)
        ]
        assert send.result()["bytes"] == 11
        for r, receive in zip((1, 2), receives, strict=True):
            assert receive.result()["files"] == 1
            assert (tmp_path / f"out-{r}" / "model.safetensors").read_bytes() == b"delta bytes"


class _NoSuchTensor:
    """A weight map that holds none of the names asked (unit test stand-in for `WeightMap`)."""

    def select(self, names: list[str] | None) -> list:
        raise KeyError(f"{names[0]}: not held by this engine")


def test_receivers_fail_with_the_senders_reason_when_it_cannot_read_its_tensors(tmp_path: Path) -> None:
    port = free_port()
    specs = [["w", "float32", [4]]]
    with ThreadPoolExecutor(3) as pool:
        send = pool.submit(updates.send_views, _NoSuchTensor(), ["w"], _join(port, 0))
        receives = [
            pool.submit(updates.receive_files, specs, {"w": "00000000"}, str(tmp_path / f"out-{r}"), _join(port, r))
            for r in (1, 2)
        ]
        with pytest.raises(KeyError, match="not held by this engine"):
            send.result()
        for receive in receives:
            with pytest.raises(ValueError, match="the sender failed before it sent anything"):
                receive.result()
