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
import socket
import ssl
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import yaml
from prometheus_client import CollectorRegistry, make_wsgi_app
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from r9k.config_errors import YamlKeyError, load_yaml_strict, validation_message

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
        data = load_yaml_strict(path.read_text())
    except OSError as exc:
        raise WebConfigError(f"{path}: cannot read the web config file ({exc.strerror})") from None
    except YamlKeyError as exc:
        raise WebConfigError(f"{path}: {exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise WebConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise WebConfigError(f"{path}: expected a mapping with tls_server_config and/or basic_auth_users")
    try:
        config = WebConfig.model_validate(data)
    except ValidationError as exc:
        raise WebConfigError(validation_message(exc, str(path), limit=1)) from None
    for user, hashed in config.basic_auth_users.items():
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash ($2b$...), "
                                 "not a password")
    if config.basic_auth_users and importlib.util.find_spec("bcrypt") is None:
        raise WebConfigError(f"{path}: basic_auth_users needs the bcrypt package "
                             "(pip install 'r9700-stack[auth]')")
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


def _check_basic_auth(header: str, users: dict[str, str]) -> bool:
    import bcrypt

    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    hashed = users.get(user)
    # Unknown users cost a bcrypt check too, so timing does not tell which names exist.
    reference = hashed or "$2b$12$" + "." * 53
    try:
        ok = bcrypt.checkpw(password.encode(), reference.encode())
    except ValueError:
        return False
    return bool(sep) and hashed is not None and ok


def _guarded(app, users: dict[str, str]):
    def guarded_app(environ, start_response):
        if _check_basic_auth(environ.get("HTTP_AUTHORIZATION", ""), users):
            return app(environ, start_response)
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
