"""The exporter's HTTP side: loopback by default, optional TLS and basic auth from a web config
file in node_exporter's format (Prometheus exporter-toolkit), the subset below::

    tls_server_config:
      cert_file: exporter.crt          # relative paths: from the web config file's directory
      key_file: exporter.key
      client_ca_file: prometheus-ca.crt   # optional: with RequireAndVerifyClientCert
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default)
    basic_auth_users:
      prometheus: $2b$12$...           # bcrypt hash (htpasswd -nBC 12 prometheus)

prometheus-client serves TLS itself but has no basic auth, so the WSGI app is served here.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import socket
import ssl
import threading
import time
from collections import deque
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from pydantic import BaseModel, ConfigDict, Field

from r9k.core.config_errors import decode_config_text, parse_yaml_model, read_config_bytes

_BCRYPT_HASH = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
CONNECTION_TIMEOUT_S = 10.0  # a client that connects and says nothing holds one thread this long


class WebConfigError(ValueError):
    """The web config file cannot be used; the message names the file and what was expected."""


class TlsServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    client_ca_file: str | None = None
    client_auth_type: Literal["NoClientCert", "RequireAndVerifyClientCert"] = "NoClientCert"


class WebConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tls_server_config: TlsServerConfig | None = None
    basic_auth_users: dict[str, str] = {}


def load_web_config(path: str | os.PathLike) -> tuple[WebConfig, ssl.SSLContext | None]:
    """The parsed file and its TLS context (certificates loaded now, so a bad file stops start-up)."""
    path = Path(path)
    try:
        text = decode_config_text(read_config_bytes(path), path)
    except OSError as exc:
        raise WebConfigError(f"{path}: cannot read the web config file ({exc.strerror})") from None
    except ValueError as exc:
        raise WebConfigError(str(exc)) from None
    config = parse_yaml_model(text, WebConfig, str(path), WebConfigError,
                              top_level="a mapping with tls_server_config and/or basic_auth_users",
                              limit=1)
    for user, hashed in config.basic_auth_users.items():
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash ($2b$...), "
                                 "not a password")
    if config.basic_auth_users and importlib.util.find_spec("bcrypt") is None:
        raise WebConfigError(f"{path}: basic_auth_users needs the bcrypt package "
                             "(pip install 'r9700-stack[auth]')")
    import bcrypt

    for user, hashed in config.basic_auth_users.items():
        # a malformed hash would make every scrape 401 with nothing logged: refuse it now
        why = None if _BCRYPT_HASH.match(hashed) else f"{len(hashed)} characters in the wrong form"
        if why is None:
            try:
                bcrypt.checkpw(b"", hashed.encode())
            except ValueError as exc:
                why = str(exc)
        if why:
            raise WebConfigError(f"{path}: basic_auth_users.{user}: not a valid bcrypt hash ({why}); "
                                 f"expected $2b$<cost>$ and 53 characters (htpasswd -nBC 12 {user})")
    return config, _tls_context(config.tls_server_config, path)


def _tls_context(tls: TlsServerConfig | None, source: Path) -> ssl.SSLContext | None:
    if tls is None:
        return None
    base = source.parent

    def resolved(name: str) -> str:
        return str(base / name)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(resolved(tls.cert_file), resolved(tls.key_file))
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(f"{source}: tls_server_config: cannot load cert_file {tls.cert_file!r} / "
                             f"key_file {tls.key_file!r} ({exc}); expected a PEM certificate and its key") from None
    if tls.client_auth_type == "RequireAndVerifyClientCert":
        if not tls.client_ca_file:
            raise WebConfigError(f"{source}: tls_server_config: RequireAndVerifyClientCert needs client_ca_file")
        try:
            ctx.load_verify_locations(resolved(tls.client_ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(f"{source}: tls_server_config.client_ca_file {tls.client_ca_file!r}: "
                                 f"cannot load ({exc})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


AUTH_WORKERS = 2               # bcrypt checks running at once (each holds a core for its cost)
AUTH_PENDING_PER_CLIENT = 2    # checks one client address may have queued or running; more: 429
AUTH_PENDING_TOTAL = 1024      # checks queued in all; more: 503
AUTH_WAIT_S = 8.0              # a check not started by then is dropped: 503 (under Prometheus' 10 s)
AUTH_FAILURE_MEMORY_S = 300.0  # a client that failed within this long waits behind clients that did not
AUTH_FAILED_CLIENTS_KEPT = 4096  # addresses remembered as failing (oldest forgotten first)
AUTH_CACHE_SIZE = 64           # Authorization headers that passed, kept (as digests) to skip bcrypt
AUTH_HEADER_MAX_BYTES = 4096   # longer is no credential we could hold: 401 without a check
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt's limit (bcrypt 5 raises past it; Go's bcrypt refuses it too)


def parse_basic_credentials(header: str) -> tuple[str, bytes] | None:
    """``Basic base64(user:password)`` (RFC 7617, UTF-8 user) as (user, password bytes); None for
    anything else. WSGI hands headers over as Latin-1 text, so any byte string arrives here."""
    if len(header) > AUTH_HEADER_MAX_BYTES:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(encoded.strip(), validate=True)
        user, sep, password = raw.partition(b":")
        if not sep:
            return None
        return user.decode("utf-8"), password
    except ValueError:  # binascii.Error, non-ASCII text, UnicodeDecodeError: all ValueErrors
        return None


class _Check:
    __slots__ = ("client", "user", "password", "done", "ok")

    def __init__(self, client: str, user: str, password: bytes) -> None:
        self.client, self.user, self.password = client, user, password
        self.done = threading.Event()
        self.ok = False


class BasicAuth:
    """bcrypt basic auth that wrong guesses cannot use to starve real scrapes or to learn names.

    Checks run on AUTH_WORKERS threads, taken round-robin by client address, and clients that
    failed lately wait behind those that did not: a flood of wrong passwords (from one address or
    many) cannot hold the workers against a scraper, which has not failed. Each client has at
    most AUTH_PENDING_PER_CLIENT checks waiting (more are 429 at once). A header that passed is
    remembered (its SHA-256) and skips bcrypt. Every check costs the same bcrypt work, that of
    the highest cost configured: an unknown user, a user with a cheaper hash (padded with dummy
    checks of costs c .. max-1, which sum to 2^max - 2^c rounds) and an over-long password alike."""

    def __init__(self, users: dict[str, str], workers: int = AUTH_WORKERS) -> None:
        import bcrypt

        self.users = {user: hashed.encode() for user, hashed in users.items()}
        costs = {user: int(hashed.split("$")[2]) for user, hashed in users.items()}
        self.max_cost = max(costs.values())
        needed = {self.max_cost} | {c for cost in costs.values() for c in range(cost, self.max_cost)}
        # hashes of a random password nobody knows: a real check of that cost that fails
        self._dummies = {c: bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(rounds=c)) for c in sorted(needed)}
        self._costs = costs
        self._passed: dict[bytes, None] = {}
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Check]] = {}        # client -> its waiting checks
        self._ready: dict[str, None] = {}                  # clients with checks waiting, in turn order
        self._pending: dict[str, int] = {}                 # client -> checks waiting or running
        self._failed_at: dict[str, float] = {}             # client -> when it last failed
        self._total = 0
        for index in range(workers):
            threading.Thread(target=self._work, name=f"r9k-exporter-auth-{index}", daemon=True).start()

    def check(self, header: str, client: str = "") -> bool | None | str:
        """True (pass), False (401), "busy" for this client (429), None when no worker took the
        check in time (503)."""
        digest = hashlib.sha256(header.encode("utf-8", "surrogateescape")).digest()
        with self._cond:
            if digest in self._passed:
                return True
        credentials = parse_basic_credentials(header)
        if credentials is None:
            return False
        job = _Check(client, *credentials)
        with self._cond:
            if self._pending.get(client, 0) >= AUTH_PENDING_PER_CLIENT:
                return "busy"
            if self._total >= AUTH_PENDING_TOTAL:
                return None
            self._pending[client] = self._pending.get(client, 0) + 1
            self._total += 1
            self._queues.setdefault(client, deque()).append(job)
            self._ready.setdefault(client, None)
            self._cond.notify()
        if not job.done.wait(AUTH_WAIT_S):
            with self._cond:
                queue = self._queues.get(client)
                if queue is not None and job in queue:  # not started: drop it
                    queue.remove(job)
                    self._release(client)
                    return None
            job.done.wait()  # running: one check's time at most
        if job.ok:
            with self._cond:
                self._passed[digest] = None
                while len(self._passed) > AUTH_CACHE_SIZE:
                    self._passed.pop(next(iter(self._passed)))
        return job.ok

    def _release(self, client: str) -> None:
        """One check of ``client`` left the queue (run or dropped); called with the lock held."""
        self._total -= 1
        self._pending[client] -= 1
        if not self._pending[client]:
            del self._pending[client]
        if not self._queues.get(client):
            self._queues.pop(client, None)
            self._ready.pop(client, None)

    def _next(self) -> _Check:
        """The next check: clients without a recent failure first, each client in turn."""
        with self._cond:
            while not self._ready:
                self._cond.wait()
            since = time.monotonic() - AUTH_FAILURE_MEMORY_S
            client = next((c for c in self._ready if self._failed_at.get(c, since) <= since),
                          next(iter(self._ready)))
            job = self._queues[client].popleft()
            del self._ready[client]
            if self._queues[client]:
                self._ready[client] = None  # back of the line
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            try:
                job.ok = self.verify(job.user, job.password)
            except Exception:  # noqa: BLE001  (a worker that died would shrink the pool for good)
                job.ok = False
            finally:
                with self._cond:
                    self._failed_at.pop(job.client, None)
                    if not job.ok:
                        self._failed_at[job.client] = time.monotonic()  # newest last
                        if len(self._failed_at) > AUTH_FAILED_CLIENTS_KEPT:
                            self._failed_at.pop(next(iter(self._failed_at)))
                    self._release(job.client)
                job.done.set()

    def verify(self, user: str, password: bytes) -> bool:
        """bcrypt, always 2^max_cost rounds of work, whatever the user and password."""
        import bcrypt

        hashed = self.users.get(user)
        if hashed is None or len(password) > BCRYPT_MAX_PASSWORD_BYTES:
            bcrypt.checkpw(b"", self._dummies[self.max_cost])
            return False
        try:
            ok = bcrypt.checkpw(password, hashed)
        except ValueError:  # a password bcrypt refuses (NUL handling differs between versions)
            ok = False
        for cost in range(self._costs[user], self.max_cost):
            bcrypt.checkpw(b"", self._dummies[cost])
        return ok


def _guarded(app, users: dict[str, str]):
    auth = BasicAuth(users)

    def plain(start_response, status: str, body: bytes, *headers: tuple[str, str]) -> list[bytes]:
        start_response(status, [*headers, ("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    def guarded_app(environ, start_response):
        verdict = auth.check(environ.get("HTTP_AUTHORIZATION", ""), environ.get("REMOTE_ADDR", ""))
        if verdict is True:
            return app(environ, start_response)
        if verdict == "busy":
            return plain(start_response, "429 Too Many Requests",
                         b"Too many authentication attempts from this address at once\n", ("Retry-After", "1"))
        if verdict is None:
            return plain(start_response, "503 Service Unavailable",
                         b"Too many authentication attempts at once\n", ("Retry-After", "1"))
        return plain(start_response, "401 Unauthorized", b"Unauthorized\n",
                     ("WWW-Authenticate", 'Basic realm="r9k exporter"'))
    return guarded_app


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, *args) -> None:  # a scrape every 15 s is not news
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 dropped connects under 50 scrapes)

    def handle_error(self, request, client_address) -> None:
        pass  # a failed handshake or a client gone mid-answer: that client's problem, not a traceback


def serve(registry: CollectorRegistry, port: int, listen: str = "127.0.0.1",
          web: tuple[WebConfig, ssl.SSLContext | None] | None = None):
    """Start the HTTP(S) server in a daemon thread; returns (server, thread). Port 0 picks a free one."""
    config, tls = web if web is not None else (WebConfig(), None)
    app = make_wsgi_app(registry)
    if config.basic_auth_users:
        app = _guarded(app, config.basic_auth_users)

    class Server(_Server):
        address_family = socket.AF_INET6 if ":" in listen else socket.AF_INET

    httpd = make_server(listen.strip("[]"), port, app, Server, handler_class=_Handler)
    if tls is not None:
        # The handshake runs in the connection's own thread (first read), not in accept().
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=httpd.serve_forever, name="r9k-exporter-http", daemon=True)
    thread.start()
    return httpd, thread
