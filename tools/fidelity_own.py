"""Runs DeepEP's own benchmark functions, unchanged, where their scripts cannot be told what to run
from the command line (tools/fidelity.py starts this in the library's venv).

v1: tests/test_intranode.py times one SM count per process (its ``test_loop`` fixes
    ``for i in (24, )``). This spawns the ranks as that script does (torch.multiprocessing, one
    per GPU), joins them with the script's own ``init_dist``, builds the ``deep_ep.Buffer`` the
    way its ``test_loop`` does, seeds as it does, and calls its ``test_main`` once per SM count
    given; every figure is printed by ``test_main`` itself.
v2: tests/elastic/test_ep.py runs its correctness and timing over every mode of its
    ``enumerate_ep_modes`` (144 of them, 5 timed variants each, several minutes per SM count).
    This runs its ``test_loop`` with that generator narrowed to the modes named by ``--mode``
    (each a tuple in the generator's own order); what each mode does is untouched.

The arguments after ``--`` go to the script's own argument parser, read from the script (the
``add_argument`` calls of its ``__main__`` block), so the defaults are the script's.

    python tools/fidelity_own.py v1 --tests /tmp/deepep-v1/tests --sms 8,16,24,32 -- \\
        --num-processes 4 --num-tokens 4096 --hidden 7168 --num-topk 8 --num-experts 256
    python tools/fidelity_own.py v2 --tests /tmp/deepep-v2/tests/elastic --mode 1,1,0,0,0,0,0 -- \\
        --num-processes 4 --num-sms 24 --num-tokens 4096 --hidden 7168 --num-topk 8 --num-experts 256
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Any, List, Sequence, Tuple

SCRIPTS = {"v1": "test_intranode.py", "v2": "test_ep.py"}


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def their_parser(script: Path) -> argparse.ArgumentParser:
    """The script's own ArgumentParser: the statements of its ``__main__`` block up to the one
    that parses the command line, run on their own (they only build the parser)."""
    tree = ast.parse(script.read_text(), str(script))
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            body = []
            for stmt in node.body:
                if "parse_args" in ast.dump(stmt):
                    break
                body.append(stmt)
            ns: dict = {"argparse": argparse}
            exec(compile(ast.Module(body=body, type_ignores=[]), str(script), "exec"), ns)
            parser = ns.get("parser")
            if isinstance(parser, argparse.ArgumentParser):
                return parser
    raise SystemExit(f"{script}: no argument parser found in its __main__ block")


def _v1_rank(local_rank: int, num_local_ranks: int, tests: str, args: Any, sms: Sequence[int]) -> None:
    sys.path.insert(0, tests)
    import torch
    import torch.distributed as dist

    import deep_ep
    import test_intranode as t

    rank, num_ranks, group = t.init_dist(local_rank, num_local_ranks)
    buffer = deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    torch.manual_seed(rank)
    for n in sms:
        t.test_main(args, n, local_rank, num_ranks, rank, buffer, group)
        if local_rank == 0:
            print("", flush=True)
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


def _v2_rank(local_rank: int, num_local_ranks: int, tests: str, args: Any,
             modes: List[Tuple[int, ...]]) -> None:
    sys.path.insert(0, tests)
    import test_ep as t

    every = t.enumerate_ep_modes
    t.enumerate_ep_modes = lambda: (m for m in every() if tuple(m) in modes)
    kept = sum(1 for _ in t.enumerate_ep_modes())
    if local_rank == 0:
        print(f"[fidelity] modes of enumerate_ep_modes run: {kept} of {sum(1 for _ in every())}", flush=True)
    if not kept:
        raise RuntimeError(f"none of the modes {modes} is one of test_ep.py's enumerate_ep_modes")
    t.test_loop(local_rank, num_local_ranks, args)


def main(argv: "List[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    theirs = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python tools/fidelity_own.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("library", choices=sorted(SCRIPTS))
    ap.add_argument("--tests", required=True, help="the folder holding the library's test script")
    ap.add_argument("--sms", default="24", help="v1: comma-separated SM counts, one test_main each")
    ap.add_argument("--mode", action="append", default=[],
                    help="v2: a mode of enumerate_ep_modes to run, comma-separated (repeatable)")
    args = ap.parse_args(ours)
    tests = str(Path(args.tests).resolve())
    script = Path(tests) / SCRIPTS[args.library]
    if not script.is_file():
        raise SystemExit(f"{script}: no such file")
    sys.path.insert(0, tests)  # the spawned ranks get the parent's sys.path
    their_args = their_parser(script).parse_args(theirs)
    import torch.multiprocessing as mp

    if args.library == "v1":
        sms = [int(v) for v in args.sms.split(",") if v.strip()]
        mp.spawn(_v1_rank, args=(their_args.num_processes, tests, their_args, sms), nprocs=their_args.num_processes)
    else:
        modes = [tuple(int(v) for v in m.split(",")) for m in args.mode]
        if not modes:
            raise SystemExit("v2: give at least one --mode")
        mp.spawn(_v2_rank, args=(their_args.num_processes, tests, their_args, modes), nprocs=their_args.num_processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
