"""A LACT daemon double for tests: a real Unix socket server speaking LACT's JSON-lines protocol.

It stands in for lactd plus the kernel on a fixture tree (:mod:`doubles.ops_host`): applying a
config writes ``power1_cap`` (microwatts) and the committed offset into the tree, so the same
sysfs read-back a real host uses sees the change. Like lactd, every ``set_gpu_config`` is reverted
unless ``confirm_pending_config`` confirms it within ``apply_settings_timer`` seconds (default 5).

    with LactDouble(socket_path, host_root) as lact: ...   # lact.requests lists commands seen
"""
from __future__ import annotations

import json
import os
import socketserver
import threading
from pathlib import Path
from typing import Any

import yaml

from doubles import ops_host as fixtures
from r9k.ops.sysfs import discover_cards


class LactDouble:
    def __init__(
        self,
        socket_path: str | os.PathLike,
        host_root: str | os.PathLike,
        apply_settings_timer: float = 5.0,
        config_path: str | os.PathLike | None = None,
        ignore_cap_for: set[str] | None = None,
        fail_commands: dict[str, str] | None = None,
        reply_mode: str = "normal",
    ):
        self.socket_path = str(socket_path)
        self.host_root = Path(host_root)
        self.apply_settings_timer = apply_settings_timer
        self.config_path = Path(config_path) if config_path else None
        self.ignore_cap_for = set(ignore_cap_for or ())  # cards whose firmware does not take a cap
        self.fail_commands = dict(fail_commands or {})  # command -> error message to answer
        # A misbehaving daemon: "trickle" sends a byte every 50 ms and never a newline; "endless"
        # streams 64 KiB chunks without a newline until the client hangs up.
        if reply_mode not in ("normal", "trickle", "endless"):
            raise ValueError(f"reply_mode {reply_mode!r}: expected normal, trickle or endless")
        self.reply_mode = reply_mode
        self.requests: list[dict[str, Any]] = []
        self.reverts = 0
        self.confirmed: dict[str, dict[str, Any]] = {}
        self._pending: tuple[str, dict[str, Any], dict[str, Any], threading.Timer] | None = None
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._closing = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "LactDouble":
        double = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for raw in self.rfile:
                    if double.reply_mode != "normal":
                        double._misbehave(self.wfile)
                        return
                    reply = double._dispatch(raw)
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._server = socketserver.ThreadingUnixStreamServer(self.socket_path, Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        with self._lock:
            if self._pending:
                self._pending[3].cancel()
                self._pending = None
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _misbehave(self, wfile: Any) -> None:
        try:
            if self.reply_mode == "trickle":
                wfile.write(b'{"status": "ok", "data": "')
                while not self._closing.wait(0.05):
                    wfile.write(b"x")
                    wfile.flush()
            else:
                chunk = b"x" * 65536
                wfile.write(b'{"status": "ok", "data": "')
                while not self._closing.is_set():
                    wfile.write(chunk)
                    wfile.flush()
        except OSError:
            return  # the client hung up

    # -- protocol --------------------------------------------------------------------------
    def _dispatch(self, raw: bytes) -> dict[str, Any]:
        try:
            request = json.loads(raw)
            command = request["command"]
            args = request.get("args") or {}
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            return {"status": "error", "data": "invalid request"}
        self.requests.append(request)
        if command in self.fail_commands:
            return {"status": "error", "data": self.fail_commands[command]}
        handler = getattr(self, f"_cmd_{command}", None)
        if handler is None:
            return {"status": "error", "data": f"unknown command {command}"}
        try:
            return {"status": "ok", "data": handler(args)}
        except (KeyError, ValueError) as exc:
            return {"status": "error", "data": str(exc)}

    def _cards(self) -> dict[str, Any]:
        out = {}
        for card in discover_cards(self.host_root, enrich=False):
            subsys = int((card.device_dir / "subsystem_device").read_text(), 16)
            out[f"1002:{card.device_id:04X}-1002:{subsys:04X}-{card.bdf}"] = card
        return out

    def _card(self, gpu_id: str) -> Any:
        cards = self._cards()
        if gpu_id not in cards:
            raise KeyError(f"no GPU with id {gpu_id}")
        return cards[gpu_id]

    def _cmd_ping(self, args: dict) -> None:
        return None

    def _cmd_list_devices(self, args: dict) -> list[dict[str, str]]:
        return [{"id": gpu_id, "name": "AMD Radeon AI PRO R9700" if c.is_r9700 else "AMD GPU"}
                for gpu_id, c in self._cards().items()]

    def _cmd_device_info(self, args: dict) -> dict[str, Any]:
        card = self._card(args["id"])
        return {"pci_info": {"device_pci_id": f"{card.device_id:04x}", "slot": card.bdf}, "driver": "amdgpu"}

    def _cmd_device_stats(self, args: dict) -> dict[str, Any]:
        card = self._card(args["id"])
        return {
            "power": {"average": card.power_watts, "current": card.power_watts, "cap_current": card.cap_watts,
                      "cap_min": card.cap_min_watts, "cap_max": card.cap_max_watts,
                      "cap_default": card.cap_default_watts},
            "vram": {"total": int((card.device_dir / "mem_info_vram_total").read_text()),
                     "used": int((card.device_dir / "mem_info_vram_used").read_text())},
            "voltage_offset": card.offset_mv,
        }

    def _cmd_get_gpu_config(self, args: dict) -> dict[str, Any]:
        self._card(args["id"])
        return dict(self.confirmed.get(args["id"], {}))

    def _cmd_set_gpu_config(self, args: dict) -> float:
        gpu_id, config = args["id"], args["config"]
        card = self._card(gpu_id)
        cap, offset = config.get("power_cap"), config.get("voltage_offset")
        if cap is not None and not (card.cap_min_watts <= cap <= card.cap_max_watts):
            raise ValueError(f"power cap {cap} W outside {card.cap_min_watts}-{card.cap_max_watts} W")
        if offset is not None:
            rng = card.offset_range_mv
            if rng is None or not (rng[0] <= offset <= rng[1]):
                raise ValueError(f"voltage offset {offset} mV outside the card's range {rng}")
        with self._lock:
            if self._pending is not None:
                raise ValueError("a pending config must be confirmed or reverted first")
            previous = {"power_cap": card.cap_watts, "voltage_offset": card.offset_mv}
            self._write_card(card.bdf, cap, offset)
            timer = threading.Timer(self.apply_settings_timer, self._timeout)
            timer.daemon = True
            self._pending = (gpu_id, dict(config), previous, timer)
            timer.start()
        return self.apply_settings_timer

    def _cmd_confirm_pending_config(self, args: dict) -> None:
        command = args["command"]
        if command not in ("confirm", "revert"):
            raise ValueError(f"unknown confirm command {command}")
        with self._lock:
            if self._pending is None:
                raise ValueError("no pending config")
            gpu_id, config, previous, timer = self._pending
            timer.cancel()
            self._pending = None
            if command == "revert":
                self._revert(gpu_id, previous)
            else:
                self.confirmed[gpu_id] = {**self.confirmed.get(gpu_id, {}), **config}
                self._save_config()
        return None

    def _timeout(self) -> None:
        with self._lock:
            if self._pending is None:
                return
            gpu_id, _, previous, _ = self._pending
            self._pending = None
            self._revert(gpu_id, previous)

    # -- effects on the fixture tree -------------------------------------------------------
    def _revert(self, gpu_id: str, previous: dict[str, Any]) -> None:
        self.reverts += 1
        bdf = gpu_id.split("-", 2)[2]
        self._write_card(bdf, previous["power_cap"], previous["voltage_offset"], force=True)

    def _write_card(self, bdf: str, cap: float | None, offset: int | None, force: bool = False) -> None:
        if cap is not None and (force or bdf not in self.ignore_cap_for):
            fixtures.write_cap_watts(self.host_root, bdf, cap)
        if offset is not None and fixtures.read_od_range_mv(self.host_root, bdf) is not None:
            fixtures.set_od_offset(self.host_root, bdf, offset)

    def _save_config(self) -> None:
        if self.config_path is None:
            return
        document = {
            "version": 6,
            "daemon": {"log_level": "info", "admin_group": "wheel", "disable_clocks_cleanup": False},
            "apply_settings_timer": self.apply_settings_timer,
            "gpus": self.confirmed,
        }
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(document, sort_keys=False))
