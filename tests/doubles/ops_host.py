"""Fake host trees for tests: sysfs/procfs/dev laid out like a real amdgpu host, under a temp dir.

Usage (tests of ops, monitoring, deploy)::

    from doubles.ops_host import CardSpec, build_host_tree
    root = build_host_tree(tmp_path, [CardSpec("0000:03:00.0"), CardSpec("0000:04:00.0",
                                      power_files=("input",))])
    # then run production code with host_root=root (CLI: --host-root ROOT)

The layout mirrors the kernel's, relative symlinks included:
``sys/class/drm/cardN -> ../../devices/pci0000:00/<port>/<BDF>/drm/cardN``,
``.../drm/cardN/device -> ../../../<BDF>``, ``sys/bus/pci/devices/<BDF> -> ../../../devices/...``,
hwmon under ``<BDF>/hwmon/hwmonM`` (plus ``sys/class/hwmon/hwmonM``), module parameters under
``sys/module/amdgpu/parameters``, ``proc/cmdline``, ``proc/sys/kernel/random/boot_id`` and an
empty ``dev/kmsg`` file. Units follow sysfs: microwatts, millidegrees, millivolts, Hz, bytes.

Writes to ``pp_od_clk_voltage`` (``vo``/``c``/``r`` commands) need a kernel to interpret them:
run :class:`FakeKernel` while production code writes through sysfs. The LACT double
(:mod:`doubles.lact_double`) updates the tree itself, as the daemon plus kernel would.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

R9700_DEVICE_ID = 0x7551
AMD_VENDOR_ID = 0x1002


@dataclass
class CardSpec:
    bdf: str
    device_id: int = R9700_DEVICE_ID
    cap_watts: float | None = None  # current cap; None = cap_default_watts
    cap_default_watts: float = 300.0
    cap_min_watts: float = 150.0
    cap_max_watts: float = 300.0
    voltage_offset_mv: int = 0
    offset_range_mv: tuple[int, int] = (-200, 0)
    overdrive: bool = True  # False: pp_od_clk_voltage has no VDDGFX offset (ppfeaturemask lacks 0x4000)
    od_style: str = "nextline"  # "nextline": value under the header (RDNA4); "inline": "OD_VDDGFX_OFFSET: -50mV"
    power_files: tuple[str, ...] = ("average", "input")  # which power1_* readings exist
    power_draw_watts: float = 95.0
    hwmon: bool = True  # False: hwmon node not there yet (add it later with add_hwmon)
    runtime_status: str = "active"
    driver: str = "amdgpu"
    vram_total_bytes: int = 32 * 1024**3
    vram_used_bytes: int = 512 * 1024**2
    temps_millic: tuple[int, int, int] = (45000, 52000, 60000)
    subsystem_device: int = 0x0E0D


@dataclass
class HostSpec:
    gpu_recovery: int = -1  # amdgpu default: auto (recovery on)
    cmdline: str = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet"
    boot_id: str = "4a1f6e2c-1d1e-4d6b-9a55-000000000001"
    ppfeaturemask: str = "0xfff7bfff"
    runpm: int = -1
    lockup_timeout: str = ""


def render_od_table(offset_mv: int, offset_range_mv: tuple[int, int] | None, style: str = "nextline") -> str:
    """pp_od_clk_voltage as amdgpu prints it for RDNA4 (smu_v14_0_2), padding included."""
    lines = ["OD_SCLK_OFFSET:", "0Mhz", "OD_MCLK:", "0: 97Mhz", "1: 1259MHz"]
    if offset_range_mv is not None:
        if style == "inline":
            lines.append(f"OD_VDDGFX_OFFSET: {offset_mv}mV")
        else:
            lines += ["OD_VDDGFX_OFFSET:", f"{offset_mv}mV"]
    lines += ["OD_RANGE:", f"SCLK_OFFSET: {-500:7d}Mhz {1000:10d}Mhz", f"MCLK: {97:7d}Mhz {1500:10d}Mhz"]
    if offset_range_mv is not None:
        lo, hi = offset_range_mv
        unit = "mv" if style == "nextline" else "mV"
        lines.append(f"VDDGFX_OFFSET: {lo:7d}{unit} {hi:10d}{unit}")
    return "\n".join(lines) + "\n"


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _rel_symlink(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def device_dir(root: str | os.PathLike, bdf: str) -> Path:
    """The real (non-symlink) PCI device directory of a card in a fixture tree."""
    return Path(root) / "sys/devices/pci0000:00" / _port_of(bdf) / bdf


def _port_of(bdf: str) -> str:
    bus = int(bdf.split(":")[1], 16)
    return f"0000:00:{bus:02x}.1"


def build_host_tree(
    root: str | os.PathLike, cards: list[CardSpec], host: HostSpec | None = None
) -> Path:
    """Create a fake host under ``root`` (created if needed) and return it as a Path."""
    root = Path(root)
    host = host or HostSpec()
    sys_ = root / "sys"
    params = sys_ / "module/amdgpu/parameters"
    _w(params / "gpu_recovery", f"{host.gpu_recovery}\n")
    _w(params / "ppfeaturemask", f"{host.ppfeaturemask}\n")
    _w(params / "runpm", f"{host.runpm}\n")
    _w(params / "lockup_timeout", f"{host.lockup_timeout}\n")
    _w(root / "proc/cmdline", host.cmdline + "\n")
    _w(root / "proc/sys/kernel/random/boot_id", host.boot_id + "\n")
    _w(root / "dev/kmsg", "")
    (sys_ / "bus/pci/drivers/amdgpu").mkdir(parents=True, exist_ok=True)
    (sys_ / "class/drm").mkdir(parents=True, exist_ok=True)
    hwmon_index = 0
    for index, spec in enumerate(cards):
        dev = device_dir(root, spec.bdf)
        dev.mkdir(parents=True)
        _w(dev / "vendor", f"0x{AMD_VENDOR_ID:04x}\n")
        _w(dev / "device", f"0x{spec.device_id:04x}\n")
        _w(dev / "subsystem_vendor", f"0x{AMD_VENDOR_ID:04x}\n")
        _w(dev / "subsystem_device", f"0x{spec.subsystem_device:04x}\n")
        _w(dev / "class", "0x030000\n")
        driver_dir = sys_ / "bus/pci/drivers" / spec.driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        _rel_symlink(dev / "driver", driver_dir)
        _rel_symlink(sys_ / "bus/pci/devices" / spec.bdf, dev)
        _w(dev / "unique_id", f"{0x5a0c0ffee0000 + index:016x}\n")
        _w(dev / "power/runtime_status", spec.runtime_status + "\n")
        _w(dev / "power/control", "auto\n")
        _w(dev / "power_dpm_force_performance_level", "auto\n")
        _w(dev / "mem_info_vram_total", f"{spec.vram_total_bytes}\n")
        _w(dev / "mem_info_vram_used", f"{spec.vram_used_bytes}\n")
        _w(dev / "gpu_busy_percent", "0\n")
        _w(
            dev / "pp_od_clk_voltage",
            render_od_table(spec.voltage_offset_mv, spec.offset_range_mv if spec.overdrive else None, spec.od_style),
        )
        drm = dev / "drm" / f"card{index}"
        drm.mkdir(parents=True)
        _rel_symlink(drm / "device", dev)
        _rel_symlink(sys_ / "class/drm" / f"card{index}", drm)
        if spec.driver == "amdgpu" and spec.hwmon:
            _make_hwmon(root, spec, hwmon_index)
        hwmon_index += 1
    return root


def _make_hwmon(root: Path, spec: CardSpec, hwmon_index: int) -> Path:
    hw = device_dir(root, spec.bdf) / "hwmon" / f"hwmon{hwmon_index}"
    uw = lambda watts: f"{int(round(watts * 1_000_000))}\n"  # noqa: E731
    files = {
        "name": "amdgpu\n",
        "power1_label": "PPT\n",
        "power1_cap": uw(spec.cap_watts if spec.cap_watts is not None else spec.cap_default_watts),
        "power1_cap_min": uw(spec.cap_min_watts),
        "power1_cap_max": uw(spec.cap_max_watts),
        "power1_cap_default": uw(spec.cap_default_watts),
        "temp1_label": "edge\n",
        "temp2_label": "junction\n",
        "temp3_label": "mem\n",
        "temp1_input": f"{spec.temps_millic[0]}\n",
        "temp2_input": f"{spec.temps_millic[1]}\n",
        "temp3_input": f"{spec.temps_millic[2]}\n",
        "in0_label": "vddgfx\n",
        "in0_input": "850\n",
        "freq1_label": "sclk\n",
        "freq1_input": "1200000000\n",
        "freq2_label": "mclk\n",
        "freq2_input": "1259000000\n",
    }
    for kind in spec.power_files:
        files[f"power1_{kind}"] = uw(spec.power_draw_watts)
    for name, text in files.items():
        _w(hw / name, text)
    _rel_symlink(root / "sys/class/hwmon" / f"hwmon{hwmon_index}", hw)
    return hw


def add_hwmon(root: str | os.PathLike, spec: CardSpec, hwmon_index: int = 90) -> Path:
    """Make a card's hwmon node appear (as it does late in boot)."""
    return _make_hwmon(Path(root), spec, hwmon_index)


