"""The shared secret of a ``grpo-run serve`` server: an ASGI middleware that vLLM's own server
loads (``--middleware grpo_plugins.vllm.guard.SharedSecret``, passed by ``grpo-run serve``
whenever a secret is set) and that refuses every request without ``Authorization: Bearer
<secret>``, the secret being the server's ``GRPO_SERVE_SECRET``.

Why vLLM's ``--api-key`` is not enough: its check covers only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``), while the
routes that replace the model's weights (``/init_weight_transfer_engine``,
``/update_weights``, ...), ``/collective_rpc`` (which runs a method in every worker) and
``/reset_prefix_cache`` lie outside them. This guard covers every path except ``/health`` (a
readiness probe, which changes nothing) and CORS pre-flight ``OPTIONS`` requests. The learner
sends the same header on every request (the ``vllm-server`` backend's ``secret_env``), which
also satisfies vLLM's ``--api-key`` when it is the same value (``grpo-run serve`` refuses two
different ones).

Plain ASGI and the standard library: nothing here imports vLLM or Starlette.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

__all__ = ["OPEN_PATHS", "SECRET_ENV", "SharedSecret"]

#: The environment variable holding the secret, on the server and (by default) on the learner.
SECRET_ENV = "GRPO_SERVE_SECRET"
#: Paths served without the secret: they change nothing and reveal nothing of the model.
OPEN_PATHS = ("/health",)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class SharedSecret:
    """ASGI middleware: requests (HTTP and websocket) without ``Authorization: Bearer
    <secret>`` get 401 (a websocket is closed with code 1008), except :data:`OPEN_PATHS` and
    ``OPTIONS``. ``secret``: default, the environment's :data:`SECRET_ENV` (how vLLM makes it:
    ``app.add_middleware(SharedSecret)``); an empty secret is refused at start."""

    def __init__(self, app: Any, secret: str | None = None) -> None:
        secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        if not secret:
            raise RuntimeError(f"grpo-run serve: the shared-secret guard needs {SECRET_ENV} to be set")
        self.app = app
        self._digest = _digest(secret)

    def allows(self, scope: dict[str, Any]) -> bool:
        """Whether the request of ``scope`` may pass."""
        if scope.get("method") == "OPTIONS":
            return True
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path in OPEN_PATHS:
            return True
        given = next((v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), b"")
        scheme, _, token = given.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._digest)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this grpo-run serve server wants its shared secret "
                                    "(Authorization: Bearer <GRPO_SERVE_SECRET>)"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})
