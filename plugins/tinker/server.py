"""The HTTP side of tinker-serve: the routes of the Tinker SDK (``/api/v1/...``, read from SDK
0.38's resources), its API-key check, and its futures.

Every training and sampling call is a future, as on Tinker: the POST queues the work and
answers ``{"request_id": ...}`` at once; one worker thread runs the queue in arrival order
(the SDK sends each training client's calls in its own order); ``/api/v1/retrieve_future``
answers ``{"type": "try_again"}`` while the work waits (after holding the poll up to
``POLL_S``), then the result: JSON, or protobuf for ``forward_backward`` and ``sample``, or
``{"error": ..., "category": "user"}``, which the SDK raises as ``RequestFailedError`` with the
message. A refused request answers 4xx with ``{"detail": message}`` and ``x-should-retry:
false``; the SDK raises it with the message. A route the SDK has that is not served here
answers 404 naming the call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from grpo_plugins.tinker.objectives import check
from grpo_plugins.tinker.sampling import parse, sample
from grpo_plugins.tinker.state import Refused, Service
from grpo_plugins.tinker.wire import decode_forward_backward, encode_forward_backward_output, encode_sample_response
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from grpo_core.errors import fault_text

__all__ = ["NOT_SERVED", "TinkerServer"]

log = logging.getLogger("grpo.tinker")
#: How long a retrieve_future call waits for its result before answering try_again.
POLL_S = 10.0
#: SDK calls whose routes are known and not served, with what the user called.
NOT_SERVED = {
    "copy_weights": "ServiceClient.copy_weights",
    "save_weights_external": "TrainingClient.save_weights_external",
    "create_custom_loss": "ServiceClient.create_custom_loss with server-side custom losses",
    "retrieve_futures": "the retrieve_futures sampling poller",
    "join_sampling_session": "SamplingClient clones joining a sampling session",
    "auth/token": "JWT auth exchange (tinker-serve takes the API key itself)",
    "unload_model": "TrainingClient.unload_model",
    "cancel_future": "sample cancellation",
}
#: What the SDK reads at start (``/api/v1/client/config``): API-key auth, the plain httpx
#: transport, JSON-polled futures, custom losses run by the SDK, chunks sent one by one.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False,
                 "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_len": 4096}


class HTTPRefusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _Future:
    """A queued call's answer. Pollers wait on an asyncio event the worker sets through their
    loop (no busy polling: a spinning poller starves the torch threads of a small machine)."""

    done: threading.Event = field(default_factory=threading.Event)
    body: bytes = b""
    proto: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiters: list = field(default_factory=list)

    def finish(self) -> None:
        with self.lock:
            self.done.set()
            for loop, event in self.waiters:
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seconds: float) -> bool:
        event = asyncio.Event()
        with self.lock:
            if self.done.is_set():
                return True
            self.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return self.done.is_set()


@dataclass
class _SampleJob:
    """A queued sample request; consecutive ones with the same key run as one batch."""

    request: Any


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status, {"x-should-retry": "false"}, media_type="application/json")


class TinkerServer:
    """tinker-serve: :class:`~grpo_plugins.tinker.state.Service` behind the SDK's routes, on
    ``host:port`` (port 0: a free one), in a thread of its own; :meth:`close` stops it."""

    def __init__(self, service: Service, api_keys: set[str], host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 64 << 20):
        self.service, self.api_keys, self.max_request_bytes = service, set(api_keys), max_request_bytes
        self.futures: dict[str, _Future] = {}
        self.work: queue.Queue[tuple[_Future, Any] | None] = queue.Queue()
        self.ids = itertools.count()
        posts: dict[str, Callable] = {
            "client/config": lambda b: CLIENT_CONFIG, "client/dynamic_config": lambda b: {},
            "create_session": lambda b: {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:12]}"},
            "session_heartbeat": lambda b: {"type": "session_heartbeat"},
            "telemetry": lambda b: {"status": "accepted"},
            "get_info": self._get_info, "create_sampling_session": self._create_sampling_session,
            "create_model": self._create_model, "optim_step": self._optim_step, "save_weights": self._save_weights,
            "load_weights": self._load_weights, "save_weights_for_sampler": self._save_for_sampler,
            "asample": self._sample,
        }
        routes = [Route(f"/api/v1/{name}", self._post(fn), methods=["POST"]) for name, fn in posts.items()]
        routes += [
            Route("/api/v1/healthz", lambda r: _json({"status": "ok"}), methods=["GET"]),
            Route("/api/v1/get_server_capabilities", self._guard(self._capabilities), methods=["GET"]),
            Route("/api/v1/forward_backward", self._guard(self._forward_backward), methods=["POST"]),
            Route("/api/v1/retrieve_future", self._guard(self._retrieve), methods=["POST"]),
            Route("/api/v1/sessions/{session}/finish", self._guard(self._finish), methods=["POST"]),
            Route("/api/v1/samplers/{sampler}", self._guard(self._sampler), methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._no_route})
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(512)
        config = uvicorn.Config(app, http="h11", loop="asyncio", ws="none", lifespan="off", log_config=None,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.worker = threading.Thread(target=self._run_queue, name="tinker-serve-worker", daemon=True)
        self.worker.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="tinker-serve-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("tinker-serve's HTTP server did not start (see the log above)")
            time.sleep(0.005)

    @property
    def base_url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.work.put(None)
        self.worker.join(timeout=10)
        self.socket.close()

    # ------------------------------------------------------------------ plumbing
    def _run_queue(self) -> None:
        while (item := self.work.get()) is not None:
            if isinstance(item[1], _SampleJob):
                self._run_samples([item, *self._more_samples(item[1].request.key)])
                continue
            future, job = item
            try:
                future.body, future.proto = job()
            except Exception as exc:  # noqa: BLE001 - answered to the client (and logged when not a refusal)
                self._fail(future, exc)
            future.finish()

    def _fail(self, future: _Future, exc: Exception) -> None:
        if isinstance(exc, Refused):
            future.body = json.dumps({"error": str(exc), "category": "user"}).encode()
            return
        log.warning("tinker-serve failed on a request", exc_info=exc)
        future.body = json.dumps({"error": f"tinker-serve failed: {fault_text(exc)}", "category": "server"}).encode()

    def _more_samples(self, key: tuple) -> list[tuple[_Future, _SampleJob]]:
        """The sample jobs with ``key`` at the head of the queue, taken off it (up to 64)."""
        taken = []
        with self.work.mutex:
            pending = self.work.queue
            while pending and len(taken) < 64 and isinstance(pending[0], tuple) and \
                    isinstance(pending[0][1], _SampleJob) and pending[0][1].request.key == key:
                taken.append(pending.popleft())
        return taken

    def _run_samples(self, items: list[tuple[_Future, _SampleJob]]) -> None:
        try:
            answers = sample(self.service, [job.request for _, job in items])
            for (future, _), answer in zip(items, answers, strict=True):
                future.body, future.proto = encode_sample_response(*answer), True
        except Exception as exc:  # noqa: BLE001
            for future, _ in items:
                self._fail(future, exc)
        for future, _ in items:
            future.finish()

    def _queue(self, job: Callable[[], Any], proto: bool = False) -> dict[str, str]:
        """Queue ``job`` (returning JSON-able data, or protobuf bytes when ``proto``); the future's id."""
        request_id = f"req-{next(self.ids)}"
        future = self.futures[request_id] = _Future()
        self.work.put((future, (lambda: (job(), True)) if proto else (lambda: (json.dumps(job()).encode(), False))))
        return {"request_id": request_id}

    async def _read(self, http: Request) -> bytes:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise HTTPRefusal(413, f"request body of {declared} bytes; tinker-serve takes at most "
                                   f"{self.max_request_bytes} (--max-request-bytes)")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise HTTPRefusal(413, f"request body over {self.max_request_bytes} bytes (--max-request-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _guard(self, handler: Callable) -> Callable:
        async def route(http: Request) -> Response:
            try:
                if http.headers.get("x-api-key") not in self.api_keys:
                    raise HTTPRefusal(401, f"{http.url.path}: missing or unknown API key (X-API-Key); tinker-serve "
                                           "takes the keys given to it with --api-key")
                return await handler(http)
            except (HTTPRefusal, Refused) as exc:
                return _json({"detail": str(exc)}, getattr(exc, "status", 400))
            except (KeyError, TypeError, ValueError) as exc:  # a body without a field the route reads
                return _json({"detail": f"{http.url.path}: bad request body ({fault_text(exc)})"}, 400)
            except Exception as exc:  # noqa: BLE001
                log.warning("tinker-serve failed on %s", http.url.path, exc_info=True)
                return _json({"detail": f"tinker-serve failed on {http.url.path}: {fault_text(exc)}"}, 500)
        return route

    def _post(self, fn: Callable[[dict], Any]) -> Callable:
        async def handler(http: Request) -> Response:
            data = await self._read(http)
            try:
                body = json.loads(data or b"{}")
            except json.JSONDecodeError as exc:
                raise HTTPRefusal(400, f"{http.url.path}: the body is not JSON ({exc})") from None
            return _json(fn(body))
        return self._guard(handler)

    async def _no_route(self, http: Request, exc: HTTPException) -> Response:
        name = http.url.path.removeprefix("/api/v1/")
        what = NOT_SERVED.get(name) or ("the REST checkpoint listing" if name.startswith("training_runs") else None)
        detail = (f"tinker-serve does not serve {http.method} {http.url.path} ({what})" if what else
                  f"tinker-serve has no route {http.method} {http.url.path}")
        return _json({"detail": detail}, 404 if exc.status_code == 404 else exc.status_code)

    # ------------------------------------------------------------------ routes
    async def _capabilities(self, http: Request) -> Response:
        model = {"model_name": self.service.name, "max_context_length": self.service.max_context,
                 "trainable": True, "sampleable": True}
        return _json({"supported_models": [model]})

    async def _finish(self, http: Request) -> Response:
        return _json(None)

    async def _sampler(self, http: Request) -> Response:
        sampler = http.path_params["sampler"]
        if sampler not in self.service.sampling_sessions:
            raise HTTPRefusal(404, f"no sampling session {sampler!r} on this server")
        return _json({"sampler_id": sampler, "base_model": self.service.name,
                      "model_path": self.service.sampling_sessions[sampler]})

    def _get_info(self, body: dict) -> dict:
        client = self.service.client(body["model_id"])
        return {"type": "get_info", "model_id": client.model_id, "is_lora": True, "lora_rank": client.lora["rank"],
                "model_name": self.service.name,
                "model_data": {"arch": type(self.service.model).__name__, "model_name": self.service.name,
                               "tokenizer_id": self.service.path}}

    def _create_model(self, body: dict) -> dict:
        service = self.service
        model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
        return self._queue(lambda: {"type": "create_model", "model_id": service.create_model(
            body["base_model"], body.get("lora_config"), body.get("optimizer_config"), model_id).model_id})

    async def _forward_backward(self, http: Request) -> Response:
        request = decode_forward_backward(await self._read(http), http.headers.get("content-encoding"))
        self.service.client(request.model_id)
        check(request.loss_fn, request.config)  # an unserved loss is refused here, by name

        def job() -> bytes:
            outputs, metrics = self.service.forward_backward(request.model_id, request.loss_fn, request.config,
                                                             request.data, request.forward_only)
            return encode_forward_backward_output(outputs, metrics)
        return _json(self._queue(job, proto=True))

    def _optim_step(self, body: dict) -> dict:
        params = body.get("adam_params")
        if params is None:
            kind = (body.get("optimizer_params") or {}).get("type")
            raise Refused(f"optim_step with {kind!r} parameters is not served; tinker-serve runs Adam (AdamParams)")
        self.service.client(body["model_id"])
        return self._queue(lambda: {"metrics": self.service.optim_step(body["model_id"], params)})

    def _save_weights(self, body: dict) -> dict:
        return self._queue(lambda: {"type": "save_weights",
                                    "path": self.service.save_state(body["model_id"], body.get("path"))})

    def _load_weights(self, body: dict) -> dict:
        model_id = body.get("model_id") or f"{body['session_id']}:train:{int(body['model_seq_id'])}"

        def job() -> dict:
            model_id_loaded = self.service.load_state(body["path"], bool(body.get("optimizer")), model_id)
            return {"type": "load_weights", "path": body["path"], "model_id": model_id_loaded}
        return self._queue(job)

    def _save_for_sampler(self, body: dict) -> dict:
        if body.get("kind", "snapshot") != "snapshot":
            raise Refused(f"save_weights_for_sampler kind {body.get('kind')!r} is not served; tinker-serve takes "
                          "snapshot")

        def job() -> dict:
            path = self.service.save_for_sampler(body["model_id"], body.get("path"))
            if body.get("path") is not None:
                return {"type": "save_weights_for_sampler", "path": path}
            session = self.service.sampling_session(path, None)
            return {"type": "save_weights_for_sampler", "sampling_session_id": session}
        return self._queue(job)

    def _create_sampling_session(self, body: dict) -> dict:
        session = self.service.sampling_session(body.get("model_path"), body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": session}

    def _sample(self, body: dict) -> dict:
        request = parse(self.service, body)
        request_id = f"req-{next(self.ids)}"
        future = self.futures[request_id] = _Future()
        self.work.put((future, _SampleJob(request)))
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}-{i}" for i in range(request.n)]}

    async def _retrieve(self, http: Request) -> Response:
        body = json.loads(await self._read(http) or b"{}")
        request_id = body.get("request_id")
        future = self.futures.get(request_id)
        if future is None:
            raise HTTPRefusal(404, f"retrieve_future: no request {request_id!r} on this server")
        if not await future.wait(POLL_S):
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        del self.futures[request_id]
        if future.proto:
            return Response(future.body, 200, {"x-should-retry": "false"}, media_type="application/x-protobuf")
        return Response(future.body, 200, {"x-should-retry": "false"}, media_type="application/json")
