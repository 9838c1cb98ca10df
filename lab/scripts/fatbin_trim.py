"""List or trim the CUDA fatbin of an ELF shared object to what one GPU architecture loads.

    python -m lab.scripts.fatbin_trim list SO
    python -m lab.scripts.fatbin_trim trim SO OUT 90

Trimming zero-fills the payload of every entry the device cannot select (headers intact), so the
file keeps its layout, the kept images stay byte-identical, and the zeros compress away: vLLM's
two stable-ABI libraries go from 79 + 45 MB to about 14 + 13 MB (xz) for sm_90.
"""
from __future__ import annotations

import collections
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def section(data: bytes, name: str) -> tuple[int, int]:
    """(offset, size) of the named ELF64 section."""
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)

    names_at = header(e_shstrndx)[4]
    for i in range(e_shnum):
        h = header(i)
        start = names_at + h[0]
        if data[start:data.index(b"\0", start)].decode() == name:
            return h[4], h[5]
    raise SystemExit(f"no section {name}: not a CUDA shared object")


def entries(data: bytes, off: int, size: int):
    """Every image of every fatbin in the section: kind, arch, payload offset and size."""
    end, p = off + size, off
    while p + 16 <= end:
        magic, _ver, header_size, fatbin_size = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # padding between fatbins
            continue
        q, fatbin_end = p + header_size, p + header_size + fatbin_size
        while q < fatbin_end:
            kind, _unk, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            yield dict(fatbin=p, kind=kind, arch=arch, size=payload, payload=q + entry_header)
            q += entry_header + payload
        p = fatbin_end


def trim(data: bytearray, sm: int) -> tuple[int, int]:
    """Keep, per fatbin, its ELF images for exactly `sm`; where it has none, its PTX of arch
    <= sm (the driver JIT-compiles the highest). Returns (bytes kept, bytes zero-filled)."""
    off, size = section(data, ".nv_fatbin")
    by_fatbin = collections.defaultdict(list)
    for e in entries(data, off, size):
        by_fatbin[e["fatbin"]].append(e)
    kept = zeroed = 0
    for images in by_fatbin.values():
        has_elf = any(e["kind"] == KIND_ELF and e["arch"] == sm for e in images)
        for e in images:
            if (e["kind"] == KIND_ELF and e["arch"] == sm) or (
                    not has_elf and e["kind"] == KIND_PTX and e["arch"] <= sm):
                kept += e["size"]
            else:
                data[e["payload"]:e["payload"] + e["size"]] = bytes(e["size"])
                zeroed += e["size"]
    return kept, zeroed


def main(argv: list[str]) -> None:
    cmd, so = argv[0], argv[1]
    data = bytearray(open(so, "rb").read())
    if cmd == "list":
        off, size = section(data, ".nv_fatbin")
        stats = collections.Counter()
        for e in entries(data, off, size):
            stats[("PTX" if e["kind"] == KIND_PTX else "ELF", e["arch"])] += e["size"]
        for (kind, arch), nbytes in sorted(stats.items()):
            print(f"{kind} sm_{arch}: {nbytes} B")
    elif cmd == "trim":
        kept, zeroed = trim(data, int(argv[3]))
        open(argv[2], "wb").write(data)
        print(f"{so}: kept {kept} B for sm_{argv[3]}, zero-filled {zeroed} B")
    else:
        raise SystemExit("usage: fatbin_trim.py list SO | trim SO OUT SM")


if __name__ == "__main__":
    main(sys.argv[1:])
