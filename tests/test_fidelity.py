"""tools/fidelity.py and its helpers (fidelity_parse, fidelity_own, fidelity_calls, fidelity_phases):
the parsers on output written here in each script's print format, the commands per library, the
table's ratios and flags, the reference's phase table, failing and missing libraries, bad input.
No GPU, no torchrun: the commands run through a fake runner, except one short real subprocess for
the timeout; the symm-mem and FlashInfer calls run against the fakes of their backends' tests
(ranks as threads), the reference's phases in a one-rank gloo group."""

import argparse
import json
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import baselines  # noqa: E402
import fidelity as fid  # noqa: E402
import fidelity_own as own  # noqa: E402
import fidelity_parse as fp  # noqa: E402
from epbench import results  # noqa: E402
from epbench.errors import UserError  # noqa: E402


# ---- output in the libraries' print formats (written from their f-strings) ----------------------

def v1_block(sms, dtype, op, times, default_us):
    """One tuning block of test_intranode.py: a line per chunk, the default, the Best line."""
    lines = [f"[tuning] SMs {sms}, NVL chunk {c}: {1e3 / t:.2f} GB/s (NVL), {t:.2f} us" for c, t in times]
    lines.append(f"[tuning] SMs {sms}, NVL chunk default: {1e3 / default_us:.2f} GB/s (NVL), {default_us:.2f} us")
    c, t = min(times, key=lambda ct: ct[1])
    if op == "dispatch":
        lines.append(f"[tuning] Best dispatch ({dtype}): SMs {sms}, NVL chunk {c}, {1e3 / t:.2f} GB/s (NVL), t: {t:.2f} us")
    else:
        lines.append(f"[tuning] Best combine: SMs {sms}, NVL chunk {c}: {1e3 / t:.2f} GB/s (NVL), t: {t:.2f} us")
    return lines + [""]


def v1_output(sms_list=(8, 16)):
    out = ["[config] num_tokens=4096, hidden=7168, num_topk=8", "[layout] Kernel performance: 0.051 ms", "",
           "[testing] Running with BF16, without top-k (async=False, previous=False) ... passed"]
    for n in sms_list:
        out += v1_block(n, "FP8", "dispatch", [(4, 300.0 / n), (6, 250.0 / n)], 280.0 / n)
        out += v1_block(n, "BF16", "dispatch", [(4, 500.0 / n), (6, 450.0 / n)], 480.0 / n)
        out += v1_block(n, "", "combine", [(1, 700.0 / n), (2, 650.0 / n)], 660.0 / n)
    return "\n".join(out) + "\n"


V2_MODE_LINE = (" > Testing with do_handle_copy={0}, expert_alignment={1}, use_fp8_dispatch={2}, num_bias={3}, "
                "with_previous_event={4}, async_with_compute_stream={5}, allocate_on_comm_stream={6} ...")
V2_MARKS = {"dispatch": "*", "expanded dispatch": "-", "cached dispatch": "#", "combine": "@", "reduced combine": "+"}


def v2_line(kind, rank, world, us, us2):
    tail = "reduce" if "combine" in kind else "copy"
    return (f"   {V2_MARKS[kind]} EP: {rank:3}/{world} | {kind}: 0 GB/s (SO), {1e6 / us:.0f} GB/s (SU), "
            f"{us:.3f} us, {123456:.0f} bytes | {tail}: {1e5 / us2:.0f} GB/s, {us2:.3f} us")


def v2_output(world=2):
    out = ["Config:", " > Ranks: 1 x 2", " > #SM: 24, #QPs: 0/0", "Running all test cases:"]
    for mode, scale in (((1, 1, 0, 0, 0, 0, 0), 1.0), ((1, 128, 0, 0, 0, 0, 0), 3.0), ((1, 1, 1, 0, 0, 0, 0), 0.5)):
        out.append(V2_MODE_LINE.format(*mode))
        for kind in V2_MARKS:
            for rank in range(world):  # ranks print in any order
                r = world - 1 - rank
                out.append(v2_line(kind, r, world, scale * (100.0 + 10 * r), scale * (20.0 - 5 * r)))
        out.append("")
    return "\n".join(out) + "\n"


def hep_api(label, avg, mn, mx):
    return f"{(label + ':').ljust(48)} {1e3 / avg:.2f} GB/s (NVL), t: {avg:.1f} us [min={mn:.1f}, max={mx:.1f}], nvl_recv_bytes: 12.50 MB"


def hep_kernel(label, avg, mn, mx):
    return f"{(label + '(NVL):').ljust(48)} {1e3 / avg:.2f} GB/s, avg_t={avg:.1f} us [min={mn:.1f}, max={mx:.1f}]"


def hep_output():
    out = []
    for dt, k in (("BF16", 1.0), ("FP8", 0.6)):
        out += [f"\n=== Correctness Check ({dt}, 2 ranks) ===", "  dispatch+combine API: PASS",
                f"\n=== Torch API Benchmark ({dt}, 2 ranks) ===",
                "  Non-permute:  dispatch = dispatch_kernel + d2d + misc", "  (misc = device_sync, update_flag, etc.)",
                hep_api(f"dispatch ({dt})", 200 * k, 190 * k, 210 * k), hep_api("combine", 300, 290, 310),
                hep_api(f"dispatch+permute ({dt})", 400 * k, 390 * k, 410 * k),
                hep_api("combine+unpermute", 500, 490, 510),
                f"\n=== Kernel Benchmark ({dt}, 2 ranks) ===",
                "  Non-fused:  dispatch_kernel only  |  combine_kernel only",
                hep_kernel(f"dispatch kernel ({dt})", 150 * k, 140 * k, 160 * k),
                hep_kernel("combine kernel", 250, 240, 260),
                hep_kernel(f"fused dispatch+permute kernel ({dt})", 170 * k, 160 * k, 180 * k)]
    return "\n".join(out) + "\n"


def one(figs, **want):
    got = [f for f in figs if all(getattr(f, k) == v for k, v in want.items())]
    assert len(got) == 1, (want, got)
    return got[0]


# ---- parsers --------------------------------------------------------------------------------

def test_v1_parser_reads_default_best_and_every_chunk_per_dtype_and_sms():
    figs = fp.parse_v1(v1_output((8, 16)))
    assert len(figs) == 2 * 3 * 4  # 2 SM counts x 3 blocks x (2 chunks + default + best)
    d = one(figs, dtype="fp8", op="dispatch", sms=8, role="primary")
    assert (d.us, d.stat, d.ranks, d.variant) == (35.0, "mean", "rank 0", "default config")
    best = one(figs, dtype="bf16", op="dispatch", sms=16, role="alt")
    assert best.us == pytest.approx(450.0 / 16, abs=0.006) and best.detail["chunk"] == 6
    assert one(figs, op="combine", sms=16, role="primary").dtype == "bf16"
    assert one(figs, op="combine", sms=16, role="primary").us == pytest.approx(41.25, abs=0.006)
    assert len([f for f in figs if f.role == "extra" and f.sms == 8]) == 6


def test_v1_parser_ignores_a_block_without_its_best_line():
    text = v1_output((8,)) + "[tuning] SMs 16, NVL chunk 4: 1.00 GB/s (NVL), 99.00 us\n"
    assert {f.sms for f in fp.parse_v1(text)} == {8}


