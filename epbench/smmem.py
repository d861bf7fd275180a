"""``python -m epbench.smmem``: what N SMs move through their own GPU's memory, loads and stores apart.

    python -m epbench.smmem --sms 1,2,4,8,16 --rows 1,2,3,4 --csv smmem.csv

One GPU, nothing crosses a link: the per-SM side of the bounds that the combine meets at few SMs (it loads a
token's rows and stores one; notes/LATENCY-NEXT.md). One block per SM, the rows laid out as the combine's local-sum
ceiling lays them out ([rows][tokens][hidden] bf16, token t's row j at j * tokens + t), each kernel of
csrc/ceiling.cu:

- ``load``: 16-byte register loads, a warp per token, 16 vectors a lane in flight; each token's rows folded by XOR
  into one word (checked against the same fold on the host, so no load can be dropped).
- ``bulk Nw``: TMA bulk copies of 7 KiB pieces into a ring of shared memory (28 pieces in flight a SM), issued by
  lane 0 of N warps a block (1, 4, 14), each with its share of the ring and its own tokens; the first word of
  every piece folded into a word an issuer (checked).
- ``store``: 16-byte register stores of one row a token (checked: every vector holds its own position).
- ``sum``: the local-sum ceiling of ``epbench ceiling`` (k rows in, one bf16 row out, fp32 adds), its register
  shapes (the faster of two); checked bit for bit against the fp32 sum in row order.
- ``bulk sum``: its bulk-copy shape: the rows brought into shared memory by TMA bulk copies, 7 loading warps a SM
  (each bringing k 3.5 KiB pieces into its 2 stages in turn, 4 stages of 2 pieces where k <= 2) with 3 summing warps each (summing and storing a share
  of every piece); k <= 4; checked bit for bit. ``epbench ceiling``'s local sum is the fastest of the three shapes.
- ``bulk read``: the same loaders, stages and summers reading every vector of each stage from shared memory, without
  the sum and the stores (each block's reads XOR-folded into a word and compared: every vector read once, though a
  fold cannot tell which slot a vector came from): what the bulk sum's pipeline costs by itself, i.e. whether
  shared memory, written by the copies and read by the summers, bounds the sum.

Columns: us (median of --iters launches, device events), MB moved (loads + stores), GB/s and GB/s per SM; for
``sum`` also ``apart us``, the ``load`` of the same rows plus the ``store`` of one row a token measured apart, i.e.
what the sum would take if an SM's loads and stores could not overlap (for ``bulk sum``: the fastest ``bulk``
load plus the store). A row whose check fails says WRONG and the
command exits 1. ``--csv PATH`` writes every row and, beside it (PATH.json), what produced them (commit, versions,
GPU, options).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from epbench.errors import UserError

MODES = {"load": 0, "bulk": 1, "store": 2, "bulk read": 3}  # csrc/ceiling.cu SmMemMode
THREADS = 512
BULK_ISSUERS = (1, 4, 14)  # issuing warps a block of the bulk loads, each with its share of the 28-piece ring
BULK_PIECE = 7168  # csrc/ceiling.cu kBulkPiece: bytes of one bulk copy
COLUMNS = ("sms", "kernel", "rows_per_token", "time_us", "mbytes", "gbps", "gbps_per_sm", "apart_us", "check",
           "hidden", "tokens", "git_commit")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (UserError, exit 2) instead of the usage and a line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from epbench import scenario

    ap = _Parser(prog="python -m epbench.smmem", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", default="1,2,4,8,16", help="SM counts (one block each), comma-separated")
    ap.add_argument("--rows", default="1,2,3,4", help="rows a token loads (the combine's rows per token), comma-separated")
    ap.add_argument("--hidden", type=int, default=7168, help="bf16 elements a row (a multiple of 8, >= 256)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens (rows a token x tokens x hidden x 2 bytes loaded)")
    ap.add_argument("--iters", type=int, default=20, help="timed launches per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed launches before them")
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows into this CSV file (+ .json beside)")
    a = ap.parse_args(list(argv))
    a.sms = scenario.maybe_int_list(a.sms, "--sms", scenario.MAX_SMS)
    a.rows = scenario.maybe_int_list(a.rows, "--rows", 16)
    if a.hidden < 256 or a.hidden % 8:
        raise UserError(f"--hidden: must be a multiple of 8 and at least 256, got {a.hidden}")
    for opt, v, low in (("--tokens", a.tokens, 1), ("--iters", a.iters, 1), ("--warmup", a.warmup, 0)):
        if v < low:
            raise UserError(f"{opt}: must be at least {low}, got {v}")
    if a.csv is not None and (a.csv.is_dir() or not a.csv.parent.is_dir()):
        raise UserError(f"--csv: {a.csv} must be a file name in an existing folder")
    if a.csv is not None:  # before minutes of measuring: a folder that can take the file
        from epbench.results import check_writable

        check_writable(a.csv.parent)
    return a


def moved_bytes(kernel: str, k: int, tokens: int, hidden: int) -> int:
    """Bytes through the SMs: k rows loaded a token, one stored (``sum``), one stored (``store``)."""
    row = hidden * 2
    loads = 0 if kernel == "store" else k  # load, bulk Nw, sum
    stores = 1 if kernel in ("store", "sum", "bulk sum") else 0
    return (loads + stores) * row * tokens


def row_of(sms: int, kernel: str, k: Optional[int], time_us: float, nbytes: int, check: str,
           apart_us: Optional[float] = None) -> Dict[str, Any]:
    gbps = nbytes / time_us / 1e3  # bytes / us -> GB/s
    return {"sms": sms, "kernel": kernel, "rows_per_token": k, "time_us": time_us, "mbytes": nbytes / 1e6,
            "gbps": gbps, "gbps_per_sm": gbps / sms, "apart_us": apart_us, "check": check}


def format_row(r: Dict[str, Any]) -> str:
    k = "" if r["rows_per_token"] is None else r["rows_per_token"]
    apart = "" if r["apart_us"] is None else f"{r['apart_us']:.1f}"
    return (f"{r['sms']:>4} {r['kernel']:>9} {k!s:>4} {r['time_us']:>9.1f} {r['mbytes']:>8.1f} {r['gbps']:>8.1f} "
            f"{r['gbps_per_sm']:>8.1f} {apart:>8} {r['check']}")


HEADER = f"{'SMs':>4} {'kernel':>9} {'rows':>4} {'us':>9} {'MB':>8} {'GB/s':>8} {'per SM':>8} {'apart us':>8} check"


def xor_fold(words: Any) -> Any:
    """XOR of int32 words along the last axis (numpy)."""
    import numpy as np

    return np.bitwise_xor.reduce(words, axis=-1)


def expected_load_words(src_words: Any, k: int) -> Any:
    """The load kernel's word for each token: every int32 of its k rows XOR-folded. src_words [rows, tokens, hidden/2]."""
    return xor_fold(src_words[:k].transpose(1, 0, 2).reshape(src_words.shape[1], -1))


