"""python -m epbench.smmem on CPU: its options, its byte counts and the host-side folds its GPU checks compare
against (each fold against a plain loop over the same words)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from epbench import smmem
from epbench.errors import UserError


@pytest.mark.parametrize("argv,what", [(["--sms", "0"], "--sms"), (["--rows", "1,x"], "--rows"),
                                       (["--hidden", "100"], "--hidden"), (["--hidden", "260"], "--hidden"),
                                       (["--tokens", "0"], "--tokens"), (["--iters", "0"], "--iters"),
                                       (["--csv", "/nonexistent-folder/x.csv"], "--csv")])
def test_bad_options_name_the_option(argv, what) -> None:
    with pytest.raises(UserError, match=what):
        smmem.parse_args(argv)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (no file can be made there)")
def test_a_csv_folder_that_cannot_take_the_file_is_refused_before_measuring() -> None:
    with pytest.raises(UserError, match="/proc: cannot write there"):
        smmem.parse_args(["--csv", "/proc/m.csv"])


def test_bad_option_is_one_line_and_exit_2(capsys) -> None:
    assert smmem.main(["--sms", "4,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --sms")


def test_defaults() -> None:
    a = smmem.parse_args([])
    assert a.sms == (1, 2, 4, 8, 16) and a.rows == (1, 2, 3, 4) and a.hidden == 7168 and a.tokens == 4096


def test_moved_bytes_count_loads_and_stores() -> None:
    row = 7168 * 2
    assert smmem.moved_bytes("load", 3, 10, 7168) == 3 * row * 10
    assert smmem.moved_bytes("bulk 4w", 2, 10, 7168) == 2 * row * 10
    assert smmem.moved_bytes("store", 3, 10, 7168) == row * 10
    assert smmem.moved_bytes("sum", 3, 10, 7168) == 4 * row * 10
    assert smmem.moved_bytes("bulk sum", 3, 10, 7168) == 4 * row * 10


def test_row_rates() -> None:
    r = smmem.row_of(4, "sum", 3, 100.0, 40_000_000, "ok", apart_us=120.0)
    assert r["gbps"] == pytest.approx(400.0) and r["gbps_per_sm"] == pytest.approx(100.0)
    assert "120.0" in smmem.format_row(r) and r["check"] == "ok"


def _words(k: int, tokens: int, hidden: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(-2**31, 2**31 - 1, size=(k, tokens, hidden // 2), dtype=np.int64).astype(np.int32)


def test_load_fold_is_every_word_of_a_tokens_rows() -> None:
    w = _words(4, 5, 512)
    for k in (1, 3, 4):
        want = []
        for t in range(5):
            f = 0
            for j in range(k):
                for x in w[j, t]:
                    f ^= int(x)
            want.append(np.int32(f))
        got = smmem.expected_load_words(w, k)
        assert list(got) == want
    # a dropped row changes the fold: the GPU check can fail
    assert (smmem.expected_load_words(w, 3) != smmem.expected_load_words(w, 2)).any()


def test_bulk_fold_is_each_pieces_first_word_per_issuer() -> None:
    hidden = 7168 + 256  # 2 full pieces of 7 KiB and a short third
    w = _words(2, 7, hidden)
    step = smmem.BULK_PIECE // 4
    for blocks in (1, 3, 9):
        got = smmem.expected_bulk_words(w, 2, blocks)
        for b in range(blocks):
            f = 0
            for t in range(b, 7, blocks):
                for j in range(2):
                    for q in range(0, hidden // 2, step):
                        f ^= int(w[j, t, q])
            assert got[b] == np.int32(f)


def test_bulk_read_fold_is_every_word_of_a_blocks_tokens() -> None:
    w = _words(3, 7, 7168 + 256)
    per_token = smmem.expected_load_words(w, 3)
    for blocks in (1, 3, 9):
        got = smmem.expected_block_words(per_token, blocks)
        assert len(got) == blocks
        for b in range(blocks):
            f = 0
            for t in range(b, 7, blocks):
                for j in range(3):
                    for x in w[j, t]:
                        f ^= int(x)
            assert got[b] == np.int32(f)
    # a block that skipped a row fails the check
    assert (smmem.expected_block_words(smmem.expected_load_words(w, 2), 3) != smmem.expected_block_words(per_token, 3)).any()


def test_without_a_gpu_one_line_and_exit_2(capsys, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert smmem.main(["--sms", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: needs a CUDA GPU (it measures one GPU's SMs)"]


def test_commit_label_names_the_build_stamp_beside_a_stale_checkout() -> None:
    assert smmem.commit_label({"git_commit": "abc"}) == "abc"
    assert smmem.commit_label({"git_commit": "abc+dirty", "git_commit_stamped": "def"}) == \
        "abc+dirty (build stamp def)"
    assert smmem.commit_label({}) == "unknown"


def test_csv_rows_and_provenance(tmp_path) -> None:
    import csv
    import json

    a = smmem.parse_args(["--sms", "4", "--rows", "3", "--csv", str(tmp_path / "m.csv")])
    rows = [smmem.row_of(4, "sum", 3, 100.0, 40_000_000, "ok", apart_us=120.0),
            smmem.row_of(4, "store", None, 50.0, 10_000_000, "ok")]
    smmem.write_csv(a.csv, rows, a, {"git_commit": "abc+dirty", "git_commit_stamped": "def", "torch": "x"})
    got = list(csv.DictReader(a.csv.open()))
    assert [r["kernel"] for r in got] == ["sum", "store"] and list(got[0]) == list(smmem.COLUMNS)
    assert got[0]["apart_us"] == "120.0" and got[1]["rows_per_token"] == "" and got[0]["hidden"] == "7168"
    assert got[0]["git_commit"] == "abc+dirty (build stamp def)"
    meta = json.loads((tmp_path / "m.csv.json").read_text())
    assert meta["options"]["sms"] == [4] and meta["options"]["csv"] == str(tmp_path / "m.csv") and meta["torch"] == "x"


@pytest.mark.parametrize("argv", [["--bogus"], ["--hidden", "x"]])
def test_argparse_errors_are_one_line(argv, capsys) -> None:
    assert smmem.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
