"""The tests' loopback ports: distinct within one call, and free to listen on."""

from __future__ import annotations

import socket

from tests.ports import free_ports


def test_free_ports_are_distinct_and_can_be_listened_on():
    ports = free_ports(16)
    assert len(set(ports)) == 16 and all(1024 <= p <= 65535 for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()