def hwmon_dir(root: str | os.PathLike, bdf: str) -> Path:
    found = sorted((device_dir(root, bdf) / "hwmon").glob("hwmon*"))
    if not found:
        raise FileNotFoundError(f"no hwmon for {bdf}")
    return found[0]


def set_runtime_status(root: str | os.PathLike, bdf: str, status: str) -> None:
    _w(device_dir(root, bdf) / "power/runtime_status", status + "\n")


def read_od_offset_mv(root: str | os.PathLike, bdf: str) -> int | None:
    text = (device_dir(root, bdf) / "pp_od_clk_voltage").read_text()
    match = re.search(r"OD_VDDGFX_OFFSET:\s*(-?\d+)\s*mV", text, re.IGNORECASE)
    return int(match.group(1)) if match else None


def read_od_range_mv(root: str | os.PathLike, bdf: str) -> tuple[int, int] | None:
    text = (device_dir(root, bdf) / "pp_od_clk_voltage").read_text()
    match = re.search(r"^VDDGFX_OFFSET:\s*(-?\d+)\s*mv\s+(-?\d+)\s*mv", text, re.IGNORECASE | re.MULTILINE)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _od_style(root: str | os.PathLike, bdf: str) -> str:
    text = (device_dir(root, bdf) / "pp_od_clk_voltage").read_text()
    return "inline" if re.search(r"OD_VDDGFX_OFFSET:[ \t]*-?\d", text) else "nextline"


