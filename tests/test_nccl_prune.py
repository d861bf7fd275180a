"""The fatbin pruner (tools/nccl_prune.py) on small synthetic blobs laid out as CUDA's fatbin format."""

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import nccl_prune as npr  # noqa: E402


def entry(kind, arch, payload, header_size=64):
    head = bytearray(header_size)
    struct.pack_into("<HHIQ", head, 0, kind, 0x11, header_size, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def fatbin(*entries):
    body = b"".join(entries)
    return struct.pack("<IHHQ", npr.MAGIC, 1, 16, len(body)) + body


def test_keeps_only_the_chosen_arch_elf_and_moves_nothing():
    ptx, sm80, sm90, sm100 = b"P" * 40, b"A" * 24, b"N" * 32, b"B" * 16
    blob = bytearray(b"host code " + fatbin(entry(1, 120, ptx), entry(2, 80, sm80), entry(2, 90, sm90),
                                            entry(2, 100, sm100)) + b" tail")
    before = bytes(blob)
    stats = npr.prune(blob, 90)
    assert len(blob) == len(before)
    assert blob.startswith(b"host code ") and blob.endswith(b" tail")
    assert sm90 in blob and ptx not in blob and sm80 not in blob and sm100 not in blob
    assert (stats.fatbins, stats.whole, stats.kept_bytes, stats.zeroed_bytes) == (1, 0, 32, 80)
    # every header is intact: the pruned blob parses to the same entries
    assert [(e.kind, e.arch, e.size) for e in next(npr.fatbins(blob))] == \
        [(1, 120, 40), (2, 80, 24), (2, 90, 32), (2, 100, 16)]


def test_fatbin_without_the_arch_is_left_whole():
    only100 = fatbin(entry(2, 100, b"X" * 16), entry(1, 100, b"Y" * 8))
    blob = bytearray(only100 + fatbin(entry(2, 90, b"N" * 8), entry(2, 80, b"A" * 8)))
    stats = npr.prune(blob, 90)
    assert blob.startswith(only100)
    assert (stats.fatbins, stats.whole, stats.zeroed_bytes) == (2, 1, 8)


def test_magic_by_chance_and_bad_headers_are_skipped():
    stray = struct.pack("<IHHQ", npr.MAGIC, 1, 16, 10 ** 9)  # size past the end
    broken = struct.pack("<IHHQ", npr.MAGIC, 1, 16, 40) + entry(2, 80, b"Z" * 8)[:40]  # entry overruns
    good = fatbin(entry(2, 90, b"N" * 8), entry(2, 75, b"O" * 8))
    blob = bytearray(stray + broken + good)
    stats = npr.prune(blob, 90)
    assert blob[:len(stray) + len(broken)] == stray + broken
    assert stats.fatbins == 1 and stats.zeroed_bytes == 8 and b"O" * 8 not in blob


def test_prune_file_leaves_the_source_alone(tmp_path):
    src, dst = tmp_path / "lib.so", tmp_path / "pruned.so"
    data = b"\x7fELF" + fatbin(entry(2, 90, b"N" * 8), entry(2, 80, b"A" * 8))
    src.write_bytes(data)
    stats = npr.prune_file(src, dst, 90)
    assert src.read_bytes() == data and len(dst.read_bytes()) == len(data)
    assert b"A" * 8 not in dst.read_bytes() and "zeroed 0.0 MB" in stats.line(90)
