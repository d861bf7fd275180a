"""The host checks of eph_dispatch / eph_combine's arguments (csrc/nvshmem/hier_args.h), compiled with the
host compiler alone (no CUDA, no NVSHMEM). A call refused on one rank leaves every other rank waiting in
the count exchange until its timeout, so what matters most is what must NOT be refused: an fp8 dispatch of
0 tokens, whose empty scale tensor has data_ptr() 0 (the 2026-11-26 failure of em1/em128 fp8 uniform h2048
on 4 x H200, where rank 1 has 0 tokens)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "nvshmem" / "hier_args.h"

DRIVER = r"""
#include <iostream>
#include <string>
#include "hier_args.h"
// one call per input line: who num_tokens max_tokens nodes num_sms send_blocks chunk needs_scales has_scales
int main() {
  std::string who;
  int t, tmax, nodes, sms, send, chunk, needs, has;
  while (std::cin >> who >> t >> tmax >> nodes >> sms >> send >> chunk >> needs >> has) {
    char msg[160] = "";
    int blocks = -7;
    const eph::CallArgs a{who.c_str(), t, tmax, nodes, sms, send, chunk, needs != 0, has != 0};
    const int rc = eph::check_call(a, &blocks, msg, sizeof(msg));
    std::cout << rc << " " << blocks << " " << msg << "\n";
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("nvcc")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("hier-args")
    (d / "driver.cpp").write_text(DRIVER)
    exe = d / "driver"
    r = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(HEADER.parent), str(d / "driver.cpp"),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def run(exe: Path, calls: List[Tuple]) -> List[Tuple[int, int, str]]:
    text = "".join(" ".join(str(int(v) if isinstance(v, bool) else v) for v in c) + "\n" for c in calls)
    r = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    out = []
    for line in r.stdout.splitlines():
        rc, blocks, *msg = line.split(" ", 2)
        out.append((int(rc), int(blocks), msg[0] if msg else ""))
    assert len(out) == len(calls)
    return out


def test_an_fp8_dispatch_of_zero_tokens_without_scales_is_accepted(checker: Path) -> None:
    # the failing case's rank 1: tokens [512, 0, 300, 1] -> 0 tokens of max 512, 2 nodes, sms 4 / 24
    assert run(checker, [("eph_dispatch", 0, 512, 2, 4, 2, 4, True, False),
                         ("eph_dispatch", 0, 512, 2, 24, 6, 4, True, False)]) == [(0, 2, ""), (0, 6, "")]


def test_an_fp8_dispatch_of_tokens_without_scales_is_refused(checker: Path) -> None:
    assert run(checker, [("eph_dispatch", 1, 512, 2, 4, 2, 4, True, False)]) == [
        (-1, -7, "eph_dispatch: fp8 needs scales (1 tokens)")]


def test_the_other_checks_keep_their_messages(checker: Path) -> None:
    got = run(checker, [
        ("eph_dispatch", 513, 512, 2, 4, 2, 4, False, False),
        ("eph_dispatch", -1, 512, 2, 4, 2, 4, False, False),
        ("eph_dispatch", 5, 512, 2, 4, 2, 0, False, False),
        ("eph_dispatch", 5, 512, 2, 4, 2, 1025, False, False),
        ("eph_dispatch", 5, 512, 2, 4, 4, 4, False, False),
        ("eph_combine", 5, 512, 2, 4, 0, 1, False, False),
        ("eph_combine", 5, 512, 1, 0, 0, 1, False, False),
    ])
    assert got == [
        (-1, -7, "eph_dispatch: 513 tokens (0..512)"),
        (-1, -7, "eph_dispatch: -1 tokens (0..512)"),
        (-1, -7, "eph_dispatch: chunk 0 (1..1024)"),
        (-1, -7, "eph_dispatch: chunk 1025 (1..1024)"),
        (-1, -7, "eph_dispatch: 4 sending blocks of 4: need 1 .. num_sms - 1"),
        (-1, -7, "eph_combine: 0 sending blocks of 4: need 1 .. num_sms - 1"),
        (-1, -7, "eph_combine: num_sms 0"),
    ]


def test_one_node_launches_no_sending_block(checker: Path) -> None:
    # one node: send_blocks is ignored (any value) and 0 blocks feed the network
    assert run(checker, [("eph_dispatch", 5, 512, 1, 4, 9, 4, True, True),
                         ("eph_combine", 0, 512, 1, 1, 0, 1, False, False)]) == [(0, 0, ""), (0, 0, "")]
