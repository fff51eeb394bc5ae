"""Traffic observers: the payload bytes this process sends and receives through hivemind's p2p streams.

Every RPC and stream hivemind runs over libp2p (matchmaking, all-reduce parts, state downloads, DHT requests) is
written with ``P2P.send_raw_data`` and read with ``P2P.receive_raw_data``; ``observe_traffic(observer)`` wraps both
(once per process) and calls ``observer(sent, received)`` for each message. A process forked afterwards, such as an
averager, inherits the wrap and the observers; the DHT's process, forked before, is not counted. p2pd's own framing
and encryption are not counted either.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, List

from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

TrafficObserver = Callable[[int, int], None]
_observers: List[TrafficObserver] = []


def observe_traffic(observer: TrafficObserver) -> Callable[[], None]:
    """Call ``observer(sent, received)`` (bytes) for each message; returns the function that unregisters it."""
    _wrap_once()
    _observers.append(observer)
    return functools.partial(_observers.remove, observer)


def _notify(sent: int, received: int) -> None:
    for observer in list(_observers):
        try:
            observer(sent, received)
        except Exception:
            logger.warning("A traffic observer failed", exc_info=True)


def _wrap_once() -> None:
    if getattr(P2P, "_leanhive_counted", False):
        return
    send, receive = P2P.send_raw_data, P2P.receive_raw_data

    @functools.wraps(send)
    async def send_raw_data(data, writer, *, chunk_size: int = 2**16):
        await send(data, writer, chunk_size=chunk_size)
        _notify(len(data), 0)

    @functools.wraps(receive)
    async def receive_raw_data(reader):
        data = await receive(reader)
        _notify(0, len(data))
        return data

    P2P.send_raw_data = staticmethod(send_raw_data)
    P2P.receive_raw_data = staticmethod(receive_raw_data)
    P2P._leanhive_counted = True