def test_v2_parser_takes_the_adapters_mode_and_the_slowest_ranks_kernel_sum():
    figs = fp.parse_v2(v2_output(), sms=24)
    d = one(figs, dtype="bf16", op="dispatch", role="primary")
    # rank 1: 110 + 15 = 125 us beats rank 0's 100 + 20
    assert d.us == pytest.approx(125.0) and d.detail["slowest_rank"] == 1 and d.sms == 24
    assert d.detail["mode"]["expert_alignment"] == 1
    assert one(figs, dtype="bf16", op="combine", role="primary").variant == "combine kernels"
    assert one(figs, dtype="bf16", op="dispatch", role="alt").variant == "cached dispatch kernels"
    assert one(figs, dtype="fp8", op="dispatch", role="primary").us == pytest.approx(62.5)
    # the aligned mode (expert_alignment 128) is kept, but never as the primary figure
    assert all(f.role == "extra" for f in figs if f.detail["mode"]["expert_alignment"] == 128)
    assert len(figs) == 3 * 5


def test_v2_modes_are_the_adapters_in_the_scripts_order():
    assert fp.v2_modes(["bf16", "fp8"]) == [(1, 1, 0, 0, 0, 0, 0), (1, 1, 1, 0, 0, 0, 0)]


def test_hybrid_ep_parser_reads_api_and_kernel_times_per_dtype():
    figs = fp.parse_hybrid_ep(hep_output(), sms=16)
    d = one(figs, dtype="fp8", op="dispatch", role="primary")
    assert d.us == pytest.approx(126.0) and d.detail["avg_over_ranks_us"] == pytest.approx(120.0)
    assert (d.stat, d.ranks, d.variant) == ("mean", "slowest", "API, cached handle")
    assert one(figs, dtype="bf16", op="combine", role="primary").us == 310.0
    assert one(figs, dtype="bf16", op="dispatch", role="alt").us == 160.0
    assert one(figs, dtype="fp8", op="combine", role="alt").variant == "kernel only"
    extras = {f.variant for f in figs if f.role == "extra"}
    assert extras == {"dispatch+permute: API, cached handle", "combine+unpermute: API, cached handle",
                      "fused dispatch+permute kernel: kernel only"}


def test_hybrid_ep_parser_needs_a_section_header():
    assert fp.parse_hybrid_ep(hep_api("dispatch (BF16)", 1, 1, 1) + "\n", 8) == []


def test_calls_parser_takes_the_slowest_ranks_median_and_mean():
    data = {"dtype": "bf16", "iters": 4, "warmup": 1, "bytes": {"dispatch": {"0": 10, "1": 10}},
            "samples_us": {"dispatch": {"0": [1, 2, 3, 100], "1": [5, 6, 7, 8]}, "combine": {"0": [1], "1": [2]}}}
    figs = fp.parse_calls(json.dumps(data))
    d = one(figs, op="dispatch", role="primary")
    assert (d.us, d.stat, d.ranks, d.sms, d.detail["slowest_rank"]) == (6.5, "p50", "slowest", None, 1)
    assert (d.library, d.variant) == ("reference", "all_to_all_single")  # files written before the library key
    assert one(figs, op="dispatch", role="alt").us == pytest.approx(26.5)
    assert fp.parse_calls("not json") == [] and fp.parse_calls("[1, 2]") == []
    data.update(library="flashinfer", variant={"dispatch": "MoeAlltoAll.dispatch", "combine": "MoeAlltoAll.combine"})
    f = one(fp.parse_calls(json.dumps(data)), op="combine", role="primary")
    assert (f.library, f.variant, f.us) == ("flashinfer", "MoeAlltoAll.combine", 2)


def phases_json(modes=("kernel", "call")):
    """tools/fidelity_phases.gather's form, two ranks: rank 1's whole call is the slower."""
    def rec(mode):
        order = {"dispatch": (["layout"] if mode == "call" else []) + ["pack", "gather", "all_to_all", "counts"],
                 "combine": ["all_to_all", "scatter", "weights", "weighted_sum"]}
        whole = {op: {"0": [90.0, 100.0, 110.0], "1": [190.0, 200.0, 210.0]} for op in order}
        phases = {op: {ph: {"0": [10.0, 10.0, 10.0], "1": [i + 1.0, 2.0 * (i + 1), 3.0 * (i + 1)]}
                       for i, ph in enumerate(order[op])} for op in order}
        return {"order": order, "whole_us": whole, "phases_us": phases,
                "wrong": {op: {"0": 0, "1": 0} for op in order}}
    return {m: rec(m) for m in modes}


def test_phase_parser_takes_the_phases_on_the_rank_whose_whole_call_is_slowest():
    figs = fp.parse_phases(phases_json(), "reference", "bf16")
    whole = one(figs, role="whole", op="dispatch", variant="call mode: whole call")
    # rank 1 (median 200) beats rank 0 (100); its phases' medians: 2, 4, 6, 8, 10 (i + 1 times 2)
    assert (whole.us, whole.detail["rank"], whole.detail["sum_of_phases_us"]) == (200.0, 1, 30.0)
    pack = one(figs, role="phase", op="dispatch", variant="call mode: pack")
    assert (pack.us, pack.detail["order"], pack.detail["max_over_ranks_us"]) == (4.0, 1, 10.0)
    assert [f.detail["phase"] for f in figs if f.role == "phase" and f.detail["mode"] == "kernel"
            and f.op == "combine"] == ["all_to_all", "scatter", "weights", "weighted_sum"]
    assert fp.parse_phases({}, "reference", "bf16") == []


# ---- the runner of their test functions -----------------------------------------------------

def test_their_parser_is_the_scripts_own(tmp_path):
    script = tmp_path / "test_x.py"
    script.write_text("import argparse\nraise SystemExit('never run')\nif __name__ == '__main__':\n"
                      "    parser = argparse.ArgumentParser()\n    parser.add_argument('--num-sms', type=int, default=7)\n"
                      "    parser.add_argument('--hidden', type=int, default=3)\n    args = parser.parse_args()\n"
                      "    raise SystemExit('nor this')\n")
    args = own.their_parser(script).parse_args(["--hidden", "5"])
    assert (args.num_sms, args.hidden) == (7, 5)
    (tmp_path / "test_y.py").write_text("x = 1\n")
    with pytest.raises(SystemExit):
        own.their_parser(tmp_path / "test_y.py")


def test_v2_runner_narrows_their_modes_and_calls_their_loop(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_ep.py").write_text(
        "seen = []\ndef enumerate_ep_modes():\n    for a in (1, 0):\n        for b in (128, 1):\n            yield (a, b)\n"
        "def test_loop(local_rank, n, args):\n    seen.extend(enumerate_ep_modes())\n    seen.append(args)\n")
    monkeypatch.delitem(sys.modules, "test_ep", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    own._v2_rank(0, 1, str(tmp_path), "ARGS", [(1, 1), (0, 128)])
    assert sys.modules["test_ep"].seen == [(1, 1), (0, 128), "ARGS"]
    assert "modes of enumerate_ep_modes run: 2 of 4" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="none of the modes"):
        own._v2_rank(1, 1, str(tmp_path), "ARGS", [(9, 9)])


