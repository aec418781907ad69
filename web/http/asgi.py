"""An ASGI wrapper that shields the final response send (hypercorn 0.18 trio worker + quart-trio bug).

hypercorn closes the socket inside the app's final `send()`; quart-trio has already seen `http.disconnect`
and cancels the request nursery while that send waits at its checkpoint. The close never happens: a
`Connection: close` response never reaches EOF and idle keep-alive connections never time out. Shielding
the final `http.response.body` send lets hypercorn finish closing (upstream reports: hypercorn #106, #241, #210).
"""

from __future__ import annotations

import trio
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, ASGISendEvent, Scope


class ShieldedFinalSend:
    """Wraps an ASGI app; the last body message of each HTTP response is sent under a shield."""

    def __init__(self, app: ASGIFramework, *, timeout_s: float = 10.0) -> None:
        self.app = app
        self.timeout_s = timeout_s  # a stuck client cannot hold a shielded send forever

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def shielded_send(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True, deadline=trio.current_time() + self.timeout_s):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, shielded_send)
