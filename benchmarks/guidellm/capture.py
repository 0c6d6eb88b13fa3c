"""A recording proxy: forwards every request to a server and appends what the client
sent (method, path, the headers that matter, the JSON body) to a JSON-lines file,
with the upstream status.

    .venv/bin/python benchmarks/guidellm/capture.py --upstream http://127.0.0.1:8000 \
        --port 8100 --out /tmp/requests.jsonl

Why: the compatibility fixtures (`tests/server/fixtures/tool_requests/`) must be the
bodies the tools really send, not what their docs say they send; a tool pointed at
the proxy shows them, and its answers come from the real server unchanged (streams
are relayed chunk by chunk, so the tool still measures real latencies).
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

#: Headers worth keeping in a record: what says who the client is and what it asks.
KEPT_HEADERS = (
    "user-agent",
    "content-type",
    "accept",
    "x-stainless-lang",
    "x-stainless-package-version",
)


def make_app(upstream: str, out: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0))
    lock = threading.Lock()

    def record(entry: dict[str, Any]) -> None:
        with lock, out.open("a") as file:
            file.write(json.dumps(entry) + "\n")

    async def forward(request: Request) -> StreamingResponse:
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = raw.decode(errors="replace")
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        upstream_request = client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=raw,
            headers=headers,
        )
        response = await client.send(upstream_request, stream=True)
        kept = {k: request.headers[k] for k in KEPT_HEADERS if k in request.headers}
        record(
            {
                "method": request.method,
                "path": request.url.path,
                "headers": kept,
                "body": body,
                "status": response.status_code,
            }
        )

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk

        passed = {
            k: v
            for k, v in response.headers.items()
            if k.lower()
            not in ("content-length", "transfer-encoding", "content-encoding", "connection")
        }
        return StreamingResponse(
            relay(),
            status_code=response.status_code,
            headers=passed,
            background=BackgroundTask(response.aclose),
        )

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the server's base URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended to")
    args = parser.parse_args()
    app = make_app(args.upstream.rstrip("/"), args.out)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
