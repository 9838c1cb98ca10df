"""sysfs access for amdgpu cards: discovery, power cap (microwatts) and voltage offset (mV).

Every path is resolved under a host root (default ``/``) so the same code runs on a host and on
a fixture tree (:mod:`doubles.ops_host`). Cards are keyed by PCI address (BDF): ``cardN`` and
``hwmonM`` numbers are not stable across boots.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

AMD_VENDOR_ID = 0x1002
R9700_DEVICE_IDS = frozenset({0x7551})
_CARD_RE = re.compile(r"^card\d+$")
_UW = 1_000_000


class NotReady(Exception):
    """The card cannot take power-management writes yet (reset, runtime-suspended, no hwmon)."""


def host_path(host_root: str | os.PathLike, absolute: str) -> Path:
    return Path(host_root) / absolute.lstrip("/")


@dataclass
class OdTable:
    offset_mv: int | None
    offset_range_mv: tuple[int, int] | None


def parse_od_table(text: str) -> OdTable:
    """Parse ``pp_od_clk_voltage`` tolerantly (value inline or on the next line, any unit case)."""
    offset: int | None = None
    rng: tuple[int, int] | None = None
    lines = [ln.strip() for ln in text.splitlines()]
    section = ""
    for i, line in enumerate(lines):
        upper = line.upper()
        if re.match(r"^OD_[A-Z_]+:", upper):
            section = upper.split(":", 1)[0]
            rest = line.split(":", 1)[1].strip()
            if section == "OD_VDDGFX_OFFSET":
                value = rest or (lines[i + 1] if i + 1 < len(lines) else "")
                m = re.match(r"^(-?\d+)\s*mv$", value, re.IGNORECASE)
                if m:
                    offset = int(m.group(1))
            continue
        if section == "OD_RANGE" and upper.startswith("VDDGFX_OFFSET:"):
            m = re.match(r"^VDDGFX_OFFSET:\s*(-?\d+)\s*mv\s+(-?\d+)\s*mv$", line, re.IGNORECASE)
            if m:
                rng = (int(m.group(1)), int(m.group(2)))
    return OdTable(offset, rng)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EBUSY, errno.ENODEV, errno.EAGAIN):
            raise NotReady(f"{path.name}: {os.strerror(exc.errno)}") from exc
        raise


def _read_int(path: Path) -> int | None:
    try:
        return int(_read(path), 0)
    except (FileNotFoundError, ValueError):
        return None


@dataclass
class Card:
    bdf: str
    card_name: str
    device_dir: Path
    device_id: int | None
    is_r9700: bool
    hwmon_dir: Path | None
    runtime_status: str | None
    cap_min_watts: float | None = None
    cap_max_watts: float | None = None
    cap_default_watts: float | None = None
    cap_watts: float | None = None
    offset_mv: int | None = None
    offset_range_mv: tuple[int, int] | None = None
    power_watts: float | None = None
    power_source: str | None = None  # "average" or "input": cards may expose only one
    product: str | None = None  # from pyamdgpuinfo when installed
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "bdf": self.bdf,
            "card": self.card_name,
            "device_id": f"0x{self.device_id:04x}" if self.device_id is not None else None,
            "is_r9700": self.is_r9700,
            "hwmon": self.hwmon_dir.name if self.hwmon_dir else None,
            "runtime_status": self.runtime_status,
            "cap_watts": self.cap_watts,
            "cap_min_watts": self.cap_min_watts,
            "cap_max_watts": self.cap_max_watts,
            "cap_default_watts": self.cap_default_watts,
            "offset_mv": self.offset_mv,
            "offset_range_mv": list(self.offset_range_mv) if self.offset_range_mv else None,
            "power_watts": self.power_watts,
            "power_source": self.power_source,
            "product": self.product,
            "errors": self.errors,
        }


def _find_hwmon(device_dir: Path) -> Path | None:
    for hw in sorted((device_dir / "hwmon").glob("hwmon*")):
        try:
            if (hw / "name").read_text().strip() == "amdgpu":
                return hw
        except OSError:
            continue
    return None


def read_card(device_dir: Path, card_name: str) -> Card:
    """Read one card's identity, ranges and current settings; unreadable parts land in ``errors``."""
    device_id = _read_int(device_dir / "device")
    card = Card(
        bdf=device_dir.name,
        card_name=card_name,
        device_dir=device_dir,
        device_id=device_id,
        is_r9700=device_id in R9700_DEVICE_IDS,
        hwmon_dir=_find_hwmon(device_dir),
        runtime_status=None,
    )
    try:
        card.runtime_status = _read(device_dir / "power/runtime_status")
    except (OSError, NotReady) as exc:
        card.errors.append(f"runtime_status: {exc}")
    if card.hwmon_dir is None:
        card.errors.append("no amdgpu hwmon directory yet")
    else:
        for attr, name in (("cap_min_watts", "power1_cap_min"), ("cap_max_watts", "power1_cap_max"),
                           ("cap_default_watts", "power1_cap_default"), ("cap_watts", "power1_cap")):
            try:
                value = _read_int(card.hwmon_dir / name)
            except (OSError, NotReady) as exc:
                card.errors.append(f"{name}: {exc}")
                continue
            if value is None:
                card.errors.append(f"{name}: missing or not a number")
            else:
                setattr(card, attr, value / _UW)
        for kind in ("average", "input"):
            try:
                value = _read_int(card.hwmon_dir / f"power1_{kind}")
            except (OSError, NotReady):
                value = None
            if value is not None:
                card.power_watts, card.power_source = value / _UW, kind
                break
    try:
        od = parse_od_table(_read(device_dir / "pp_od_clk_voltage"))
        card.offset_mv, card.offset_range_mv = od.offset_mv, od.offset_range_mv
    except FileNotFoundError:
        card.errors.append("pp_od_clk_voltage: missing")
    except (OSError, NotReady) as exc:
        card.errors.append(f"pp_od_clk_voltage: {exc}")
    return card


