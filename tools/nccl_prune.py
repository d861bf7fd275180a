"""Shrinks a CUDA library for one GPU architecture, so that it fits a carry to a host without a
package registry (tools/baselines.py brings NCCL >= 2.30.4 to DeepEP V2 that way).

A CUDA shared library keeps its device code in *fatbins*: a 16-byte header (magic 0xBA55ED50,
u16 version 1, u16 header size 16, u64 size of what follows) and then entries, each a header
(u16 kind: 1 PTX, 2 ELF/SASS; u16 flags; u32 header size; u64 payload size; ...; u32 arch at
byte 28) followed by its payload. At load time the driver picks the ELF built for the GPU's
architecture, so in a fatbin that has one for ``arch`` every other payload can be zeroed: the
file keeps its size and layout (nothing moves, no offset changes) and the zeros compress to
almost nothing. A fatbin without an ELF for ``arch`` is left whole (the driver may need its PTX),
and so is anything that does not parse as the format above.
"""

from __future__ import annotations

import mmap
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Tuple, Union

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, payload size
_ENTRY = struct.Struct("<HHIQ")  # kind, flags, header size, payload size
_ARCH_AT = 28  # the entry's architecture (90 for sm_90), from the entry's start
_MIN_ENTRY = _ARCH_AT + 4

Buffer = Union[bytearray, mmap.mmap]


@dataclass(frozen=True)
class Entry:
    start: int  # where the entry's header begins
    kind: int
    header_size: int
    size: int  # payload bytes, right after the header
    arch: int

    @property
    def payload(self) -> Tuple[int, int]:
        begin = self.start + self.header_size
        return begin, begin + self.size


@dataclass
class PruneStats:
    fatbins: int = 0
    kept_bytes: int = 0  # payload bytes left as they were
    zeroed_bytes: int = 0
    whole: int = 0  # fatbins left whole: no ELF for the architecture

    def line(self, arch: int) -> str:
        return (f"{self.fatbins} fatbins: kept {self.kept_bytes / 1e6:.1f} MB (sm_{arch} code and "
                f"{self.whole} fatbins without it), zeroed {self.zeroed_bytes / 1e6:.1f} MB")


def _entries(buf: Buffer, begin: int, end: int) -> List[Entry]:
    """The entries between ``begin`` and ``end``; empty where they do not tile that span."""
    out, p = [], begin
    while p < end:
        if p + _MIN_ENTRY > end:
            return []
        kind, _flags, header_size, size = _ENTRY.unpack_from(buf, p)
        arch = struct.unpack_from("<I", buf, p + _ARCH_AT)[0]
        if header_size < _MIN_ENTRY or p + header_size + size > end:
            return []
        out.append(Entry(p, kind, header_size, size, arch))
        p += header_size + size
    return out


def fatbins(buf: Buffer) -> Iterator[List[Entry]]:
    """Every well-formed fatbin in ``buf``, as its list of entries."""
    magic = struct.pack("<I", MAGIC)
    pos, n = 0, len(buf)
    while True:
        i = buf.find(magic, pos)
        if i < 0 or i + _HEADER.size > n:
            return
        _, version, header_size, size = _HEADER.unpack_from(buf, i)
        end = i + header_size + size
        found = _entries(buf, i + header_size, end) if version == 1 and header_size == 16 and end <= n else []
        if found:
            yield found
            pos = end
        else:
            pos = i + 4  # the magic bytes by chance, or a header we do not know


def prune(buf: Buffer, arch: int) -> PruneStats:
    """Zeroes, in place, every payload of every fatbin that holds an ELF for ``arch``, except
    those ELFs."""
    stats = PruneStats()
    for entries in fatbins(buf):
        stats.fatbins += 1
        if not any(e.kind == KIND_ELF and e.arch == arch for e in entries):
            stats.whole += 1
            stats.kept_bytes += sum(e.size for e in entries)
            continue
        for e in entries:
            if e.kind == KIND_ELF and e.arch == arch:
                stats.kept_bytes += e.size
                continue
            begin, end = e.payload
            buf[begin:end] = bytes(e.size)
            stats.zeroed_bytes += e.size
    return stats


def prune_file(src: Path, dst: Path, arch: int) -> PruneStats:
    """``dst``: a copy of ``src`` pruned for ``arch``."""
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        stats = prune(m, arch)
        m.flush()
    return stats