def set_od_offset(root: str | os.PathLike, bdf: str, offset_mv: int, style: str | None = None) -> None:
    """What the kernel shows after a committed offset (atomic replace, so readers never see half)."""
    path = device_dir(root, bdf) / "pp_od_clk_voltage"
    rng = read_od_range_mv(root, bdf)
    style = style or _od_style(root, bdf)
    tmp = path.with_name(".pp_od_clk_voltage.tmp")
    tmp.write_text(render_od_table(offset_mv, rng, style))
    os.replace(tmp, path)


def read_cap_watts(root: str | os.PathLike, bdf: str) -> float:
    return int((hwmon_dir(root, bdf) / "power1_cap").read_text()) / 1_000_000


def write_cap_watts(root: str | os.PathLike, bdf: str, watts: float) -> None:
    (hwmon_dir(root, bdf) / "power1_cap").write_text(f"{int(round(watts * 1_000_000))}\n")


def simulate_reset(root: str | os.PathLike, bdf: str) -> None:
    """After a GPU reset the SMU comes back with defaults: cap at default, no voltage offset."""
    hw = hwmon_dir(root, bdf)
    (hw / "power1_cap").write_text((hw / "power1_cap_default").read_text())
    if read_od_range_mv(root, bdf) is not None:
        set_od_offset(root, bdf, 0)


class FakeKernel:
    """Interprets ``vo``/``c``/``r`` writes to fixture ``pp_od_clk_voltage`` files, like amdgpu.

    A thread polls the files; once a write sequence ends with a commit (``c``) or reset (``r``)
    it rewrites the table. Offsets outside the declared range are refused (nothing changes), as
    the kernel returns EINVAL. ``commands`` records every command seen, per BDF. Use as a context
    manager around code that writes through sysfs.
    """

    def __init__(self, root: str | os.PathLike, poll_s: float = 0.002):
        self.root = Path(root)
        self.poll_s = poll_s
        self.commands: dict[str, list[str]] = {}
        self._ranges: dict[str, tuple[int, int] | None] = {}
        self._styles: dict[str, str] = {}
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-kernel", daemon=True)

    def __enter__(self) -> "FakeKernel":
        # The range and layout are remembered now: the first write replaces the table text.
        for path in (self.root / "sys/bus/pci/devices").glob("*/pp_od_clk_voltage"):
            bdf = path.parent.name
            self._ranges[bdf] = read_od_range_mv(self.root, bdf)
            self._styles[bdf] = _od_style(self.root, bdf)
            self._last[bdf] = read_od_offset_mv(self.root, bdf) or 0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for path in (self.root / "sys/bus/pci/devices").glob("*/pp_od_clk_voltage"):
                try:
                    self._service(path)
                except (OSError, ValueError):
                    continue

    def _service(self, path: Path) -> None:
        text = path.read_text()
        if text.startswith("OD_"):
            return
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines or lines[-1] not in ("c", "r"):
            return  # nothing takes effect before the commit
        bdf = path.parent.name
        self.commands.setdefault(bdf, []).extend(lines)
        rng = self._ranges.get(bdf)
        new = 0 if lines[-1] == "r" else None
        for line in lines:
            parts = line.split()
            if parts[0] == "vo" and len(parts) == 2:
                value = int(parts[1])
                if rng is not None and rng[0] <= value <= rng[1]:
                    new = value
        dev = path.resolve().parent
        if new is None:
            new = self._last.get(bdf, 0)
        self._last[bdf] = new
        tmp = dev / ".pp_od_clk_voltage.tmp"
        tmp.write_text(render_od_table(new, rng, self._styles.get(bdf, "nextline")))
        os.replace(tmp, dev / "pp_od_clk_voltage")


