"""`--api-key`: every route but /health needs the key, as in llama-server (tools/server/server-http.cpp):
``Authorization: Bearer KEY`` (what the `openai` client sends) or ``X-Api-Key: KEY``; a wrong or
missing key is a 401 with an OpenAI-style error object. A pure ASGI middleware, so streamed answers
and disconnect notices pass through untouched."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from saem_gguf.serving.protocol import ApiError

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
INVALID_KEY = ApiError(401, "Invalid API Key", "authentication_error", "invalid_api_key")


def presented_key(headers: Headers) -> str:
    key = headers.get("authorization") or headers.get("x-api-key") or ""
    return key.removeprefix("Bearer ")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = tuple(k.encode("utf-8") for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = presented_key(Headers(scope=scope)).encode("utf-8", errors="surrogateescape")
        # constant time: a key is not guessed byte by byte
        if any([hmac.compare_digest(given, key) for key in self._keys]):
            await self.app(scope, receive, send)
            return
        await JSONResponse(INVALID_KEY.body(), status_code=INVALID_KEY.status,
                           headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