def test_v1_runner_builds_the_buffer_as_their_loop_and_calls_test_main_per_sms(tmp_path, monkeypatch):
    calls = []
    dist = types.SimpleNamespace(barrier=lambda *a, **k: calls.append(("barrier",)),
                                 destroy_process_group=lambda *a, **k: calls.append(("destroyed",)))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(manual_seed=lambda seed: None, distributed=dist))
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)

    class Buffer:
        def __init__(self, *a, **kw):
            calls.append(("Buffer", a, kw))

        def destroy(self):
            calls.append(("destroy",))

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=Buffer))
    fake = types.SimpleNamespace(init_dist=lambda lr, n: (lr, n, "GROUP"),
                                 test_main=lambda args, sms, lr, n, rank, buf, group: calls.append(("test_main", sms, group)))
    monkeypatch.setitem(sys.modules, "test_intranode", fake)
    monkeypatch.setattr(sys, "path", list(sys.path))
    own._v1_rank(0, 1, str(tmp_path), "ARGS", [8, 24])
    assert calls[0] == ("Buffer", ("GROUP", int(2e9), 0),
                        {"low_latency_mode": False, "num_qps_per_rank": 1, "explicitly_destroy": True})
    assert calls[1:] == [("test_main", 8, "GROUP"), ("test_main", 24, "GROUP"), ("destroy",), ("barrier",), ("destroyed",)]


def test_runner_main_hands_their_parsed_arguments_to_the_spawned_ranks(tmp_path, monkeypatch):
    spawned = []
    mp = types.SimpleNamespace(spawn=lambda fn, args, nprocs: spawned.append((fn, args, nprocs)))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(multiprocessing=mp))
    monkeypatch.setitem(sys.modules, "torch.multiprocessing", mp)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "test_intranode.py").write_text(
        "if __name__ == '__main__':\n    import argparse\n    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--num-processes', type=int, default=8)\n"
        "    parser.add_argument('--num-tokens', type=int, default=4096)\n    args = parser.parse_args()\n")
    assert own.main(["v1", "--tests", str(tmp_path), "--sms", "8,24", "--", "--num-processes", "2"]) == 0
    ((fn, (nprocs_arg, tests, args, sms), nprocs),) = spawned
    assert (fn, nprocs, nprocs_arg, tests, sms) == (own._v1_rank, 2, 2, str(tmp_path), [8, 24])
    assert (args.num_processes, args.num_tokens) == (2, 4096)
    (tmp_path / "test_ep.py").write_text((tmp_path / "test_intranode.py").read_text())
    with pytest.raises(SystemExit, match="give at least one --mode"):
        own.main(["v2", "--tests", str(tmp_path), "--", "--num-processes", "2"])


# ---- inputs, venvs and sources ----------------------------------------------------------------

def make_venv(root, flavor=None, source=None, nccl=None):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    if flavor:
        stamp = {"flavor": flavor, "commit": baselines.FLAVORS[flavor].commit, "source": source}
        if nccl:
            stamp["nccl"] = nccl
        (root / baselines.STAMP).write_text(json.dumps(stamp))
    return root


def make_src(root, flavor, commit=None):
    lib = next(lib for lib in fid.LIBRARIES.values() if lib.flavor == flavor)
    (root / lib.script).parent.mkdir(parents=True)
    (root / lib.script).write_text("")
    (root / ".epbench-commit").write_text((commit or baselines.FLAVORS[flavor].commit) + "\n")
    return root


def never_git(cmd):
    raise AssertionError(f"git called: {cmd}")


def test_library_names_and_aliases():
    assert fid.library_names("deepep, nccl,hybrid-ep") == ["v1", "reference", "hybrid-ep"]
    for bad in ("v3", "v1,deepep", ""):
        with pytest.raises(UserError):
            fid.library_names(bad)
    assert fid.pairs(["v1=/a v2=/b", "deepep-v2=/c"], "--venv") == {"v1": "/a", "v2": "/c"}
    with pytest.raises(UserError, match="LIBRARY=PATH"):
        fid.pairs(["v1"], "--venv")


def test_resolve_venvs_and_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "own"))
    v1 = fid.LIBRARIES["v1"]
    venv, src = make_venv(tmp_path / "venv", "v1"), make_src(tmp_path / "src", "v1")
    t = fid.resolve(v1, {"v1": str(venv)}, {"v1": str(src)}, False, never_git)
    assert (t.not_run, t.src_kind, t.python) == (None, "tarball", str(venv / "bin" / "python"))
    # absent paths: bad input, or "not run" under --if-present
    with pytest.raises(UserError, match="no such folder"):
        fid.resolve(v1, {"v1": str(tmp_path / "nope")}, {}, False, never_git)
    assert f"no venv ({tmp_path / 'nope'} does not exist" in fid.resolve(v1, {"v1": str(tmp_path / "nope")}, {}, True, never_git).not_run
    assert f"no source ({tmp_path / 'nope'} does not exist" in fid.resolve(v1, {"v1": str(venv)}, {"v1": str(tmp_path / "nope")}, True, never_git).not_run
    with pytest.raises(UserError, match="no such folder"):
        fid.resolve(v1, {"v1": str(venv)}, {"v1": str(tmp_path / "nope")}, False, never_git)
    # nothing given: not run, with the option to give
    assert "none given; --venv v1=PATH" in fid.resolve(v1, {}, {}, False, never_git).not_run
    assert "none given; --src v1=PATH" in fid.resolve(v1, {"v1": str(venv)}, {}, False, never_git).not_run
    # there but not the library's: not run, one line (the other libraries still run)
    assert "holds flavor v2: make baselines" in fid.resolve(v1, {"v1": str(make_venv(tmp_path / "v2venv", "v2"))}, {}, False, never_git).not_run
    assert "has no DeepEP build" in fid.resolve(v1, {"v1": str(make_venv(tmp_path / "bare"))}, {}, False, never_git).not_run
    old = fid.resolve(v1, {"v1": str(venv)}, {"v1": str(make_src(tmp_path / "old", "v1", "0" * 40))}, False, never_git)
    assert "holds commit 000000000000, v1 is pinned at 567632dd5981" in old.not_run
    (tmp_path / "repo").mkdir()
    assert fid.resolve(v1, {"v1": str(venv)}, {"v1": str(tmp_path / "repo")}, False, lambda cmd: 0).src_kind == "git"
    assert "nor a git repository" in fid.resolve(v1, {"v1": str(venv)}, {"v1": str(tmp_path / "repo")}, False, lambda cmd: 128).not_run
    # not a venv at all: bad input
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a virtual environment"):
        fid.resolve(v1, {"v1": str(tmp_path / "empty")}, {}, True, never_git)
    # the source the venv was built from, and this tool's own venv where its stamp names the flavor
    built = make_venv(tmp_path / "built", "v1", source=str(src))
    assert fid.resolve(v1, {"v1": str(built)}, {}, False, never_git).src == str(src)
    assert fid.resolve(v1, {"v1": str(built)}, {"v1": str(tmp_path / "nope")}, True, never_git).src == str(src)
    make_venv(tmp_path / "own", "v1", source=str(src))
    assert fid.resolve(v1, {}, {}, False, never_git).venv == str(tmp_path / "own")
    # under --if-present a venv that is not there leaves the default: this tool's, built with v1
    assert fid.resolve(v1, {"v1": str(tmp_path / "nope")}, {}, True, never_git).python == sys.executable
    assert fid.resolve(fid.LIBRARIES["reference"], {}, {}, False, never_git).venv == str(tmp_path / "own")


def test_tests_of_a_git_source_are_taken_at_the_pin(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "DeepEP"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_intranode.py").write_text("# at the pin\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "pin"], check=True)
    pin = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "tests" / "test_intranode.py").write_text("# a later edit, not committed\n")
    monkeypatch.setitem(baselines.FLAVORS, "v1", baselines.Flavor("v1", pin, "main", "Buffer", ""))
    t = fid.resolve(fid.LIBRARIES["v1"], {"v1": str(make_venv(tmp_path / "venv", "v1"))}, {"v1": str(repo)},
                    False, fid._git_rc)
    assert t.src_kind == "git"
    root, why = fid.tests_folder(t, tmp_path / "out", lambda step, timeout: fid.run_step(step, timeout, tmp_path / "logs"), 30)
    assert why == "" and (root / "tests" / "test_intranode.py").read_text() == "# at the pin\n"