def discover_cards(host_root: str | os.PathLike = "/", enrich: bool = True) -> list[Card]:
    """All amdgpu cards under ``host_root``, sorted by BDF (R9700s flagged by ``is_r9700``)."""
    drm = host_path(host_root, "/sys/class/drm")
    cards: list[Card] = []
    seen: set[str] = set()
    if not drm.is_dir():
        return cards
    for entry in sorted(drm.iterdir(), key=lambda p: p.name):
        if not _CARD_RE.match(entry.name):
            continue  # connectors (card0-DP-1) and render nodes
        device_dir = Path(os.path.realpath(entry / "device"))
        if not device_dir.is_dir() or device_dir.name in seen:
            continue
        if _read_int(device_dir / "vendor") != AMD_VENDOR_ID:
            continue
        driver = os.path.basename(os.path.realpath(device_dir / "driver"))
        if driver != "amdgpu":
            continue
        seen.add(device_dir.name)
        cards.append(read_card(device_dir, entry.name))
    cards.sort(key=lambda c: c.bdf)
    if enrich and Path(host_root).resolve() == Path("/"):
        _enrich_pyamdgpuinfo(cards)
    return cards


def _enrich_pyamdgpuinfo(cards: list[Card]) -> None:
    try:
        import pyamdgpuinfo  # optional: reads the real devices, so only for host root "/"
    except ImportError:
        return
    try:
        for index in range(pyamdgpuinfo.detect_gpus()):
            gpu = pyamdgpuinfo.get_gpu(index)
            for card in cards:
                if card.bdf == gpu.pci_slot:
                    card.product = gpu.name
    except Exception as exc:  # enrichment must never break discovery
        for card in cards:
            card.errors.append(f"pyamdgpuinfo: {exc}")


def refresh(card: Card) -> Card:
    """Re-read a card (after a write, a reset or a late hwmon)."""
    return read_card(card.device_dir, card.card_name)


def check_ready(card: Card) -> None:
    """Raise NotReady while power-management writes would fail with EPERM."""
    status = card.runtime_status
    if status is not None and status != "active":
        raise NotReady(f"runtime-PM status is {status!r} (writes return EPERM until it is 'active')")
    if card.hwmon_dir is None:
        raise NotReady("hwmon node has not appeared yet")


def _write(path: Path, text: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EBUSY, errno.ENODEV, errno.EAGAIN):
            raise NotReady(f"{path.name}: {os.strerror(exc.errno)}") from exc
        raise


def write_cap_watts(card: Card, watts: float) -> None:
    assert card.hwmon_dir is not None
    _write(card.hwmon_dir / "power1_cap", f"{int(round(watts * _UW))}\n")


def write_offset_mv(card: Card, offset_mv: int) -> None:
    """Stage ``vo <mV>`` and commit with ``c``: two writes on one descriptor, as the kernel expects."""
    path = card.device_dir / "pp_od_clk_voltage"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, f"vo {int(offset_mv)}\n".encode())
            os.write(fd, b"c\n")
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EBUSY, errno.ENODEV, errno.EAGAIN):
            raise NotReady(f"pp_od_clk_voltage: {os.strerror(exc.errno)}") from exc
        raise


@dataclass
class RecoveryStatus:
    gpu_recovery_param: str | None  # -1 auto (on), 0 off, 1 on
    cmdline_asks_off: bool
    in_effect: bool  # recovery disabled (the containment we want)

    def to_json(self) -> dict:
        return {
            "gpu_recovery_param": self.gpu_recovery_param,
            "cmdline_asks_off": self.cmdline_asks_off,
            "recovery_disabled": self.in_effect,
        }

    @property
    def warning(self) -> str | None:
        if self.in_effect:
            return None
        if self.gpu_recovery_param is None:
            return ("amdgpu module parameters not found (module not loaded?): cannot tell whether GPU "
                    "recovery is off; boot with amdgpu.gpu_recovery=0")
        return ("amdgpu GPU recovery is enabled (gpu_recovery="
                f"{self.gpu_recovery_param}): a hung MES can escalate into a reset that takes the card off "
                "the bus; boot with amdgpu.gpu_recovery=0")


def recovery_status(host_root: str | os.PathLike = "/") -> RecoveryStatus:
    try:
        param = host_path(host_root, "/sys/module/amdgpu/parameters/gpu_recovery").read_text().strip()
    except OSError:
        param = None
    try:
        cmdline = host_path(host_root, "/proc/cmdline").read_text().split()
    except OSError:
        cmdline = []
    asks_off = "amdgpu.gpu_recovery=0" in cmdline
    return RecoveryStatus(param, asks_off, param == "0")


def boot_id(host_root: str | os.PathLike = "/") -> str | None:
    try:
        return host_path(host_root, "/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None
