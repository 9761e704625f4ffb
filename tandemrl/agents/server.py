"""The OpenAI-compatible HTTP endpoint: Starlette routes served by uvicorn in the caller's loop.

``PolicyEndpoint(service)`` serves ``PolicyService`` (``service.py``) over HTTP:

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health

It runs inside the event loop that starts it (the controller actor's, next to the
generation pool: no extra process, no hop between the endpoint and the engines), bound to
``host`` (loopback by default) and ``port`` (0: a free one, read back from ``url``). The
run, not the endpoint, owns the process's signals, so uvicorn installs no signal handlers.

Per request the work is kept small (the CPU goes to the agents' clients and the engines):
the ASGI app is a bare Starlette ``Router`` (no application middleware stack: the handlers
answer their own errors), uvicorn parses with httptools and skips proxy-header rewriting; the
body is read raw, size-checked and parsed with orjson when installed; the key comes from the
``Authorization: Bearer`` header, or from the body field ``tandemrl_episode_key`` (a proxy
such as NeMo-Gym's model server sends one api key for every episode); the answer is
serialized once, by hand. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) so the official client raises its
usual ``BadRequestError`` / ``AuthenticationError`` / ``ConflictError`` (and
``InternalServerError`` for a fault of the endpoint itself, logged with its traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from tandemrl.agents.service import PolicyService, RequestError

log = logging.getLogger(__name__)

try:  # a C JSON codec, several times faster than json on these bodies
    import orjson

    def _loads(data: bytes) -> Any:
        return orjson.loads(data)

    def _dumps(value: Any) -> bytes:
        return orjson.dumps(value)

except ImportError:  # pragma: no cover - orjson is a dependency; json keeps it working

    def _loads(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()


def _http_parser() -> str:
    """uvicorn's httptools parser when installed (less CPU per request), else h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:  # pragma: no cover - httptools is a dependency
        return "h11"
    return "httptools"


# The body field that may carry the episode key in place of the Authorization header.
BODY_KEY_FIELD = "tandemrl_episode_key"


# Seconds an idle HTTP connection stays open at the endpoint (see PolicyEndpoint.start).
SERVER_KEEPALIVE_S = 300


def bearer_key(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when absent)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def build_app(service: PolicyService, *, max_request_bytes: int) -> Router:
    """The ASGI app: a Starlette ``Router`` of the four routes over ``service``.

    Plain routes (the handler gets the ``Request`` and returns a ``Response``) with no
    application around them: an application's middleware (error pages, exception handlers,
    exit stacks) costs CPU on every call (about a sixth of the endpoint's, measured with
    ``benchmarks/agent_endpoint.py``), and these handlers answer every error themselves.
    An unknown path gets 404 and a wrong method 405 from the router."""
    json_type = "application/json"

    def answer(payload: dict[str, Any], status: int = 200) -> Response:
        return Response(_dumps(payload), status_code=status, media_type=json_type)

    async def read_body(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise RequestError(
                400,
                f"the request body is {declared} bytes, above the endpoint's limit of "
                f"{max_request_bytes} (policy.generation.http_server.max_request_bytes)",
                param="max_request_bytes",
            )
        raw = await request.body()
        if len(raw) > max_request_bytes:
            raise RequestError(
                400,
                f"the request body is {len(raw)} bytes, above the endpoint's limit of "
                f"{max_request_bytes} (policy.generation.http_server.max_request_bytes)",
                param="max_request_bytes",
            )
        try:
            return _loads(raw)
        except ValueError as exc:
            raise RequestError(400, f"the request body is not JSON: {exc}") from exc

    async def serve(
        request: Request, call: Callable[[str | None, Any], Awaitable[dict[str, Any]]]
    ) -> Response:
        try:
            body = await read_body(request)
            # A proxy that holds one api key for every episode (NeMo-Gym's model servers) names
            # the episode in the body instead; it wins over the bearer token.
            key = body.get(BODY_KEY_FIELD) if isinstance(body, dict) else None
            if not isinstance(key, str):
                key = bearer_key(request.headers.get("authorization"))
            if key is None:
                raise RequestError(
                    401, "no episode key: send it as 'Authorization: Bearer <key>' (api_key)"
                )
            return answer(await call(key, body))
        except RequestError as error:
            return answer(error.body(), error.status)
        except Exception as exc:  # a fault of the endpoint itself: logged, answered as a 500
            log.exception("policy endpoint: %s %s failed", request.method, request.url.path)
            fault = RequestError(500, f"the policy endpoint failed: {type(exc).__name__}: {exc}")
            return answer(fault.body(), 500)

    async def chat_completions(request: Request) -> Response:
        return await serve(request, service.chat)

    async def completions(request: Request) -> Response:
        return await serve(request, service.completion)

    async def models(request: Request) -> Response:
        return answer(service.models())

    async def health(request: Request) -> Response:
        return answer({"status": "ok"})

    return Router(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


class PolicyEndpoint:
    """Start/stop the HTTP endpoint in the running event loop (see the module docstring)."""

    def __init__(
        self,
        service: PolicyService,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 1_048_576,
    ) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1`` (the port picked at start)."""
        if self._server is None:
            raise RuntimeError("the policy endpoint is not started")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> str:
        import uvicorn

        class EmbeddedServer(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield  # the run handles SIGINT/SIGTERM (graceful stop), not the endpoint

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio switches Nagle's algorithm off (TCP_NODELAY) only on
        # sockets whose proto says TCP, and a response written as headers then body would
        # otherwise wait out the client's delayed ACK, about 40 ms a call (measured here).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(
                f"policy.generation.http_server: cannot bind {self.host}:{self.port} ({exc}); "
                "pick another host/port (port 0 picks a free one)"
            ) from exc
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.service, max_request_bytes=self.max_request_bytes),
            http=_http_parser(),
            loop="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # no proxy in front of a loopback endpoint: nothing to rewrite
            timeout_graceful_shutdown=2,
            # Idle connections stay open well past the client's own keep-alive expiry
            # (runner.CLIENT_KEEPALIVE_S): were the two equal (uvicorn's and httpx's default,
            # 5 s), a client could reuse a connection the server was closing that instant and
            # the call fail as "Request timed out" (255 such calls in 86 steps of one
            # exemplar run; none in about 450 steps since: docs/benchmarks.md).
            timeout_keep_alive=SERVER_KEEPALIVE_S,
        )
        self._server = EmbeddedServer(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="policy-endpoint"
        )
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup failure
                raise RuntimeError("the policy endpoint stopped while starting")
            await asyncio.sleep(0.005)
        log.info("policy endpoint serving at %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5.0)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