def ns(**kw):
    base = dict(world=None, experts=None, hidden=None, tokens=None, topk=None, device="cuda")
    return argparse.Namespace(**{**base, **kw})


def test_shape_follows_the_scenario_cut_to_the_gpus():
    from epbench import scenario

    s = scenario.load(REPO / "scenarios" / "dsv3x4.yaml")
    sh, notes = fid.shape_of(s, ns(), gpus=8)
    assert (sh.world, sh.experts, sh.experts_per_rank, notes) == (4, 256, 64, [])
    sh, notes = fid.shape_of(s, ns(), gpus=2)
    assert (sh.world, sh.experts_per_rank) == (2, 128) and "world 2" in notes[0]
    with pytest.raises(UserError, match="has 2 GPUs"):
        fid.shape_of(s, ns(world=4), gpus=2)
    with pytest.raises(UserError, match="multiple of the world"):
        fid.shape_of(s, ns(experts=250), gpus=4)
    assert fid.shape_of(s, ns(hidden=4096, tokens=128), gpus=4)[0].hidden == 4096


# ---- commands -------------------------------------------------------------------------------

def ctx_for(tmp_path, sms=(8, 16), dtypes=("bf16",)):
    sh = fid.Shape(hidden=7168, tokens=4096, topk=8, experts=256, world=4)
    files = {dt: str(tmp_path / f"scenario-{dt}.yaml") for dt in dtypes}
    return fid.Ctx(sh, tuple(sms), tuple(dtypes), files, tmp_path, warmup=5, iters=30, port=lambda: 4242)


def target(name, tmp_path, stamp=None):
    return fid.Target(fid.LIBRARIES[name], python="/venv/bin/python", venv="/venv", stamp=stamp or {}, src="/src")


def test_own_commands_per_library(tmp_path):
    ctx = ctx_for(tmp_path)
    shape = ["--num-processes", "4", "--num-tokens", "4096", "--hidden", "7168", "--num-topk", "8", "--num-experts", "256"]
    (v1,) = fid.own_steps(target("v1", tmp_path), Path("/t"), ctx)
    assert v1.cmd == ["/venv/bin/python", str(fid.TOOLS / "fidelity_own.py"), "v1", "--tests", "/t/tests",
                      "--sms", "8,16", "--"] + shape
    assert v1.env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242"}

    lib = tmp_path / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_text("")
    v2 = fid.own_steps(target("v2", tmp_path, {"nccl": {"preload": str(lib / "libnccl.so.2")}}), Path("/t"), ctx_for(tmp_path, dtypes=("bf16", "fp8")))
    assert [s.sms for s in v2] == [8, 16]
    assert v2[1].cmd[-2:] == ["--num-sms", "16"] and v2[1].cmd[4] == "/t/tests/elastic"
    assert v2[0].cmd[5:9] == ["--mode", "1,1,0,0,0,0,0", "--mode", "1,1,1,0,0,0,0"]
    assert v2[0].env["EP_DISABLE_GIN"] == "1" and v2[0].env["LD_PRELOAD"].startswith(str(lib / "libnccl.so.2"))

    hep = fid.own_steps(target("hybrid-ep", tmp_path), Path("/t"), ctx)
    assert hep[0].cmd == ["/venv/bin/python", "/t/tests/test_hybrid_ep.py", "--num-processes", "4"]
    assert {k: hep[1].env[k] for k in ("HIDDEN_DIM", "NUM_TOKENS_PER_RANK", "MAX_NUM_OF_TOKENS_PER_RANK",
                                      "NUM_LOCAL_EXPERTS", "TOPK", "NUM_SMS_DISPATCH", "NUM_SMS_COMBINE")} == \
        {"HIDDEN_DIM": "7168", "NUM_TOKENS_PER_RANK": "4096", "MAX_NUM_OF_TOKENS_PER_RANK": "4096",
         "NUM_LOCAL_EXPERTS": "64", "TOPK": "8", "NUM_SMS_DISPATCH": "16", "NUM_SMS_COMBINE": "16"}

    (ref,) = fid.own_steps(target("reference", tmp_path), None, ctx)
    assert ref.cmd[1:] == [str(fid.TOOLS / "fidelity_calls.py"), "--library", "reference", "--scenario",
                           ctx.scenario_files["bf16"], "--warmup", "5", "--iters", "30", "--device", "cuda",
                           "--out", ref.out_json]
    assert ref.out_json == str(tmp_path / "own" / "reference-bf16.json") and ref.env["MASTER_PORT"] == "4242"
    for name in ("symm-mem", "flashinfer"):
        steps = fid.own_steps(target(name, tmp_path), None, ctx_for(tmp_path, dtypes=("bf16", "fp8")))
        assert [s.dtype for s in steps] == ["bf16", "fp8"]
        assert steps[1].cmd[1:4] == [str(fid.TOOLS / "fidelity_calls.py"), "--library", name]
        assert steps[1].out_json == str(tmp_path / "own" / f"{name}-fp8.json") and steps[1].sms is None
    ctx.input_sets = 1  # the backends' phases rotate over the same input sets as epbench's run
    for name in fid.PHASED:
        (step,) = fid.own_steps(target(name, tmp_path), None, ctx)
        assert step.cmd[-2:] == ["--input-sets", "1"]
    (fi,) = fid.own_steps(target("flashinfer", tmp_path), None, ctx)
    assert "--input-sets" not in fi.cmd


def test_epbench_commands_per_library(tmp_path):
    ctx = ctx_for(tmp_path)
    common = ["-m", "epbench", "run", ctx.scenario_files["bf16"]]
    (v1,) = fid.epbench_steps(target("v1", tmp_path), ctx)
    assert v1.cmd[1:5] == common and v1.cwd == str(fid.REPO)
    assert v1.cmd[5:9] == ["--backends", "deepep", "--call-modes", "kernel,call"]
    assert v1.cmd[-4:] == ["--sms", "8,16", "--results", str(tmp_path / "epbench" / "v1" / "bf16")]
    assert "--warmup" in v1.cmd and "--input-sets" not in v1.cmd
    (hep,) = fid.epbench_steps(target("hybrid-ep", tmp_path), ctx)
    assert hep.cmd[hep.cmd.index("--sms") + 1] == "8,16" and "--option" not in hep.cmd
    ctx.input_sets = 1
    (ref,) = fid.epbench_steps(target("reference", tmp_path), ctx)
    assert "--sms" not in ref.cmd and ref.cmd[ref.cmd.index("--input-sets") + 1] == "1"


def test_every_option_given_to_epbench_run_is_one_it_takes(tmp_path):
    # docs/usage.md lists `epbench run`'s options as the CLI has them (tests/test_docs_options.py)
    usage = (REPO / "docs" / "usage.md").read_text()
    help_text = usage[usage.index("### `epbench run`"):usage.index("### `epbench sweep`")]
    ctx = ctx_for(tmp_path)
    ctx.input_sets = 1
    given = {a for name in fid.LIBRARIES for s in fid.epbench_steps(target(name, tmp_path), ctx)
             for a in s.cmd if a.startswith("--")}
    assert given >= {"--backends", "--call-modes", "--sms", "--results", "--input-sets"}
    assert all(opt in help_text for opt in given), given
    from epbench import backend_names
    from epbench.backends import backend_class

    assert {lib.backend for lib in fid.LIBRARIES.values()} <= set(backend_names.REGISTRY)
    # a library swept with --sms is one whose backend takes the sweep (a backend that ignored it
    # would give every count the same figure)
    for lib in fid.LIBRARIES.values():
        assert (lib.sms == "sweep") == backend_class(lib.backend).uses_sms, lib


