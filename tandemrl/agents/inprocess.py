"""An in-process client with the surface of ``openai.AsyncOpenAI``, for agents that need no HTTP.

``client.chat.completions.create(...)`` and ``client.completions.create(...)`` take the same
keyword arguments as the official client's (``extra_body`` merged into the body, the
client-only options ``extra_headers``/``extra_query``/``timeout`` ignored) and return the
same objects (``openai.types.chat.ChatCompletion``, ``openai.types.Completion``, token fields
in ``model_extra``); a refused call raises the official client's exception for that status
(``openai.BadRequestError``, ``AuthenticationError``, ``ConflictError``,
``InternalServerError``). Behind both is the same ``PolicyService`` as behind the HTTP
endpoint, so an agent sees the same answers and every call is captured the same way; only
the HTTP transport (client, sockets, server) is skipped.
"""

from __future__ import annotations

from typing import Any

from tandemrl.agents.service import PolicyService, RequestError

# Options of the official client's create() that shape the HTTP call, not the request body.
CLIENT_ONLY_OPTIONS = frozenset({"extra_headers", "extra_query", "timeout"})


def _request_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    from openai import NOT_GIVEN

    body = {
        name: value
        for name, value in kwargs.items()
        if name not in CLIENT_ONLY_OPTIONS and name != "extra_body" and value is not NOT_GIVEN
    }
    extra = kwargs.get("extra_body")
    if extra:
        body.update(extra)
    return body


def status_error(error: RequestError, url: str) -> Exception:
    """The official client's exception for ``error``'s status (what it raises over HTTP)."""
    import openai

    try:
        import httpx2 as httpx  # what openai >= 3 speaks
    except ImportError:  # pragma: no cover - older openai releases use httpx
        import httpx  # type: ignore[no-redef]

    body = error.body()
    response = httpx.Response(error.status, request=httpx.Request("POST", url), json=body)
    message = f"Error code: {error.status} - {body}"
    data = body["error"]
    classes: dict[int, type[openai.APIStatusError]] = {
        400: openai.BadRequestError,
        401: openai.AuthenticationError,
        409: openai.ConflictError,
    }
    if error.status >= 500:
        return openai.InternalServerError(message, response=response, body=data)
    status_class = classes.get(error.status, openai.APIStatusError)
    return status_class(message, response=response, body=data)


class _ChatCompletions:
    def __init__(self, client: InProcessClient) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> Any:
        from openai.types.chat import ChatCompletion

        client = self._client
        try:
            answer = await client.service.chat(client.api_key, _request_body(kwargs))
        except RequestError as error:
            raise status_error(error, "inprocess://v1/chat/completions") from None
        return ChatCompletion.model_validate(answer)


class _Chat:
    def __init__(self, client: InProcessClient) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: InProcessClient) -> None:
        self._client = client

    async def create(self, **kwargs: Any) -> Any:
        from openai.types import Completion

        client = self._client
        try:
            answer = await client.service.completion(client.api_key, _request_body(kwargs))
        except RequestError as error:
            raise status_error(error, "inprocess://v1/completions") from None
        return Completion.model_validate(answer)


class InProcessClient:
    """``openai.AsyncOpenAI``'s chat and completions surface over a ``PolicyService``."""

    base_url = None  # no HTTP endpoint: an external process cannot use this client

    def __init__(self, service: PolicyService, api_key: str) -> None:
        self.service = service
        self.api_key = api_key
        self.chat = _Chat(self)
        self.completions = _Completions(self)

    def with_options(self, *, api_key: str | None = None, **_options: Any) -> InProcessClient:
        return InProcessClient(self.service, self.api_key if api_key is None else api_key)
