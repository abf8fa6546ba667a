"""An answer the front door gives while request bytes are still unread goes out as one TCP segment.

Why: the guard refuses some requests before reading their bodies (401 without a key, 413 on a declared length) and
others part-way through (past the limit, past the arrival rule), then closes the connection. A socket closed with
bytes unread sends a reset, not a FIN. The HTTP server writes an answer's head and body in two writes, so two segments;
behind HAProxy the reset can land between them: HAProxy had read the head, forwarded it, and lost the body with the
connection (seen in a clean-clone CI run: ``HTTP/1.1 401 … content-length: 157`` and nothing after it, for a 150 MB
upload without a key). Corking the socket (``TCP_CORK``) while the answer is written makes head and body one segment,
read in one go by whoever reads the first byte; the reset that follows then costs nothing of the answer.

Lifecycle: :func:`whole_answer` finds the connection's socket through the ASGI ``send`` the server gave — uvicorn's
(Serve's HTTP proxy and every ingress replica's own server) is a method of the request's cycle, which holds the asyncio
transport — corks it, lets the caller send the answer, and uncorks it, which flushes the answer; the server's close
(scheduled, not done, inside the last ``send``) runs after. Where no socket is found (another server, a test's own
``send``), or corking fails, the answer goes out as before.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def socket_of(send: Callable[..., Any]) -> Any | None:
    """The connection's socket behind an ASGI ``send`` from uvicorn (a method of its request cycle, whose
    ``transport`` is the asyncio transport), or ``None``."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    get_extra_info = getattr(transport, "get_extra_info", None)
    try:  # (uvloop builds its socket object here, asking the kernel: a connection gone already raises)
        sock = get_extra_info("socket") if callable(get_extra_info) else None
    except (OSError, ValueError):
        return None
    return sock if sock is not None and getattr(sock, "type", None) == socket.SOCK_STREAM else None


def _cork(sock: Any, on: bool) -> bool:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, int(on))
    except (OSError, AttributeError, ValueError):  # closed already, not TCP, no TCP_CORK here: send as before
        return False
    return True


@contextmanager
def whole_answer(send: Callable[..., Any]) -> Iterator[None]:
    """Within this block, what is sent on ``send``'s connection is held in the kernel and goes out, at its end, in as
    few segments as it fits (one, for an error body); outside uvicorn, a no-op. Nothing may be awaited in the block
    after the last ``send``: the server's close, scheduled inside it, would then run first, and a socket closed with
    request bytes unread drops what it still holds — the whole answer, corked."""
    sock = socket_of(send)
    corked = sock is not None and _cork(sock, True)
    try:
        yield
    finally:
        if corked:
            _cork(sock, False)