def _gone(pid, wait_s=3.0):
    """True once ``pid`` has exited (a zombie counts: nothing runs)."""
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_command_past_its_timeout_is_killed_with_its_process_group(tmp_path):
    rank = "import time; time.sleep(60)"
    step = fid.Step("sleeper", [sys.executable, "-c", "import subprocess, sys; "
                                f"p = subprocess.Popen([sys.executable, '-c', {rank!r}]); print(p.pid, flush=True); p.wait()"])
    done = fid.run_step(step, timeout=0.5, log_dir=tmp_path)
    assert done.returncode is None and done.seconds < 15 and done.last_line() == "timed out"
    assert _gone(int(done.stdout.split()[0]))  # the rank it started went with it
    assert (tmp_path / "sleeper.out").read_text() == done.stdout
    done = fid.run_step(fid.Step("no such", ["/nonexistent/python"]), timeout=5, log_dir=tmp_path)
    assert done.returncode == 127 and "cannot start" in done.last_line()


# ---- table rows and flags -------------------------------------------------------------------

def rows_frame(backend, op, mode, per_rank, sms=8, wrong=0):
    """results.csv rows of one (op, call mode): per_rank = [(p50, mean), ...] by rank."""
    return pd.DataFrame([{"backend": backend, "op": op, "sms": sms, "rank": r, "call_mode": mode,
                          "time_us": p50, "time_us_mean": mean, "wrong": wrong}
                         for r, (p50, mean) in enumerate(per_rank)])


def test_ratio_is_like_for_like_and_flagged_above_ten_percent(tmp_path):
    ctx = ctx_for(tmp_path, sms=(8,))
    figs = [fp.Figure("v1", "bf16", "dispatch", 8, 100.0, "mean", "rank 0", "default config", "primary"),
            fp.Figure("v1", "bf16", "dispatch", 8, 90.0, "mean", "rank 0", "best: chunk 6", "alt"),
            fp.Figure("v1", "bf16", "combine", 8, 200.0, "mean", "rank 0", "default config", "primary")]
    df = pd.concat([rows_frame("deepep", "dispatch", "kernel", [(104.0, 105.0), (130.0, 150.0)]),
                    rows_frame("deepep", "dispatch", "call", [(300.0, 310.0), (320.0, 330.0)]),
                    rows_frame("deepep", "combine", "kernel", [(230.0, 225.0), (200.0, 200.0)], wrong=1)])
    o = fid.Outcome(target("v1", tmp_path), status="ran", figures=figs, frames={("bf16", 8): df})
    disp, comb = fid.table_rows([o], ctx)
    # rank 0's mean against rank 0's mean: 105 / 100, not the slowest rank's 150
    assert disp["ratio"] == pytest.approx(1.05) and not disp["flagged"] and disp["ratio_basis"] == "kernel"
    assert (disp["kernel_p50_us"], disp["kernel_mean_us"], disp["call_p50_us"]) == (130.0, 150.0, 320.0)
    assert (disp["alt_us"], disp["kernel_wrong"], disp["call_wrong"]) == (90.0, 0, 0)
    assert comb["ratio"] == pytest.approx(1.125) and comb["flagged"] and comb["kernel_wrong"] == 2
    assert comb["call_wrong"] is None and comb["call_p50_us"] is None


def test_ratio_falls_back_to_call_rows_and_combine_to_bf16(tmp_path):
    ctx = ctx_for(tmp_path, sms=(8,), dtypes=("fp8",))
    figs = [fp.Figure("hybrid-ep", "fp8", "dispatch", 8, 100.0, "mean", "slowest", "API, cached handle", "primary"),
            fp.Figure("v1", "bf16", "combine", 8, 50.0, "mean", "rank 0", "default config", "primary")]
    df = rows_frame("hybrid-ep", "dispatch", "call", [(100.0, 101.0), (100.0, 108.0)])
    o = fid.Outcome(target("hybrid-ep", tmp_path), status="ran", figures=figs[:1], frames={("fp8", 8): df})
    disp, comb = fid.table_rows([o], ctx)
    assert disp["ratio_basis"] == "call" and disp["ratio"] == pytest.approx(1.08) and not disp["flagged"]
    assert comb["own_us"] is None and comb["ratio"] is None
    v1 = fid.Outcome(target("v1", tmp_path), status="ran", figures=figs[1:])
    assert fid.table_rows([v1], ctx)[1]["own_us"] == 50.0  # V1 times combine once, after its BF16 dispatch
    assert fid.table_rows([fid.Outcome(target("v1", tmp_path))], ctx) == []  # not run: no rows


# ---- the whole check, with a fake runner ------------------------------------------------------

class FakeRunner:
    """Answers each step: the NCCL timer writes its JSON, V1's script fails half-way, epbench runs
    leave a results folder written by epbench's own writer."""

    def __init__(self):
        self.steps = []

    def __call__(self, step, timeout):
        self.steps.append(step)
        if step.out_json:
            Path(step.out_json).write_text(json.dumps(
                {"dtype": "bf16", "samples_us": {op: {"0": [10.0, 10.0], "1": [11.0, 11.0]} for op in ("dispatch", "combine")}}))
            return fid.Done(0, "", "", 1.0, "own.log")
        if "fidelity_own.py" in " ".join(step.cmd):
            return fid.Done(1, v1_output((4,)), "Traceback...\nAssertionError: calc_diff\n", 2.0, "v1.log")
        if step.results:
            backend = step.cmd[step.cmd.index("--backends") + 1]
            mode = "call" if backend == "flashinfer" else "kernel"  # flashinfer: a run without kernel rows
            run = Path(step.results) / "20260101T000000Z_smoke_w4"
            run.parent.mkdir(parents=True)
            w = results.RunWriter(run, {"scenario": {"name": "smoke"}, "world": 2, "torch": "x"})
            sms = 4 if backend == "deepep" else 0
            w.add([{"scenario": "smoke", "backend": backend, "op": op, "sms": sms, "rank": r, "world": 2,
                    "call_mode": mode, "time_us": 12.0 + r, "time_us_mean": 12.5 + r, "wrong": 0}
                   for op in ("dispatch", "combine") for r in range(2)], [])
            w.finish("complete")
            return fid.Done(0, "", "", 3.0, "epbench.log")
        raise AssertionError(step.cmd)


def run_check(tmp_path, monkeypatch, argv, gpus=2, runner=None, run_git=never_git):
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "own"))
    console = Console(width=250, record=True)
    code = fid.check(fid.parse_args(argv), gpus, run=runner or FakeRunner(), run_git=run_git,
                     console=console, say=lambda text: None)
    return code, console.export_text()


class FakeCallsRunner(FakeRunner):
    """As FakeRunner, with the timer's JSON as tools/fidelity_calls.py writes it: its library and
    what it called, and the phases of the reference and symm-mem."""

    def __call__(self, step, timeout):
        if not step.out_json:
            return super().__call__(step, timeout)
        self.steps.append(step)
        lib = step.cmd[step.cmd.index("--library") + 1]
        data = {"library": lib, "dtype": "bf16", "variant": {"dispatch": f"{lib} d", "combine": f"{lib} c"},
                "samples_us": {op: {"0": [10.0, 10.0], "1": [11.0, 11.0]} for op in ("dispatch", "combine")}}
        if lib in ("reference", "symm-mem"):
            data["phases"] = phases_json()
        Path(step.out_json).write_text(json.dumps(data))
        return fid.Done(0, "", "", 1.0, "own.log")