def kmsg_record(seq: int, message: str, ts_us: int | None = None, priority: int = 3,
                bdf: str | None = None) -> str:
    """One /dev/kmsg record: ``pri,seq,ts_us,flags;message`` plus a DEVICE continuation line."""
    ts_us = ts_us if ts_us is not None else 1_000_000 + seq * 1000
    text = f"{priority},{seq},{ts_us},-;{message}\n"
    if bdf:
        text += f" SUBSYSTEM=pci\n DEVICE=+pci:{bdf}\n"
    return text


# -- debugfs: amdgpu's MES event log (amdgpu.mes_log_enable=1), as drm and amdgpu lay it out

MES_LOG_RING_BYTES = 0x4000  # AMDGPU_MES_LOG_BUFFER_SIZE: a gfx12 card without unified MES


def mes_ring(records: int, ring_bytes: int = MES_LOG_RING_BYTES) -> bytes:
    """A firmware ring with ``records`` 32-byte entries written (distinct words), the rest zero."""
    ring = bytearray(ring_bytes)
    for n in range(min(records, ring_bytes // 32)):
        words = (0x1000 + n, 0x00c0ffee, n * 7 + 1, 0x2, 0, 0, n, 0xa5a5a5a5)
        ring[n * 32:(n + 1) * 32] = b"".join(w.to_bytes(4, "little") for w in words)
    return bytes(ring)


def render_mes_event_log(ring: bytes) -> str:
    """``amdgpu_mes_event_log`` as the kernel prints it: seq_hex_dump(DUMP_PREFIX_OFFSET, 32-byte
    rows, 4-byte groups, no ASCII column): ``00000020: 00001001 00c0ffee ...``, each word a
    little-endian u32 in 8 lowercase hex digits, one blank between."""
    rows = []
    for offset in range(0, len(ring), 32):
        row = ring[offset:offset + 32]
        words = (int.from_bytes(row[i:i + 4], "little") for i in range(0, len(row), 4))
        rows.append(f"{offset:08x}: " + " ".join(f"{w:08x}" for w in words))
    return "".join(row + "\n" for row in rows)


def debugfs_dri(root: str | os.PathLike) -> Path:
    return Path(root) / "sys/kernel/debug/dri"


def add_debugfs_card(root: str | os.PathLike, bdf: str, minor: int, mes_log: str | None,
                     layout: str = "device") -> Path:
    """A card's DRM debugfs directory; returns the one holding ``amdgpu_mes_event_log``.

    ``layout="device"`` (current drm_debugfs.c): files in ``dri/<BDF>/``; ``dri/<minor>`` and the
    render minor ``dri/<128+minor>`` are symlinks to it; an open client adds ``dri/client-N/``
    (``proc_info`` and a ``device`` link, no ``name``). ``layout="minor"`` (older kernels): the
    primary minor's own ``dri/<minor>/``, and the render minor's ``dri/<128+minor>/`` with only
    drm's files. ``mes_log=None``: amdgpu made no log (mes_log_enable=0). The debugfs mount is
    root-only (0700), as distributions mount it."""
    dri = debugfs_dri(root)
    dri.mkdir(parents=True, exist_ok=True)
    os.chmod(dri.parent, 0o700)
    name = f"amdgpu dev={bdf} unique={bdf}\n"
    if layout == "device":
        card = dri / bdf
        _w(card / "name", name)
        for link in (str(minor), str(128 + minor)):
            (dri / link).symlink_to(bdf)
        client = dri / f"client-{minor + 1}"
        _w(client / "proc_info", "pid: 4242\ncomm: python3\n")
        (client / "device").symlink_to(f"../{bdf}")
    elif layout == "minor":
        card = dri / str(minor)
        _w(card / "name", name)
        _w(dri / str(128 + minor) / "name", name)
    else:
        raise ValueError(f"layout {layout!r}: expected 'device' or 'minor'")
    _w(card / "amdgpu_firmware_info", "MES feature version: 1, firmware version: 0x00000080\n")
    if mes_log is not None:
        _w(card / "amdgpu_mes_event_log", mes_log)
    return card