def expected_block_words(per_token: Any, blocks: int) -> Any:
    """The bulk-read kernel's word for each block: the per-token words (expected_load_words) of its tokens (b, b +
    blocks, ...) XOR-folded."""
    import numpy as np

    return np.array([xor_fold(per_token[b::blocks]) if b < len(per_token) else 0 for b in range(blocks)],
                    dtype=np.int32)


def expected_bulk_words(src_words: Any, k: int, issuers: int) -> Any:
    """The bulk-load kernel's word for each issuer (blocks x warps of them): the first int32 of every piece of every
    row of its tokens (tokens g, g + issuers, ...) XOR-folded."""
    import numpy as np

    heads = src_words[:k, :, :: BULK_PIECE // 4]  # [k, tokens, pieces]
    per_token = xor_fold(heads.transpose(1, 0, 2).reshape(heads.shape[1], -1))
    out = np.zeros(issuers, dtype=np.int32)
    for g in range(issuers):
        out[g] = xor_fold(per_token[g::issuers]) if g < len(per_token) else 0
    return out


def measure(a: argparse.Namespace, say: Callable[[str], None]) -> List[Dict[str, Any]]:
    import torch

    from epbench import ceiling

    fn = ceiling._ceiling_kernel("ep_sm_mem")
    summer = ceiling.kernel_sum_provider()
    if fn is None or summer is None:
        raise UserError("the kernels library is not built here (make build on a host with nvcc and a GPU)")
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = types.SimpleNamespace(device=dev, sync=None)
    kmax = max(a.rows)
    gen = torch.Generator(device=dev).manual_seed(1234)
    src = torch.randn(kmax, a.tokens, a.hidden, device=dev, generator=gen).to(torch.bfloat16)
    src_words = src.view(torch.int32).cpu().numpy()
    out = torch.empty(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    words = torch.empty(max(a.tokens, max(a.sms) * max(BULK_ISSUERS)), device=dev, dtype=torch.int32)

    def timed(launch: Callable[[Any], int], name: str) -> float:
        return statistics.median(ceiling._timed_launches(launch, name, comm, a.warmup, a.iters))

    def mem(mode: str, k: int, sms: int, dst: Any, threads: int = THREADS) -> Callable[[Any], int]:
        return lambda stream: fn(MODES[mode], dst.data_ptr(), src.data_ptr(), a.tokens, k, a.hidden, sms, threads,
                                 stream)

    sums: Dict[int, Any] = {}  # the fp32 sum of a token's k rows in row order, rounded to bf16
    acc = torch.zeros(a.tokens, a.hidden, device=dev)
    for j in range(kmax):
        acc += src[j].float()
        if j + 1 in a.rows:
            sums[j + 1] = acc.to(torch.bfloat16)
    del acc
    stored = torch.arange(a.hidden // 8, device=dev, dtype=torch.int32)
    rows: List[Dict[str, Any]] = []
    for sms in a.sms:
        out.fill_(float("nan"))
        t_store = timed(mem("store", 1, sms, out), "ep_sm_mem")
        o = out.view(torch.int32).view(a.tokens, a.hidden // 8, 4)
        tt = torch.arange(a.tokens, device=dev, dtype=torch.int32)[:, None]
        ok = bool((o[..., 0] == tt).all() and (o[..., 1] == stored).all() and (o[..., 2] == (tt ^ stored)).all()
                  and (o[..., 3] == 1).all())
        rows.append(row_of(sms, "store", None, t_store, moved_bytes("store", 1, a.tokens, a.hidden), "ok" if ok else "WRONG"))
        say(format_row(rows[-1]))
        for k in a.rows:
            words.fill_(0)
            t_load = timed(mem("load", k, sms, words), "ep_sm_mem")
            ok = (words[: a.tokens].cpu().numpy() == expected_load_words(src_words, k)).all()
            rows.append(row_of(sms, "load", k, t_load, moved_bytes("load", k, a.tokens, a.hidden), "ok" if ok else "WRONG"))
            say(format_row(rows[-1]))
            t_bulk_best = float("inf")
            for w in BULK_ISSUERS:
                words.fill_(0)
                t_bulk = timed(mem("bulk", k, sms, words, 32 * w), "ep_sm_mem")
                ok = (words[: sms * w].cpu().numpy() == expected_bulk_words(src_words, k, sms * w)).all()
                rows.append(row_of(sms, f"bulk {w}w", k, t_bulk, moved_bytes("bulk", k, a.tokens, a.hidden),
                                   "ok" if ok else "WRONG"))
                say(format_row(rows[-1]))
                t_bulk_best = min(t_bulk_best, t_bulk)
            t_sum, sum_ok = float("inf"), True
            for threads in ceiling.SUM_THREADS:  # both shapes, the faster kept; either one wrong fails the row
                out.fill_(float("nan"))
                t_sum = min(t_sum, statistics.median(summer(out, src, a.tokens, k * a.tokens, a.hidden, sms, threads,
                                                            comm, a.warmup, a.iters)))
                sum_ok = sum_ok and torch.equal(out, sums[k])
            rows.append(row_of(sms, "sum", k, t_sum, moved_bytes("sum", k, a.tokens, a.hidden),
                               "ok" if sum_ok else "WRONG", apart_us=t_load + t_store))
            say(format_row(rows[-1]))
            if k <= ceiling.BULK_SUM_MAX_ROWS:
                out.fill_(float("nan"))
                t_bs = statistics.median(summer(out, src, a.tokens, k * a.tokens, a.hidden, sms,
                                                ceiling.BULK_SUM_THREADS, comm, a.warmup, a.iters))
                rows.append(row_of(sms, "bulk sum", k, t_bs, moved_bytes("bulk sum", k, a.tokens, a.hidden),
                                   "ok" if torch.equal(out, sums[k]) else "WRONG", apart_us=t_bulk_best + t_store))
                say(format_row(rows[-1]))
                words.fill_(-1)  # the kernel zeroes its blocks' words: a block that did not run fails the check
                t_br = timed(mem("bulk read", k, sms, words, ceiling.BULK_SUM_THREADS), "ep_sm_mem")
                ok = (words[:sms].cpu().numpy() == expected_block_words(expected_load_words(src_words, k), sms)).all()
                rows.append(row_of(sms, "bulk read", k, t_br, moved_bytes("bulk read", k, a.tokens, a.hidden),
                                   "ok" if ok else "WRONG"))
                say(format_row(rows[-1]))
    return rows


def commit_label(info: Dict[str, Any]) -> str:
    """epbench's commit as provenance found it, with the build stamp beside a dirty checkout that holds another
    commit (a copy laid over an older checkout: provenance.git_commit names both)."""
    label = str(info.get("git_commit") or "unknown")  # null in a hand-edited meta.json too
    stamped = info.get("git_commit_stamped")
    return f"{label} (build stamp {stamped})" if stamped else label


def write_csv(path: Path, rows: List[Dict[str, Any]], a: argparse.Namespace, info: Dict[str, Any]) -> None:
    """The rows into ``path`` (COLUMNS) and what produced them (provenance, the options) into ``path``.json."""
    from epbench import ceiling

    commit = commit_label(info)
    full = [{**r, "hidden": a.hidden, "tokens": a.tokens, "git_commit": commit} for r in rows]
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    ceiling.write_csv(path, full, {**info, "options": options}, COLUMNS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse_args(argv)
        import torch

        if not torch.cuda.is_available():
            raise UserError("needs a CUDA GPU (it measures one GPU's SMs)")
        from epbench import ceiling, launch, provenance

        launch.apply_safe_env()
        info = provenance.collect(argv, "cuda")
        print(f"epbench smmem: {commit_label(info)}, {torch.cuda.get_device_name()}, torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}; hidden {a.hidden} bf16, {a.tokens} tokens, "
              f"median of {a.iters} launches after {a.warmup}; one block a SM: {THREADS} threads for load and store, "
              f"32 an issuing warp for bulk, {' and '.join(map(str, ceiling.SUM_THREADS))} for the register sum, "
              f"{ceiling.BULK_SUM_THREADS} for the bulk sum")
        print(HEADER)
        try:
            rows = measure(a, lambda line: print(line, flush=True))
        except torch.cuda.OutOfMemoryError:
            gb = (max(a.rows) + 1) * a.tokens * a.hidden * 2 * 2 / 1e9  # the rows, the output and the sums kept
            raise UserError(f"out of GPU memory for {max(a.rows)} rows x {a.tokens} tokens x hidden {a.hidden} "
                            f"(~{gb:.1f} GB with the expected sums): use fewer --tokens or --rows") from None
        if a.csv is not None:
            write_csv(a.csv, rows, a, info)
            print(f"rows: {a.csv}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    wrong = [r for r in rows if r["check"] != "ok"]
    if wrong:
        print(f"VERIFICATION FAILED: {len(wrong)} row(s) WRONG (a kernel did not do all the work it was timed for)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