def test_check_times_the_plain_calls_and_prints_the_phase_tables(tmp_path, monkeypatch):
    fake, probes = FakeCallsRunner(), []
    code, text = run_check(tmp_path, monkeypatch, [
        "--scenario", str(REPO / "scenarios" / "smoke.yaml"), "--libraries", "reference,symm-mem,flashinfer",
        "--results", str(tmp_path / "res")], runner=fake, run_git=lambda cmd: probes.append(cmd) or 0)
    assert code == 1  # the fakes' epbench figures are 18 % over their own: flagged
    assert [c[-1] for c in probes] == [fid.PROBE_SYMM, fid.PROBE_FLASHINFER]
    rec = json.loads(next((tmp_path / "res").iterdir()).joinpath("fidelity.json").read_text())
    assert {k: v["status"] for k, v in rec["libraries"].items()} == {
        "reference": "ran", "symm-mem": "ran", "flashinfer": "ran"}
    table = {(r["library"], r["op"]): r for r in rec["table"]}
    fi = table[("flashinfer", "combine")]
    assert (fi["ratio_basis"], fi["own_variant"], fi["kernel_p50_us"]) == ("call", "flashinfer c", None)
    assert fi["ratio"] == pytest.approx(13.0 / 11.0) and "1.18 (call) !" in text
    assert table[("reference", "dispatch")]["ratio_basis"] == "kernel"
    assert table[("symm-mem", "dispatch")]["ratio_basis"] == "kernel"
    # the phase table: per mode and op, the phases in order, their sum, the whole call, the
    # epbench run's rows of that mode (the fake ran kernel rows only) and the bare call
    rows = [(r["mode"], r["op"], r["kind"], r["what"], r["us"]) for r in rec["phases"] if r["library"] == "reference"]
    kernel_dispatch = [r[2:] for r in rows if r[:2] == ("kernel", "dispatch")]
    assert kernel_dispatch == [("phase", "pack", 2.0), ("phase", "gather", 4.0), ("phase", "all_to_all", 6.0),
                               ("phase", "counts", 8.0), ("sum", "sum of the phases", 20.0),
                               ("whole", "whole call, unmarked", 200.0),
                               ("epbench", "epbench run, kernel rows", 13.0),
                               ("bare", "bare reference d", 11.0)]
    assert [r[4] for r in rows if r[:3] == ("call", "dispatch", "epbench")] == [None]
    assert [r["library"] for r in rec["phases"]].count("symm-mem") == len(rows)  # the same fake phases
    assert rec["phases"][0]["share_of_whole"] == 0.01
    assert "epbench run, kernel rows" in text
    assert "reference (NCCL): where its calls' time goes" in text
    assert "symm-mem (torch all_to_all_vdev): where its calls' time goes" in text
    # a wrong row found by the phase timer's own check fails the check as any other
    assert fid.verdict([], {}, rec["phases"]) == 0 and fid.verdict([], {}, [{"wrong": 1}]) == 1
    assert "--library symm-mem" in " ".join(next(s for s in fake.steps if s.out_json and "symm" in s.label).cmd)
    # --report prints the phase table of a recorded check too
    console = Console(width=250, record=True)
    assert fid.report([str(next((tmp_path / "res").iterdir()))], console) == 1
    assert "where its calls' time goes" in console.export_text()


def test_libraries_that_cannot_run_here_are_not_run(tmp_path):
    smoke = str(REPO / "scenarios" / "smoke.yaml")

    def targets(argv, probe_rc, gpus=2):
        probes = []
        args = fid.parse_args(["--scenario", smoke, "--libraries", "symm-mem,flashinfer"] + argv)
        got = fid.prepare(args, gpus, lambda cmd: probes.append(cmd[-1]) or probe_rc)[3]
        return {t.lib.name: t.not_run for t in got}, probes

    lines, probes = targets(["--world", "1"], 1)
    assert lines["symm-mem"] == "needs 2 ranks or more (world 1: one rank per GPU)"
    assert lines["flashinfer"].startswith(f"flashinfer is not installed in {sys.prefix}: make baselines-wheels")
    assert probes == [fid.PROBE_FLASHINFER]
    lines, probes = targets([], 1)
    assert "torch's NVSHMEM is not usable" in lines["symm-mem"] and len(probes) == 2
    assert targets([], 0)[0] == {"symm-mem": None, "flashinfer": None}
    lines, probes = targets(["--device", "cpu"], 0)
    assert set(lines.values()) == {"needs CUDA GPUs (--device cpu runs the reference only)"} and probes == []
    assert set(targets([], 0, gpus=0)[0].values()) == {"no GPU on this host (nvidia-smi -L lists none)"}


def test_check_runs_what_it_can_and_records_everything(tmp_path, monkeypatch):
    venv, src = make_venv(tmp_path / "venv", "v1"), make_src(tmp_path / "src", "v1")
    fake = FakeRunner()
    code, text = run_check(tmp_path, monkeypatch, [
        "--scenario", str(REPO / "scenarios" / "smoke.yaml"), "--libraries", "reference,v1,v2",
        "--venv", f"v1={venv}", "--src", f"v1={src}", "--results", str(tmp_path / "res")], runner=fake)
    assert code == 1  # v1's own script failed
    assert "v2: not run: no venv (none given; --venv v2=PATH" in text
    assert "v1: own benchmark (v1: tests/test_intranode.py's test_main per SM count) failed (exit 1: AssertionError: calc_diff" in text
    (out,) = (tmp_path / "res").iterdir()
    rec = json.loads((out / "fidelity.json").read_text())
    assert rec["shape"] == {"hidden": 256, "tokens": 64, "topk": 4, "experts": 16, "world": 2}
    assert rec["libraries"]["v2"]["status"] == "not run" and rec["libraries"]["v1"]["status"] == "failed"
    v1 = rec["libraries"]["v1"]
    assert v1["pinned_commit"] == baselines.FLAVORS["v1"].commit and v1["build_stamp"]["flavor"] == "v1"
    assert {s["what"] for s in v1["steps"]} == {"own", "epbench"} and len(v1["figures"]) == 12
    assert v1["epbench_runs"][0]["folder"].startswith(str(out / "epbench" / "v1" / "bf16"))
    table = {(r["library"], r["op"]): r for r in rec["table"]}
    assert table[("reference", "dispatch")]["ratio"] == pytest.approx(13.0 / 11.0)  # p50 slowest both sides
    assert table[("reference", "dispatch")]["flagged"] and table[("v1", "combine")]["own_us"] == pytest.approx(165.0)
    assert table[("v1", "dispatch")]["ratio"] == pytest.approx(12.5 / 120.0)  # rank 0's mean
    # the checked shape went to both sides: the scenario file epbench ran and the library's arguments
    scen = [s for s in fake.steps if s.results][0].cmd[4]
    assert Path(scen).parent == out and "gpus_per_node: 2" in Path(scen).read_text()
    v1_own = next(s for s in fake.steps if "fidelity_own.py" in " ".join(s.cmd))
    assert "--num-processes 2 --num-tokens 64 --hidden 256 --num-topk 4 --num-experts 16" in " ".join(v1_own.cmd)
    assert "epbench/own" in text and "1.18 (call)" not in text and "1.18 !" in text


