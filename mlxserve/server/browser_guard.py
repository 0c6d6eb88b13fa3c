"""What a web page could send, refused while no API key is set; pure ASGI middleware.

Why: without `server.api_keys` (the default) the API answers whoever reaches it,
and a page open in the user's browser reaches 127.0.0.1 as well. It may POST a
``text/plain`` body holding JSON (a "simple" request, which browsers send without
asking the server first: the page cannot read the answer, but the server does the
work: cross-site request forgery), or point a name it controls at 127.0.0.1 (DNS
rebinding) and then read every answer as its own. Three checks on the headers,
none on the body:

* **Host** must be an IP address, ``localhost`` (or a ``.localhost`` name), the
  configured `host`, or in `allowed_hosts`, else 421: a rebinding page's requests
  carry its own name. A request without one (HTTP/1.0) passes: browsers send it.
* **Origin**, which browsers send on cross-site requests, must be the server's own
  (``http(s)://`` + the Host) or in `allowed_origins`, else 403.
* a **POST's Content-Type** must be ``application/json``, else 415: the one type a
  page cannot send without a CORS preflight, which this server never approves.

With an API key set these checks are not installed (`mlxserve.server.app`): a
page cannot make an authorised request, as it does not know the key, and servers
behind a proxy that sends its own Host name keep working.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.errors import (
    APIError,
    Forbidden,
    MisdirectedRequest,
    UnsupportedMediaType,
    error_response,
)

JSON_TYPE = "application/json"


class BrowserGuard:
    def __init__(
        self,
        app: ASGIApp,
        bind_host: str,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.hosts = {_host_name(bind_host), *(_host_name(h) for h in allowed_hosts)}
        self.origins = {origin.lower().rstrip("/") for origin in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error_response(error, scope["path"])(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self._host_allowed(_host_name(host)):
            return MisdirectedRequest(
                f"this server does not answer to the host name {host!r}; use its address, "
                "or add the name to server.allowed_hosts",
                param="host",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return Forbidden(
                f"requests from the web page origin {origin!r} are not allowed; add it to "
                "server.allowed_origins, or set server.api_keys",
                param="origin",
            )
        if scope["method"] == "POST":
            media = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != JSON_TYPE:
                got = f"{media!r}" if media else "none"
                return UnsupportedMediaType(
                    f"the body must be sent with Content-Type: {JSON_TYPE} (got {got})",
                    param="content-type",
                )
        return None

    def _host_allowed(self, name: str) -> bool:
        if name in self.hosts or "*" in self.hosts or _is_ip(name):
            return True
        if name == "localhost" or name.endswith(".localhost"):
            return True
        return any(
            pattern.startswith("*.") and name.endswith(pattern[1:]) for pattern in self.hosts
        )

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.lower().rstrip("/")
        if origin in self.origins or "*" in self.origins:
            return True
        scheme, _, rest = origin.partition("://")
        return host is not None and scheme in ("http", "https") and rest == host.lower()


def _host_name(host: str) -> str:
    """The name of a Host header's value (or a configured host), without its port, its
    IPv6 brackets and a final dot, in lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    """An IP address, which no DNS answer can rebind."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
