"""The HTTP layer: routes, bodies read with limits, every error a JSON body, streams that end
quietly when the client hangs up.

    GET  /health  /v1/models  /v1/models/<id>
    POST /v1/completions  /v1/chat/completions        OpenAI (mlxbun.serve.openai_api)
    POST /v1/messages  /v1/messages/count_tokens      Anthropic (mlxbun.serve.anthropic_api)

A body is read only when it declares its size (``Content-Length``, at most :data:`MAX_BODY`);
JSON too deep for Python's reader, a lone surrogate, another method (PUT, DELETE, ...) or a
malformed request line each get a JSON 4xx in the route's error shape. A handler waiting for
its tokens checks that its client is still connected, and stops the job when it is not.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import sys
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlxbun.errors import InputError
from mlxbun.serve import anthropic_api, checks, openai_api
from mlxbun.serve.checks import BadRequest
from mlxbun.serve.engine import Engine, Job
from mlxbun.serve.text import ClientGone, Context

log = logging.getLogger("mlxbun")

MAX_BODY = 32 * 2**20  # bytes of a request body: far above any prompt a context holds
ROUTES = {
    "/v1/completions": "text",
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count",
}


@dataclass
class App:
    """What every handler shares."""

    engine: Engine
    ctx: Context
    created: int  # the model's time, for /v1/models


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted: a burst of clients is not reset

    def __init__(self, address: tuple[str, int], app: App) -> None:
        self.app = app
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is no error; anything else is logged once."""
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        log.exception("serve: a connection from %s failed", client_address[0])


def client_alive(sock: socket.socket) -> bool:
    """False once the peer has closed (or reset) the connection; never blocks."""
    poll = select.poll()
    poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    ready = poll.poll(0)
    if not ready:
        return True
    if ready[0][1] & (select.POLLERR | select.POLLHUP):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


class Out:
    """What a reply writes: one JSON body, or a chunked stream of server-sent events."""

    def __init__(self, handler: Handler) -> None:
        self.h = handler

    def alive(self) -> bool:
        return client_alive(self.h.connection)

    def json(self, status: int, doc: dict[str, Any]) -> None:
        self.h.send_json(status, doc)

    def open_stream(self) -> None:
        self.h.send_response(200)
        self.h.send_header("Content-Type", "text/event-stream")
        self.h.send_header("Cache-Control", "no-cache")
        self.h.send_header("Transfer-Encoding", "chunked")
        self.h.end_headers()

    def event(self, doc: dict[str, Any], name: str | None = None) -> None:
        head = f"event: {name}\n" if name else ""
        self.raw(f"{head}data: {json.dumps(doc)}\n\n".encode())

    def raw(self, data: bytes) -> None:
        self.h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.h.wfile.flush()

    def close_stream(self) -> None:
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()


class Handler(BaseHTTPRequestHandler):
    """One connection; requests on it one after another (HTTP/1.1 keep-alive)."""

    server: Server
    protocol_version = "HTTP/1.1"
    timeout = 120  # seconds a client may stall a read or a write

    def log_message(self, format: str, *args: Any) -> None:  # the engine logs each request
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method, headers too
        long) as JSON; an unknown method is 405, not 501."""
        code = 405 if code == HTTPStatus.NOT_IMPLEMENTED else code
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # an unreadable request line: answer with headers anyway
            self.request_version = "HTTP/1.0"
        text = message or HTTPStatus(code).phrase
        if code == 405:
            text = f"method {self.command} is not served; use GET or POST"
        self.send_json(code, openai_api.error_body(BadRequest(text, status=code)))

    def send_json(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 405:
            self.send_header("Allow", "GET, POST")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        self.send_error(405)

    do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_PUT

    def do_GET(self) -> None:
        app, path = self.server.app, self.path.split("?")[0]
        if path == "/health":
            ok = app.engine.alive and not app.engine.stopping
            doc = {"status": "ok" if ok else "stopping", "running": app.engine.running}
            self.send_json(200 if ok else 503, doc | {"waiting": app.engine.inbox.qsize()})
        elif path == "/v1/models":
            self.send_json(200, openai_api.models(app.ctx.model_id, app.created))
        elif path.startswith("/v1/models/") and path[len("/v1/models/") :] == app.ctx.model_id:
            self.send_json(200, openai_api.model(app.ctx.model_id, app.created))
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            e = BadRequest(f"the model {name!r} is not served here", status=404, code="model_not_found")
            self.send_json(404, openai_api.error_body(e))
        else:
            self.send_json(404, openai_api.error_body(BadRequest(f"no route GET {path}", status=404)))

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        route = ROUTES.get(path)
        api = anthropic_api if route in ("messages", "count") else openai_api
        try:
            if route is None:
                raise BadRequest(f"no route POST {path}", status=404)
            body = self.body()
            checks.no_surrogates(body)
            job, opts = self.job(route, body)
        except RecursionError:  # a structure too deep for some check: refused, not a 500
            self.send_json(400, api.error_body(BadRequest("the body nests JSON deeper than it can be read")))
            return
        except BadRequest as e:
            self.send_json(e.status, api.error_body(e))
            return
        if job is None:
            return
        self.server.app.engine.submit(job)
        try:
            api.reply(job, Out(self), self.server.app.ctx, opts)
        except (ClientGone, OSError):
            job.stop()
            self.close_connection = True

    def job(self, route: str, body: dict[str, Any]) -> tuple[Job | None, dict[str, Any]]:
        ctx = self.server.app.ctx
        if route == "count":
            self.send_json(200, {"input_tokens": len(anthropic_api.tokens(body, ctx))})
            return None, {}
        if route == "messages":
            request, opts = anthropic_api.request(body, ctx)
        else:
            request, opts = openai_api.request(route, body, ctx)
        return Job(request), opts

    def body(self) -> dict[str, Any]:
        """The request's JSON object, read only when its declared size is allowed."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise BadRequest("a chunked body is not read; send Content-Length", status=411)
        raw = (self.headers.get("Content-Length") or "").strip()
        if not raw.isdigit():
            self.close_connection = True
            what = f"not {raw!r}" if raw else "and it is missing"
            raise BadRequest(
                f"Content-Length must be the body's size in bytes, {what}", status=411 if not raw else 400
            )
        if int(raw) > MAX_BODY:
            self.close_connection = True  # the body is never read
            raise BadRequest(f"the body is {int(raw)} bytes; at most {MAX_BODY} are read", status=413)
        data = self.rfile.read(int(raw))
        try:
            body = json.loads(data)
        except RecursionError:
            raise BadRequest("the body nests JSON deeper than it can be read") from None
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body


def listen(host: str, port: int, app: App | None) -> Server:
    """Bind the server (``app`` is set before it serves); a bad address names its key."""
    try:
        server = Server((host, port), app)  # type: ignore[arg-type]
    except socket.gaierror as e:
        raise InputError(
            f"serve.host={host!r}: not an address of this machine ({e.strerror}); try 127.0.0.1 or 0.0.0.0"
        ) from None
    except OSError as e:
        if e.errno in (99, 49):  # EADDRNOTAVAIL (Linux, macOS): the host is not this machine's
            raise InputError(
                f"serve.host={host!r}: cannot listen there ({e.strerror}); try 127.0.0.1 or 0.0.0.0"
            ) from None
        raise InputError(
            f"serve.port={port}: cannot listen on {host}:{port} ({e.strerror}); choose another serve.port"
            " (0 picks a free one) or serve.host"
        ) from None
    return server
