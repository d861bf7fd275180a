"""The GPU tests' scheduler (tests/gpu/gpu_launch.py GpuRuns), on CPU with stand-in commands: runs go
side by side only on disjoint GPUs, each gets the count it asked for, one needing every GPU runs alone,
a run past its timeout is killed and says so, and a count above the host's is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_launch import GpuRuns  # noqa: E402

STAND_IN = ("import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[2])); "
            "json.dump({'gpus': os.environ['CUDA_VISIBLE_DEVICES'].split(','), 'start': t0, "
            "'end': time.time()}, open(sys.argv[1], 'w'))")


def stand_in(seconds: float):
    return lambda folder: [sys.executable, "-c", STAND_IN, str(folder / "seen.json"), str(seconds)]


def test_runs_share_no_gpu_and_each_gets_its_count(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    need = {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "pair": 2, "all": 4}
    runs = GpuRuns(tmp_path, {n: stand_in(0.6) for n in need}, gpus=need, host_gpus=4)
    seen = {}
    for name in need:
        r, folder = runs.get(name)
        assert r.returncode == 0, r.stderr
        seen[name] = json.loads((folder / "seen.json").read_text())
        assert len(set(seen[name]["gpus"])) == need[name] and set(seen[name]["gpus"]) <= {"0", "1", "2", "3"}
    names = list(seen)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            a, b = seen[x], seen[y]
            if a["start"] < b["end"] and b["start"] < a["end"]:  # side by side: on different GPUs
                assert not set(a["gpus"]) & set(b["gpus"]), (x, y, a, b)
    firsts = [seen[n]["start"] for n in "abcd"]
    assert max(firsts) - min(firsts) < 0.5  # the four one-GPU runs started together
    assert all(not (seen["all"]["start"] < seen[n]["end"] and seen[n]["start"] < seen["all"]["end"])
               for n in names if n != "all")


def test_a_run_past_its_timeout_is_killed_and_says_so(tmp_path):
    runs = GpuRuns(tmp_path, {"slow": stand_in(30), "quick": stand_in(0)}, timeout=1, host_gpus=1)
    r, _ = runs.get("slow")
    assert r.returncode != 0 and "(killed after 1 s)" in r.stderr
    assert runs.get("quick")[0].returncode == 0


def test_a_run_needing_more_gpus_than_the_host_has_is_refused(tmp_path):
    with pytest.raises(ValueError, match="more GPUs than this host's 2"):
        GpuRuns(tmp_path, {"big": stand_in(0)}, gpus={"big": 4}, host_gpus=2)


def test_a_test_waits_for_its_own_run_and_close_stops_the_rest(tmp_path):
    import time

    runs = GpuRuns(tmp_path, {"slow": stand_in(60), "quick": stand_in(0)}, timeout=120, host_gpus=2)
    t0 = time.monotonic()
    assert runs.get("quick")[0].returncode == 0
    assert time.monotonic() - t0 < 20  # not after the slow one
    runs.close()
    r, _ = runs.get("slow")
    assert r.returncode != 0 and "runs stopped before this one ended" in r.stderr
    assert time.monotonic() - t0 < 30


def test_per_gpu_lets_runs_share_gpus_up_to_that_many_each_on_distinct_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    need = {"w1": 4, "w2": 4, "w3": 4, "one": 1, "pair": 2}
    runs = GpuRuns(tmp_path, {n: stand_in(0.8) for n in need}, gpus=need, host_gpus=4, per_gpu=2)
    seen = {}
    for name in need:
        r, folder = runs.get(name)
        assert r.returncode == 0, r.stderr
        seen[name] = json.loads((folder / "seen.json").read_text())
        assert len(set(seen[name]["gpus"])) == len(seen[name]["gpus"]) == need[name]  # distinct GPUs
    assert seen["w2"]["start"] < seen["w1"]["end"]  # two 4-GPU runs side by side on shared GPUs
    # never more than two runs on one GPU at any moment: count at every start
    for name, run in seen.items():
        for gpu in run["gpus"]:
            on = [n for n, o in seen.items() if gpu in o["gpus"] and o["start"] <= run["start"] < o["end"]]
            assert len(on) <= 2, (name, gpu, on)
    assert seen["w3"]["start"] >= min(seen["w1"]["end"], seen["w2"]["end"]) - 0.05  # waited for room


def test_early_runs_start_the_sets_selected_tests_use_and_each_is_taken_once(tmp_path, monkeypatch):
    from gpu_launch import EarlyRuns

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    early = EarlyRuns()
    made = []

    def maker(name, built=True):
        def make(base):
            made.append(name)
            if name == "broken":
                raise OSError("no room")
            return GpuRuns(base, {"r": stand_in(0.3)}, host_gpus=1) if built else None
        return make

    files = {n: str(tmp_path / f"test_{n}.py") for n in ("a", "b", "c", "d", "e")}
    early.add(files["a"], maker("a"), "runs")
    early.add(files["b"], maker("b"), "runs")
    early.add(files["c"], maker("c", built=False), "runs")  # its module would skip
    early.add(files["d"], maker("d"), "pipeline_runs")
    early.add(files["e"], maker("broken"), "runs")
    selected = [(files["a"], ("runs", "tmp_path")), (files["c"], ("runs",)),
                (files["d"], ("built",)),  # a test of d that does not use its set
                (files["e"], ("runs",)), (str(tmp_path / "test_x.py"), ("runs",))]
    started = early.start(selected, tmp_path / "early")
    assert made == ["a", "c", "broken"] and started == [str(Path(files["a"]).resolve())]
    assert early.take(files["b"]) is None and early.take(files["d"]) is None  # their modules make their own
    early.wait()  # a's run has ended, without any test asking for it
    runs = early.take(files["a"])
    assert runs is not None and runs.done["r"][0].returncode == 0
    assert early.take(files["a"]) is None  # a second setup of the fixture makes a new set
    runs.close()

    class Factory:  # pytest's tmp_path_factory, as set_of uses it
        def mktemp(self, name):
            return tmp_path / "late" / name

    late = early.set_of(files["b"], Factory())  # not started early: made by its maker now, in its own folder
    assert made[-1] == "b" and late is not None and late.base == tmp_path / "late" / "test_b"
    assert early.set_of(files["c"], Factory()) is None  # its maker says the module would skip


def _seen(runs, names):
    out = {}
    for name in names:
        r, folder = runs.get(name)
        assert r.returncode == 0, r.stderr
        out[name] = json.loads((folder / "seen.json").read_text())
    return out


def test_sets_sharing_a_pool_never_put_more_than_its_cap_on_a_gpu(tmp_path, monkeypatch):
    from gpu_launch import HostGpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = HostGpus(4, cap=2)
    # set a: one run on every GPU at a time (per_gpu 1), its 4-GPU run first and long, so the others of a wait for it
    need_a = {"a4": 4, "a2": 2, "a1": 1, "b1": 1, "c1": 1}
    need_b = {"x4": 4, "x1": 1, "y1": 1, "z2": 2}
    a = GpuRuns(tmp_path / "a", {n: stand_in(2.0 if n == "a4" else 0.5) for n in need_a}, gpus=need_a,
                pool=pool).start()
    b = GpuRuns(tmp_path / "b", {n: stand_in(0.5) for n in need_b}, gpus=need_b, per_gpu=2, pool=pool).start()
    seen = {**{f"a/{n}": s for n, s in _seen(a, need_a).items()}, **{f"b/{n}": s for n, s in _seen(b, need_b).items()}}
    for name, run in seen.items():
        for gpu in run["gpus"]:  # at each start, the runs of both sets on that GPU
            on = [n for n, o in seen.items() if gpu in o["gpus"] and o["start"] <= run["start"] < o["end"]]
            assert len(on) <= 2, (name, gpu, on)
    assert pool.held == {0: 0, 1: 0, 2: 0, 3: 0} and not pool.waiting  # every GPU given back
    a4 = seen["a/a4"]  # the pool's second place on every GPU went to b while a's own room kept a's others waiting
    assert seen["b/x4"]["start"] < a4["end"] and all(seen[f"a/{n}"]["start"] >= a4["end"] - 0.05
                                                     for n in need_a if n != "a4")


def test_a_request_its_own_set_holds_back_holds_back_no_other_set(tmp_path, monkeypatch):
    import time

    from gpu_launch import HostGpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = HostGpus(2, cap=2, patience=0.3)
    # "big" waits past the patience, but for its own set's room (per_gpu 1, "long" on a GPU), not for the pool
    a = GpuRuns(tmp_path / "a", {"long": stand_in(2.0), "big": stand_in(0.1)}, gpus={"long": 1, "big": 2},
                pool=pool).start()
    time.sleep(0.8)
    b = GpuRuns(tmp_path / "b", {"s": stand_in(0.1)}, pool=pool).start()
    s, long = _seen(b, ["s"])["s"], _seen(a, ["long"])["long"]
    assert s["start"] < long["end"] - 0.5  # b's run did not wait behind a's big run


def test_a_run_that_cannot_start_fails_alone_and_gives_its_gpus_back(tmp_path, monkeypatch):
    from gpu_launch import HostGpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def broken(folder):
        raise OSError("no scenario here")

    pool = HostGpus(2, cap=1)
    runs = GpuRuns(tmp_path, {"broken": broken, "pair": stand_in(0.1), "one": stand_in(0.1)},
                   gpus={"broken": 1, "pair": 2, "one": 1}, pool=pool)
    r, _ = runs.get("broken")
    assert r.returncode != 0 and "run could not start: OSError('no scenario here')" in r.stderr
    assert runs.get("pair")[0].returncode == 0 and runs.get("one")[0].returncode == 0
    runs.wait()
    assert pool.held == {0: 0, 1: 0} and not pool.waiting


def test_a_run_of_its_own_limit_is_killed_at_it(tmp_path):
    runs = GpuRuns(tmp_path, {"slow": stand_in(30), "other": stand_in(0)}, timeout=60, timeouts={"slow": 1},
                   host_gpus=2)
    r, _ = runs.get("slow")
    assert r.returncode != 0 and "(killed after 1 s)" in r.stderr
    assert runs.get("other")[0].returncode == 0


def test_a_set_larger_than_its_pool_is_refused(tmp_path):
    from gpu_launch import HostGpus

    with pytest.raises(ValueError, match="a set of 4 GPUs on a pool of 2"):
        GpuRuns(tmp_path, {"r": stand_in(0)}, host_gpus=4, pool=HostGpus(2, cap=1))


def test_a_run_that_waited_its_patience_is_not_starved_by_later_small_runs(tmp_path, monkeypatch):
    import time

    from gpu_launch import HostGpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    def until(cond, what: str) -> None:  # the order of the requests by the pool's own state, not by sleeps
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, f"never: {what}"
            time.sleep(0.01)

    pool = HostGpus(2, cap=1, patience=0.3)
    first = GpuRuns(tmp_path / "f", {"f0": stand_in(1.2), "f1": stand_in(1.2)}, pool=pool).start()
    until(lambda: all(pool.held.values()), "both GPUs taken")
    big = GpuRuns(tmp_path / "b", {"big": stand_in(0.2)}, gpus={"big": 2}, pool=pool).start()
    until(lambda: len(pool.waiting) == 1, "the big run waiting")
    small = {f"s{i}": 1 for i in range(6)}
    smalls = GpuRuns(tmp_path / "s", {n: stand_in(0.3) for n in small}, gpus=small, pool=pool).start()
    seen_first, seen_big, seen_small = _seen(first, ["f0", "f1"]), _seen(big, ["big"])["big"], _seen(smalls, small)
    # without the patience rule the small runs take each GPU as it frees and the big run waits for all six
    assert seen_big["start"] < min(s["start"] for s in seen_small.values())
    assert seen_big["start"] >= max(s["end"] for s in seen_first.values()) - 0.05


def test_closing_a_set_gives_back_its_gpus_and_requests(tmp_path):
    from gpu_launch import HostGpus

    pool = HostGpus(1, cap=1)
    runs = GpuRuns(tmp_path, {"slow": stand_in(60), "next": stand_in(0)}, timeout=120, pool=pool).start()
    import time

    deadline = time.monotonic() + 20
    while pool.held[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.held[0] == 1
    runs.close()
    assert runs.get("next")[0].returncode != 0
    assert pool.held == {0: 0} and not pool.waiting