def test_an_epbench_run_that_skips_its_backend_fails_the_library(tmp_path, monkeypatch):
    def runner(step, timeout):
        if step.out_json:
            return FakeRunner()(step, timeout)
        run = Path(step.results) / "20260101T000000Z_smoke_w2"
        run.parent.mkdir(parents=True)
        w = results.RunWriter(run, {"scenario": {"name": "smoke"}, "world": 2})
        w.add(results.unmeasured_rows("smoke", "reference", [(0, 64)], "skipped: needs CUDA GPUs"), [])
        w.finish("complete")
        return fid.Done(0, "", "", 1.0, "epbench.log")

    code, text = run_check(tmp_path, monkeypatch, ["--scenario", str(REPO / "scenarios" / "smoke.yaml"),
                                                   "--libraries", "reference", "--results", str(tmp_path / "res")],
                           runner=runner)
    assert code == 1 and "skipped: needs CUDA GPUs" in text
    rec = json.loads(next((tmp_path / "res").iterdir()).joinpath("fidelity.json").read_text())
    assert rec["libraries"]["reference"]["status"] == "failed"
    assert [r["call_p50_us"] for r in rec["table"]] == [None, None]


def test_report_joins_earlier_checks_into_one_table(tmp_path, monkeypatch, capsys):
    venv, src = make_venv(tmp_path / "venv", "v1"), make_src(tmp_path / "src", "v1")
    scen = ["--scenario", str(REPO / "scenarios" / "smoke.yaml"), "--results", str(tmp_path / "res")]
    run_check(tmp_path, monkeypatch, scen + ["--libraries", "reference"])
    run_check(tmp_path, monkeypatch, scen + ["--libraries", "v1", "--venv", f"v1={venv}", "--src", f"v1={src}"])
    folders = sorted(str(p) for p in (tmp_path / "res").iterdir())
    assert len(folders) == 2
    monkeypatch.setenv("COLUMNS", "250")
    assert fid.main(["--report"] + folders) == 1  # v1's own script failed in the second check
    out = capsys.readouterr().out
    assert "│ reference │" in out and "│ v1        │" in out
    assert sum(ln.startswith("from ") for ln in out.splitlines()) == 2
    assert "v1: own benchmark (v1: tests/test_intranode.py's test_main per SM count) failed" in out
    assert fid.main(["--report", str(tmp_path)]) == 2
    assert "not a fidelity check's folder" in capsys.readouterr().err


def test_check_without_gpus_runs_nothing_and_says_why(tmp_path, monkeypatch):
    code, text = run_check(tmp_path, monkeypatch, ["--scenario", str(REPO / "scenarios" / "smoke.yaml"),
                                                   "--libraries", "reference", "--results", str(tmp_path / "res")], gpus=0)
    assert code == 0 and "reference: not run: no GPU on this host" in text


