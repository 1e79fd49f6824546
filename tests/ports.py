"""Loopback ports for tests."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports on 127.0.0.1 that nothing listens on once this returns (the kernel picked them free; all
    held at once while picking, so two calls' worth can never be the same port)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    """One port as `free_ports` gives them."""
    return free_ports(1)[0]
