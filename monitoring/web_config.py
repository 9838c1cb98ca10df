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
import binascii
import importlib.util
import os
import re
import socket
import ssl
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from pydantic import BaseModel, ConfigDict, Field

from r9k.config_errors import decode_config_text, parse_yaml_model, read_config_bytes

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


AUTH_CHECKS_AT_ONCE = 2        # bcrypt checks running at once; more wait this long, then 503
AUTH_WAIT_S = 0.5
AUTH_CACHE_SIZE = 64           # Authorization headers that passed, kept (as digests) to skip bcrypt


class BasicAuth:
    """bcrypt basic auth that wrong guesses cannot use to starve real scrapes or to learn names:
    at most AUTH_CHECKS_AT_ONCE checks run at once (the rest wait AUTH_WAIT_S, then 503); a header
    that passed is remembered (its SHA-256), so the scraper does not queue behind guesses; an
    unknown user costs a bcrypt check of the same cost as the known users' hashes."""

    def __init__(self, users: dict[str, str]) -> None:
        import bcrypt

        self.users = users
        cost = max(int(h.split("$")[2]) for h in users.values())
        self._dummy = bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(rounds=cost))
        self._slots = threading.BoundedSemaphore(AUTH_CHECKS_AT_ONCE)
        self._passed: dict[bytes, None] = {}
        self._lock = threading.Lock()

    def check(self, header: str) -> bool | None:
        """True (pass), False (401), None (too many checks at once: 503)."""
        import hashlib

        import bcrypt

        digest = hashlib.sha256(header.encode(errors="surrogateescape")).digest()
        with self._lock:
            if digest in self._passed:
                return True
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if not self._slots.acquire(timeout=AUTH_WAIT_S):
            return None
        try:
            ok = bcrypt.checkpw(password.encode(), hashed.encode() if hashed else self._dummy)
        finally:
            self._slots.release()
        ok = bool(sep) and hashed is not None and ok
        if ok:
            with self._lock:
                self._passed[digest] = None
                while len(self._passed) > AUTH_CACHE_SIZE:
                    self._passed.pop(next(iter(self._passed)))
        return ok


def _guarded(app, users: dict[str, str]):
    auth = BasicAuth(users)

    def guarded_app(environ, start_response):
        verdict = auth.check(environ.get("HTTP_AUTHORIZATION", ""))
        if verdict:
            return app(environ, start_response)
        if verdict is None:
            start_response("503 Service Unavailable", [("Retry-After", "1"),
                                                       ("Content-Type", "text/plain; charset=utf-8")])
            return [b"Too many authentication attempts at once\n"]
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="r9k exporter"'),
                                             ("Content-Type", "text/plain; charset=utf-8")])
        return [b"Unauthorized\n"]
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
