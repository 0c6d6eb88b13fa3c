"""Client connections of the front have Nagle's algorithm off (tokens stream, not burst).

The front binds its listening socket itself (protocol number 0), and asyncio
only turns Nagle off for sockets created with IPPROTO_TCP: uvicorn's plain
protocol leaves it on there, `NoDelayH11Protocol` turns it off.
"""

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from mlxserve.commands.serve import bind
from mlxserve.server.nodelay import NoDelayH11Protocol


async def _app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError


async def server_side_nodelay(protocol: type[H11Protocol]) -> int:
    config = uvicorn.Config(_app, http=protocol, lifespan="off")
    config.load()
    state = ServerState()
    made: list[H11Protocol] = []

    def factory() -> H11Protocol:
        made.append(protocol(config=config, server_state=state, app_state={}))
        return made[-1]

    listener = bind("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(factory, sock=listener)
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        for _ in range(200):
            if made and made[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        sock = made[0].transport.get_extra_info("socket")
        value = int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()
        await writer.wait_closed()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_the_fronts_connections_have_nagle_off() -> None:
    assert asyncio.run(server_side_nodelay(H11Protocol)) == 0  # why the protocol exists
    assert asyncio.run(server_side_nodelay(NoDelayH11Protocol)) != 0