@pytest.mark.parametrize("argv, line", [
    (["--libraries", "v3"], "unknown library 'v3'"),
    (["--libraries", "v1", "--venv", "v1=/nonexistent/venv"], "--venv v1=/nonexistent/venv: no such folder"),
    (["--dtypes", "mxfp8"], "--dtypes mxfp8"),
    (["--sms", "7", "--libraries", "v1"], "SM counts must be even"),
    (["--scenario", "scenarios/nonexistent.yaml"], "no such scenario file"),
    (["--world", "two"], "argument --world: invalid int value: 'two'"),
    (["--input-sets", "0"], "--input-sets: must be 1 to 16"),
])
def test_bad_input_is_one_line_and_exit_2(argv, line, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fid, "gpu_count", lambda: 4)
    monkeypatch.chdir(REPO)
    assert fid.main(argv + ["--results", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fidelity: error: ") and line in err and err.count("\n") == 1
    assert not (tmp_path / "res").exists()  # nothing was started


def test_gpu_count_is_what_nvidia_smi_lists_and_cuda_may_see(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert fid.gpu_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert fid.gpu_count() == 2
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert fid.gpu_count() == 0


# ---- the plain calls and the reference's phases, run ---------------------------------------------

def test_symm_mem_calls_send_the_routed_copies_both_ways():
    import torch

    import fidelity_calls as fc
    from epbench.backends.symm_mem import row_unit
    from epbench.routing import route_all, traffic
    from test_symm_mem_backend import ThreadComm, run_ranks, scenario

    s = scenario(3, dtype="fp8", hidden=256)
    total = traffic(route_all(s), s.model.experts_per_rank, 3, False).total

    def fn(rank, symm):
        comm = ThreadComm(rank, 3, symm.world_state.barrier)
        calls = fc.symm_calls(comm, s, total, symm=symm)
        samples = fc.time_calls(comm, calls, 1, 2)
        calls.close()
        return calls, samples, symm.calls, [t.clone() for t in symm._symm]

    ranks = run_ranks(3, fn)
    unit = row_unit(3)
    for rank, (calls, samples, ops, bufs) in enumerate(ranks):
        assert [len(samples[op]) for op in fc.OPS] == [2, 2] and ops == ["vdev", "vdev"] * 3
        row = calls.info["row_bytes"]
        # the bytes of a row (fp8: values and scales; combine: bf16) padded to the op's block unit
        assert row == {"dispatch": -(-(256 + 256 // 128 * 4) // unit) * unit, "combine": -(-512 // unit) * unit}
        assert calls.sent_bytes == {"dispatch": int(total[rank].sum()) * row["dispatch"],
                                    "combine": int(total[:, rank].sum()) * row["combine"]}
        # buffers in allocation order: (input, output, splits, splits and offsets) per op
        for i, (op, sent_to, got_from) in enumerate((("dispatch", total[rank], total[:, rank]),
                                                     ("combine", total[:, rank], total[rank]))):
            inp, out, splits, so = bufs[4 * i: 4 * i + 4]
            assert splits.tolist() == sent_to.tolist() and so[0].tolist() == got_from.tolist()
            want = []
            for src in range(3):  # each source's chunk for this rank, in source order
                src_in, src_splits = ranks[src][3][4 * i], ranks[src][3][4 * i + 2]
                start = int(src_splits[:rank].sum())
                want.append(src_in[start: start + int(src_splits[rank])])
            assert torch.equal(out[: int(got_from.sum())], torch.cat(want)), op


def test_flashinfer_calls_dispatch_the_routed_tokens_and_combine_from_the_workspace():
    import fidelity_calls as fc
    from epbench.routing import route_all, traffic
    from test_flashinfer_backend import fake_library, scenario
    from test_symm_mem_backend import ThreadComm, run_ranks

    s = scenario(2, "fp8", hidden=512)
    total = traffic(route_all(s), s.model.experts_per_rank, 2, False).total

    def fn(rank, symm):
        seen = []
        comm = ThreadComm(rank, 2, symm.world_state.barrier)
        calls = fc.flashinfer_calls(comm, s, total, lib=fake_library(symm.world_state, seen), group=object())
        out = calls.dispatch()
        calls.fill(out)
        got = calls.combine(out)
        samples = fc.time_calls(comm, calls, 1, 2)
        calls.close()
        return calls, out, got, samples, seen

    for rank, (calls, out, got, samples, seen) in enumerate(run_ranks(2, fn)):
        assert seen == ["dispatch", "combine"] * 4 + ["reset"] and [len(samples[op]) for op in fc.OPS] == [2, 2]
        x, scales, ids, weights = out  # fp8 rows as bytes, their scales, the ids, the weights
        assert x.shape == (2, 24, 512) and scales.shape == (2, 24, 4) and weights.shape == (2, 24, 4)
        for src in range(2):  # each source's rows first, then slots the library marks invalid
            held = int(total[src, rank])
            assert (ids[src, held:] == fc.INVALID_EXPERT).all() and (ids[src, :held] >= 0).all()
        per_token = 512 + 512 // 128 * 4 + 4 * 4 + 4 * 4
        assert calls.sent_bytes == {"dispatch": int(total[rank].sum()) * per_token,
                                    "combine": int(total[rank].sum()) * 2 * 512}
        assert got.shape == (24, 512) and calls.info["payload_bytes_per_token"] == per_token


def test_reference_phases_cover_its_calls(tmp_path):
    """The reference's own calls, marked, in a one-rank gloo group: every step of each mode is
    there, in order, the calls verify, and nothing but a sliver of each call runs after its last
    phase."""
    from statistics import median

    import torch
    import torch.distributed as dist

    import fidelity_phases as ph
    from epbench.backends.reference import ReferenceBackend
    from epbench.launch import Comm
    from epbench.scenario import parse
    from support import scenario_dict

    assert all(callable(getattr(ReferenceBackend, m)) for steps in ReferenceBackend.PHASES.values() for _, m in steps)
    one = {"name": "one", "nodes": 1, "gpus_per_node": 1}
    s = parse(scenario_dict(model={"hidden": 1024, "tokens_per_rank": 256, "topk": 4, "experts_per_rank": 8,
                                   "dispatch_dtype": "bf16"}, topology=one), "<t>")
    em = parse(scenario_dict(model={"hidden": 256, "tokens_per_rank": 32, "topk": 4, "experts_per_rank": 8,
                                    "dispatch_dtype": "mxfp8", "quantize": "fused", "layout": "expert_major",
                                    "align": 16}, topology=one), "<t>")
    combine = ["all_to_all", "scatter", "weights", "weighted_sum"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comm = Comm(0, 1, 0, torch.device("cpu"))
        got = ph.measure(comm, s, 2, 9, 2)
        for mode, first in (("kernel", []), ("call", ["layout"])):
            rec = got[mode]
            assert rec["order"] == {"dispatch": first + ["pack", "gather", "all_to_all", "counts"],
                                    "combine": combine}
            assert rec["wrong"] == {"dispatch": 0, "combine": 0}
            assert all(len(v) == 9 for op in ph.OPS for v in rec["phases_us"][op].values())
            # the phases hold the call: what runs after the last phase is a sliver of each call
            # (compared within the same calls, so a shared CPU's stalls move both sides)
            for op in ph.OPS:
                assert median(rec["unmarked_share"][op]) < 0.2, (mode, op, rec["unmarked_share"][op])
        got = ph.measure(comm, em, 1, 2, 1, modes=("kernel",))["kernel"]
        assert got["order"] == {"dispatch": ["quantize", "pack", "gather", "all_to_all", "permute"],
                                "combine": ["reduce"] + combine}
        assert got["wrong"] == {"dispatch": 0, "combine": 0}
    finally:
        dist.destroy_process_group()


SYMM_PHASES = {
    ("rank_major", "call"): ["layout", "gather", "all_to_all", "counts"],
    ("rank_major", "kernel"): ["gather", "all_to_all", "counts"],
    ("expert_major", "call"): ["layout", "gather", "all_to_all", "pair_gather", "pair_all_to_all", "segments"],
    ("expert_major", "kernel"): ["gather", "all_to_all", "pair_gather", "pair_all_to_all", "segments"],
}


@pytest.mark.parametrize("layout, align", [("rank_major", 1), ("expert_major", 16)])
def test_symm_mem_phases_cover_its_calls_in_both_modes(layout, align):
    """tools/fidelity_phases.py on the symm-mem backend against its tests' fake of torch's ops:
    every step of each mode marked in order, the marked calls still verify (outputs unchanged),
    and nothing but a sliver of each call runs after its last phase."""
    from statistics import median

    import fidelity_phases as ph
    from epbench.backends.symm_mem import SymmMemBackend
    from test_symm_mem_backend import ThreadComm, run_ranks, scenario

    assert all(callable(getattr(SymmMemBackend, m)) for steps in SymmMemBackend.PHASES.values() for _, m in steps)
    s = scenario(2, "fp8", layout, align)

    def fn(rank, m):
        comm = ThreadComm(rank, 2, m.world_state.barrier)
        return ph.measure(comm, s, 1, 3, 2, make=lambda setup: SymmMemBackend(setup, symm=m))

    for got in run_ranks(2, fn):
        for mode in ("call", "kernel"):
            rec = got[mode]
            assert rec["order"] == {"dispatch": SYMM_PHASES[(layout, mode)],
                                    "combine": ["all_to_all", "gather", "weights", "weighted_sum"]}
            assert rec["wrong"] == {"dispatch": 0, "combine": 0}
            assert all(len(v) == 3 for op in ph.OPS for v in rec["phases_us"][op].values())
            for op in ph.OPS:
                assert median(rec["unmarked_share"][op]) < 0.2, (mode, op, rec["unmarked_share"][op])


def test_phases_of_every_rank_gather_into_what_the_parser_reads():
    import fidelity_phases as ph

    def mine(scale):
        order = {"dispatch": ["pack", "all_to_all"], "combine": ["all_to_all"]}
        return {"kernel": {"order": order, "wrong": {"dispatch": 0, "combine": 1},
                           "whole_us": {"dispatch": [scale * 3.0], "combine": [scale * 1.0]},
                           "phases_us": {"dispatch": {"pack": [scale], "all_to_all": [scale * 2.0]},
                                         "combine": {"all_to_all": [scale]}},
                           "unmarked_share": {"dispatch": [0.01], "combine": [0.02]}}}

    data = ph.gather([mine(1.0), mine(2.0)])
    assert data["kernel"]["phases_us"]["dispatch"]["pack"] == {"0": [1.0], "1": [2.0]}
    assert data["kernel"]["unmarked_share"]["combine"] == {"0": [0.02], "1": [0.02]}
    figs = fp.parse_calls(json.dumps({"samples_us": {}, "phases": data}))
    whole = one(figs, role="whole", op="dispatch")
    assert (whole.us, whole.detail["rank"], whole.detail["sum_of_phases_us"]) == (6.0, 1, 6.0)
    assert one(figs, role="whole", op="combine").detail["wrong"] == 2


def test_nothing_measured_prints_the_reasons_without_an_empty_table():
    from rich.console import Console

    con = Console(record=True, width=120)
    fid.print_table([], ["v1: not run: no venv"], con)
    text = con.export_text()
    assert "v1: not run: no venv" in text and "fidelity:" not in text


def test_symm_mem_dispatch_row_is_checked_before_any_rank_starts(tmp_path, capsys):
    """--dispatch-row times the bare call at another stride (the adapter's old 14432 bytes): it must
    hold the row and split exactly into torch's per-block pieces; it is refused for other libraries."""
    import fidelity_calls as fc
    from test_symm_mem_backend import scenario

    s = scenario(4, "bf16", hidden=7168)
    assert fc.row_stride_reason(14432, s) is None and fc.row_stride_reason(14592, s) is None
    assert "at least 14336" in fc.row_stride_reason(14000, s)
    assert "a multiple of 16" in fc.row_stride_reason(14336 + 8, s)
    out = str(tmp_path / "x.json")
    smoke = str(REPO / "scenarios" / "smoke.yaml")
    assert fc.main(["--library", "reference", "--scenario", smoke, "--dispatch-row", "14432", "--out", out]) == 2
    assert "--dispatch-row is for symm-mem" in capsys.readouterr().err
