"""Client for the LACT daemon socket: newline-delimited JSON requests and responses.

Request ``{"command": "<snake_case>", "args": {...}}``; response ``{"status": "ok"|"error",
"data": ...}``. Changes made with ``set_gpu_config`` are reverted by the daemon unless confirmed
with ``confirm_pending_config`` within its ``apply_settings_timer`` (5 s by default).
"""
from __future__ import annotations

import json
import socket
import time
from typing import Any

# LACT's replies are small JSON documents (device lists, stats, configs): far below this.
MAX_REPLY_BYTES = 4 * 1024 * 1024


class LactError(Exception):
    """The daemon is unreachable, answered an error, or spoke something else than its protocol."""


def bdf_of_gpu_id(gpu_id: str) -> str:
    """``1002:7551-1002:0e0d-0000:03:00.0`` -> ``0000:03:00.0``."""
    parts = gpu_id.split("-", 2)
    if len(parts) != 3:
        raise LactError(f"unexpected LACT GPU id {gpu_id!r}, expected VEND:DEV-SUBVEND:SUBDEV-PCI_SLOT")
    return parts[2].lower()


class LactClient:
    """``timeout_s`` bounds a whole request (connect, send, the complete reply), not each read:
    a daemon that trickles bytes cannot hold ``apply`` past it."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0, max_reply_bytes: int = MAX_REPLY_BYTES):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes

    def request(self, command: str, args: dict[str, Any] | None = None) -> Any:
        payload = {"command": command}
        if args is not None:
            payload["args"] = args
        deadline = time.monotonic() + self.timeout_s

        def remaining_s() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LactError(f"LACT {command}: no complete reply within {self.timeout_s:g} s "
                                f"(socket {self.socket_path})")
            return left

        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(remaining_s())
                sock.connect(self.socket_path)
                sock.settimeout(remaining_s())
                sock.sendall(json.dumps(payload).encode() + b"\n")
                buf = bytearray()
                while not buf.endswith(b"\n"):
                    sock.settimeout(remaining_s())
                    try:
                        chunk = sock.recv(65536)
                    except socket.timeout:
                        remaining_s()
                        raise
                    if not chunk:
                        break
                    buf += chunk
                    if len(buf) > self.max_reply_bytes:
                        raise LactError(f"LACT {command}: reply larger than {self.max_reply_bytes} bytes "
                                        "without an end of line (not LACT's protocol)")
        except FileNotFoundError:
            raise LactError(f"LACT socket {self.socket_path} does not exist (is lactd running?)") from None
        except OSError as exc:
            raise LactError(f"LACT socket {self.socket_path}: {exc.strerror or exc}") from None
        try:
            response = json.loads(buf.decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise LactError(f"LACT {command}: not a JSON response: {bytes(buf[:120])!r}") from None
        if not isinstance(response, dict) or response.get("status") not in ("ok", "error"):
            raise LactError(f"LACT {command}: unexpected response {str(response)[:120]}")
        if response["status"] == "error":
            raise LactError(f"LACT {command} failed: {response.get('data')}")
        return response.get("data")

    def ping(self) -> bool:
        try:
            self.request("ping")
            return True
        except LactError:
            return False

    def gpu_ids_by_bdf(self) -> dict[str, str]:
        devices = self.request("list_devices")
        if not isinstance(devices, list):
            raise LactError(f"LACT list_devices: expected a list, got {type(devices).__name__}")
        out = {}
        for dev in devices:
            gpu_id = dev.get("id") if isinstance(dev, dict) else dev
            if isinstance(gpu_id, str):
                out[bdf_of_gpu_id(gpu_id)] = gpu_id
        return out

    def get_gpu_config(self, gpu_id: str) -> dict[str, Any]:
        data = self.request("get_gpu_config", {"id": gpu_id})
        return data if isinstance(data, dict) else {}

    def set_gpu_config(self, gpu_id: str, config: dict[str, Any]) -> Any:
        return self.request("set_gpu_config", {"id": gpu_id, "config": config})

    def confirm(self) -> None:
        self.request("confirm_pending_config", {"command": "confirm"})

    def revert(self) -> None:
        self.request("confirm_pending_config", {"command": "revert"})
