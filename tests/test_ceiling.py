"""Ceiling arithmetic, byte plans and nominal limits (fake NVML, fake sysfs), and the CPU path
of ``epbench ceiling``."""

import types

import pynvml
import pytest
import torch

from epbench import ceiling
from epbench.errors import UserError
from epbench.routing import Traffic, route_all, traffic
from epbench.scenario import cpu_ranks, parse
from support import assert_one_line_error, epbench_here, scenario_dict


def test_ideal_time_and_percent_of_ceiling():
    # 64 MiB at 478.125 GB/s (18 x 26.5625) takes 140.4 us.
    assert ceiling.ideal_time_us(64 * 2**20, 478.125) == pytest.approx(140.36, abs=0.01)
    assert ceiling.ideal_time_us(1e9, 0) is None
    assert ceiling.ideal_time_us(1e9, None) is None
    # a 400 us result against a 300 us ceiling runs at 75% of it
    assert ceiling.percent_of_ceiling(400.0, 300.0) == pytest.approx(75.0)
    assert ceiling.percent_of_ceiling(None, 300.0) is None
    assert ceiling.percent_of_ceiling(400.0, None) is None
    assert ceiling.percent_of_ceiling(0.0, 300.0) is None


def test_bytes_to_peers_dispatch_rows_combine_columns():
    nv = torch.tensor([[0, 1, 2], [3, 0, 4], [5, 6, 0]])
    tr = Traffic(total=nv + torch.eye(3, dtype=torch.int64), nvlink=nv, nic=torch.zeros_like(nv))
    assert ceiling.bytes_to_peers(tr, "dispatch", 1, 10) == [30, 0, 40]
    assert ceiling.bytes_to_peers(tr, "combine", 1, 10) == [10, 0, 60]
    with pytest.raises(ValueError):
        ceiling.bytes_to_peers(tr, "gather", 0, 1)


def test_recv_offsets_do_not_overlap():
    plan = [[0, 5, 7], [2, 0, 3], [4, 6, 0]]
    assert ceiling.recv_offsets(plan, 2) == [0, 7, 10]
    assert ceiling.recv_offsets(plan, 0) == [0, 0, 2]


def test_split_pieces_cover_the_bytes_once_at_aligned_offsets():
    for n in (0, 1, 15, 16, 17, 1000, 58_720_256, 58_720_257):
        for k in ceiling.CE_SPLITS:
            pieces = ceiling.split_pieces(n, k)
            assert sum(length for _, length in pieces) == n
            assert all(length > 0 for _, length in pieces) and len(pieces) <= k
            assert all(off % 16 == 0 for off, _ in pieces)
            # contiguous, in order: each piece starts where the one before ended
            assert [off for off, _ in pieces] == [sum(length for _, length in pieces[:i]) for i in range(len(pieces))]
    assert ceiling.split_pieces(1000, 2) == [(0, 512), (512, 488)]
    assert ceiling.split_pieces(17, 4) == [(0, 16), (16, 1)]  # fewer pieces than asked: none of length 0


def test_copy_engine_ceiling_is_the_fastest_split_and_names_it():
    c = ceiling.OpCeiling("dispatch", [100], None, {}, None)
    assert c.copy_engine_split is None
    c.copy_engine_by_split = {1: 150.0, 2: 131.0, 4: 133.0}
    assert c.copy_engine_split == 2
    from epbench import metrics
    cols = metrics.ceiling_columns(c, 8)
    assert cols["ceiling_copy_engine_streams"] == 2


def test_local_sum_rows_are_a_ranks_token_copies_own_included_and_reach_the_rows_and_table() -> None:
    nv = torch.tensor([[0, 1, 2], [3, 0, 4], [5, 6, 0]])
    tr = Traffic(total=nv + 10 * torch.eye(3, dtype=torch.int64), nvlink=nv, nic=torch.zeros_like(nv))
    assert [ceiling.sum_rows(tr, r) for r in range(3)] == [13, 17, 21]
    c = ceiling.OpCeiling("combine", [100], None, {8: 5.0, 16: None}, None)
    c.sm_sum_us = {8: 40.0, 16: None}
    from epbench import metrics
    assert metrics.ceiling_columns(c, 8)["ceiling_sm_sum_us"] == 40.0
    assert metrics.ceiling_columns(c, 16)["ceiling_sm_sum_us"] is None
    assert metrics.ceiling_columns(ceiling.OpCeiling("dispatch", [1], None, {8: 5.0}, None), 8)["ceiling_sm_sum_us"] is None
    from rich.console import Console
    con = Console(width=300, record=True)
    con.print(ceiling.ceiling_table([c], "t"))
    text = con.export_text()
    assert "SM local sum us" in text and "8: 40" in text


def scenario(**model):
    return parse(scenario_dict(model=model, topology={"nvlink_gbps": 100.0}), "test.yaml")


def test_byte_ceilings_match_the_routing():
    s = scenario(hidden=256, tokens_per_rank=16, topk=4, experts_per_rank=4)
    tr = traffic(route_all(s), 4, 4, False)
    cs = ceiling.byte_ceilings(s, tr, [200.0, 200.0, 200.0, None])
    d, c = cs
    assert (d.op, c.op) == ("dispatch", "combine")
    assert d.bytes_per_rank == [int(tr.nvlink[r].sum()) * 512 for r in range(4)]
    assert c.bytes_per_rank == [int(tr.nvlink[:, r].sum()) * 512 for r in range(4)]
    assert d.ideal_us is None  # one rank's rate unknown: no made-up ideal time
    assert d.scenario_ideal_us == pytest.approx(max(d.bytes_per_rank) / 100e9 * 1e6)
    assert d.copy_engine_us is None and d.copy_engine_gbps is None
    assert all(v is None for v in d.sm_store_us.values())
    full = ceiling.byte_ceilings(s, tr, [200.0, 100.0, 200.0, 200.0])
    # the slow rank decides: its bytes / its rate
    assert full[0].ideal_us == pytest.approx(
        max(b / r for b, r in zip(full[0].bytes_per_rank, [200e9, 100e9, 200e9, 200e9])) * 1e6)


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 36

    def __init__(self, active_links=18, version=6):
        self.active, self.version = active_links, version

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 18:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1 if link < self.active else 0

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        if self.version is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.version


def test_nvlink_limit_h200_shape():
    lim, why = ceiling.nvlink_limit(FakeNvml(18, 6), 0)
    assert why is None
    assert (lim.links, lim.version, lim.per_link_gbps) == (18, "4.0", 26.5625)
    assert lim.gbps == pytest.approx(478.125)
    assert "18 active links x 26.5625 GB/s" in lim.describe() and "478" in lim.describe()


def test_nvlink_limit_partial_unknown_and_none():
    lim, _ = ceiling.nvlink_limit(FakeNvml(12, 4), 0)
    assert (lim.links, lim.version, lim.gbps) == (12, "3.0", 300.0)
    lim, _ = ceiling.nvlink_limit(FakeNvml(18, 99), 0)
    assert lim.gbps is None and "unknown" in lim.describe()
    lim, why = ceiling.nvlink_limit(FakeNvml(18, None), 0)
    assert lim.gbps is None and "version" in why
    lim, why = ceiling.nvlink_limit(FakeNvml(0), 0)
    assert lim is None and why == "no active NVLink links"


def test_nic_limit_from_sysfs(tmp_path):
    ports = tmp_path / "class/infiniband/mlx5_0/ports"
    for port, rate, state in (("1", "400 Gb/sec (4X NDR)", "4: ACTIVE"),
                              ("2", "200 Gb/sec (4X HDR)", "1: DOWN")):
        (ports / port).mkdir(parents=True)
        (ports / port / "rate").write_text(rate + "\n")
        (ports / port / "state").write_text(state + "\n")
    assert ceiling.nic_limit_gbps("mlx5_0", tmp_path) == pytest.approx(50.0)
    assert ceiling.nic_limit_gbps(None, tmp_path) is None
    assert ceiling.parse_ib_rate("100 Gb/sec (4X EDR)") == 100.0
    assert ceiling.parse_ib_rate("garbage") is None


def test_sm_store_is_absent_until_a_provider_is_plugged_in():
    s = scenario()
    tr = traffic(route_all(s), 4, 4, False)
    c = ceiling.byte_ceilings(s, tr, [None] * 4)
    table_text = render(ceiling.ceiling_table(c, "t"))
    assert "absent" not in table_text  # '-' as every other column without a figure; a note says why
    assert cell(table_text, "dispatch", "SM stores us") == "-"
    assert ceiling._sm_store_provider is None


CEILING_COLUMNS = ("op", "MB per rank", "copy engine us", "copy engine GB/s", "copy engine us by streams",
                   "SM stores us", "copy engine + SM stores us", "SM local sum us", "nominal ideal us",
                   "nominal GB/s", "scenario ideal us", "NVML TX / computed")


def cell(text: str, op: str, column: str) -> str:
    """One cell of a printed ceiling table (its header wraps; a row's cells stand between the box's bars)."""
    row = next(ln for ln in text.splitlines() if ln.lstrip("│ ").startswith(op))
    return [c.strip() for c in row.strip().strip("│").split("│")][CEILING_COLUMNS.index(column)]


def render(table):
    from rich.console import Console

    con = Console(record=True, width=200, color_system=None)
    con.print(table)
    return con.export_text()


@pytest.mark.slow
def test_ceiling_command_on_cpu_prints_bytes_and_says_what_needs_gpus(tmp_path):
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--csv", tmp_path / "c.csv")
    assert r.code == 0, r.both
    assert "dispatch" in r.out and "combine" in r.out
    assert "copy-engine ceilings need CUDA GPUs" in r.out
    assert "SM-store ceiling: not measured (it needs CUDA GPUs)" in r.out
    # smoke's ranks are CPU processes: no scenario ideal (its NVLink rate is only the default), a note says why
    assert "note: scenario ideal: none (bench.device: cpu" in r.out and "scenario says" not in r.out
    # --csv: the figures it printed (none here: no copy engine, no NVLink), and what produced them beside
    import json

    import pandas as pd
    df = pd.read_csv(tmp_path / "c.csv")
    assert list(df.columns) == list(ceiling.CSV_COLUMNS) and df.empty
    meta = json.loads((tmp_path / "c.csv.json").read_text())
    assert meta["device"] == "cpu" and meta["scenario"]["name"] == "smoke" and "--csv" in meta["argv"]
    assert {"epbench", "numpy", "pandas", "torch", "git_commit"} <= set(meta)


def local_ceilings(s, tmp_path, csv=None):
    """ceiling.run_local's printed text (its --csv into ``csv``)."""
    from rich.console import Console

    con = Console(width=400, record=True, color_system=None)
    assert ceiling.run_local(s, con, csv, ("ceiling", "x.yaml")) == 0
    return con.export_text()


def test_cpu_ranks_get_no_scenario_ideal_gpus_keep_it(tmp_path):
    """A scenario of CPU ranks (bench.device cpu, as smoke.yaml) crosses no NVLink: the ideal time at its NVLink
    rate is a figure of nothing, shown '-' with a note and written nowhere; one of GPUs (auto or cuda), hypothetical
    here, keeps it."""
    import pandas as pd

    shape = dict(model={"hidden": 256, "tokens_per_rank": 16, "topk": 4, "experts_per_rank": 4},
                 topology={"nvlink_gbps": 100.0})
    cpu = parse(scenario_dict(**shape), "cpu.yaml")
    assert cpu_ranks(cpu).startswith("bench.device: cpu")
    text = local_ceilings(cpu, tmp_path, tmp_path / "cpu.csv")
    assert "note: scenario ideal: none (bench.device: cpu: the scenario's ranks are CPU processes" in text
    assert "scenario says" not in text and "scenario: no NVLink (CPU ranks)" in text
    assert cell(text, "dispatch", "scenario ideal us") == "-" and cell(text, "combine", "MB per rank") != "-"
    assert "scenario_ideal" not in set(pd.read_csv(tmp_path / "cpu.csv")["figure"])
    for device in ("auto", "cuda"):
        gpus = parse(scenario_dict(**shape, bench={"device": device}), f"{device}.yaml")
        assert cpu_ranks(gpus) == ""
        text = local_ceilings(gpus, tmp_path, tmp_path / f"{device}.csv")
        assert "scenario says 100 GB/s" in text and "scenario ideal: none" not in text
        assert cell(text, "dispatch", "scenario ideal us") != "-"
        df = pd.read_csv(tmp_path / f"{device}.csv")
        assert set(df["figure"]) == {"scenario_ideal"} and list(df["gbps"]) == pytest.approx([100.0, 100.0])


def test_csv_and_its_json_are_never_overwritten(tmp_path):
    """`ceiling --csv F` refuses F or F.json that exists (as predict --json and plot do), in one line naming it,
    before anything is computed and again when it writes; a pair it could not finish leaves neither file."""
    s = scenario(hidden=256, tokens_per_rank=16, topk=4, experts_per_rank=4)
    f = tmp_path / "c.csv"
    local_ceilings(s, tmp_path, f)
    before = {p: p.read_text() for p in (f, tmp_path / "c.csv.json")}
    with pytest.raises(UserError, match=f"--csv {f}: already exists; refusing to overwrite it"):
        local_ceilings(s, tmp_path, f)
    f.unlink()  # the .json alone still stops it
    with pytest.raises(UserError, match=f"--csv {f}.json: already exists"):
        local_ceilings(s, tmp_path, f)
    assert not f.exists() and (tmp_path / "c.csv.json").read_text() == before[tmp_path / "c.csv.json"]
    # a file that appears between the check and the write (the GPU path measures for minutes) is kept too
    g = tmp_path / "g.csv"
    g.with_name("g.csv.json").write_text("theirs")
    with pytest.raises(UserError, match="g.csv.json: already exists"):
        ceiling.write_csv(g, [], {"git_commit": "abc"}, overwrite=False)
    assert not g.exists() and g.with_name("g.csv.json").read_text() == "theirs"
    ceiling.write_csv(g, [], {}, overwrite=True)  # python -m epbench.smmem --csv writes over its own file
    # the command line: one line, exit 2, naming the file
    f.write_text("mine")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--csv", f)
    assert_one_line_error(r, f"--csv {f}: already exists; refusing to overwrite it")
    assert f.read_text() == "mine" and "dispatch" not in r.out


def test_ceiling_command_bad_input_is_one_line(tmp_path):
    r = epbench_here("ceiling", tmp_path / "nope.yaml")
    assert_one_line_error(r, "nope.yaml")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--iters", "0")
    assert_one_line_error(r, "--iters")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--sms", "4,x")
    assert_one_line_error(r, "--sms")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--csv", tmp_path)
    assert_one_line_error(r, "is a folder")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--csv", tmp_path / "no" / "c.csv")
    assert_one_line_error(r, "is not a folder")
    r = epbench_here("ceiling", "scenarios/smoke.yaml", "--nproc", "1")
    assert_one_line_error(r, "one rank: nothing crosses a link")


def test_counted_vs_computed_reports_the_worst_rank():
    c = ceiling.OpCeiling("dispatch", [100, 200, 0], None, {}, None,
                          counted_per_iter=[101.0, 260.0, 5.0])
    assert c.counted_vs_computed() == pytest.approx(1.3)  # rank 1; rank 2 sends nothing
    assert "!>10%" in ceiling._ratio(1.3) and "!" not in ceiling._ratio(1.02)
    assert ceiling.OpCeiling("combine", [100], None, {}, None).counted_vs_computed() is None
    assert ceiling._ratio(None) == "-"


class FakeRuntime:
    """Records the CUDA runtime calls PeerBuffers makes (no GPU needed)."""

    def __init__(self):
        self.calls = []

    def set_device(self, d):
        self.calls.append(("set_device", d))

    def malloc(self, n):
        self.calls.append(("malloc", n))
        return 0x1000

    def ipc_handle(self, ptr):
        return b"h%d" % ptr

    def enable_peer_access(self, d):
        self.calls.append(("peer", d))

    def ipc_open(self, h):
        self.calls.append(("open", h))
        return 0x9000 + len(self.calls)

    def ipc_close(self, ptr):
        self.calls.append(("close", ptr))

    def free(self, ptr):
        self.calls.append(("free", ptr))


class FakeDist:
    def __init__(self, log):
        self.log = log

    def all_gather_object(self, out, obj):
        for r in range(len(out)):
            out[r] = (b"h%d" % (0x1000 + r), r)  # rank r's handle, on device r

    def barrier(self):
        self.log.append(("barrier",))


def test_peer_buffers_open_peers_on_own_device_and_close_before_free():
    rt = FakeRuntime()
    comm = types.SimpleNamespace(rank=1, world=3, device=types.SimpleNamespace(index=1))
    bufs = ceiling.PeerBuffers(100, comm, rt, FakeDist(rt.calls))
    assert rt.calls[:2] == [("set_device", 1), ("malloc", 100)]
    assert sorted(bufs.peers) == [0, 2]  # never its own buffer
    assert ("peer", 0) in rt.calls and ("peer", 2) in rt.calls and ("peer", 1) not in rt.calls
    assert ("open", b"h%d" % 0x1000) in rt.calls and ("open", b"h%d" % 0x1002) in rt.calls
    bufs.close()
    tail = [c[0] for c in rt.calls[-4:]]
    assert tail == ["close", "close", "barrier", "free"]  # unmapped everywhere before freed


def test_ceiling_kernels_are_timed_warmup_plus_iters_times_on_the_current_stream_each_checked(monkeypatch) -> None:
    """Both ceiling kernels (SM stores, local sum) go through one timed loop: every launch gets the current
    stream, runs after the ranks' alignment, its return code is checked, and the warmup samples are dropped."""
    calls, aligned = [], []

    class FakeTimer:
        def __init__(self, device, n):
            self.n = n

        def time(self, i, fn, align=None):
            align()
            return fn()

        def samples_us(self, warmup):
            return [float(i) for i in range(warmup, self.n)]

    class FakeStream:
        cuda_stream = 1234

    monkeypatch.setattr(ceiling, "Timer", FakeTimer)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream())
    comm = types.SimpleNamespace(device="cuda:0", sync=lambda: aligned.append(1))

    def launch(stream):
        calls.append(stream.value)
        return 0

    assert ceiling._timed_launches(launch, "ep_sum_ceiling", comm, 2, 3) == [2.0, 3.0, 4.0]
    assert calls == [1234] * 5 and len(aligned) == 5
    with pytest.raises(RuntimeError):
        ceiling._timed_launches(lambda stream: -1, "ep_sum_ceiling", comm, 0, 1)


def test_copy_engine_and_store_ceiling_splits_every_destination_between_the_two_engines(monkeypatch) -> None:
    """The copy engines take the first share of each peer's bytes (16-byte aligned) at that peer's receive offset,
    the store kernel the rest right after it; no copy to this rank itself or to a peer it sends nothing; both
    start after the timed region opens and the region ends only after every copy."""
    events = []

    class FakeStream:
        def __init__(self, device=None, name="side"):
            self.cuda_stream = name if name != "side" else f"s{len(events)}"
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    main = FakeStream(name="main")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)
    monkeypatch.setattr(ceiling, "_timed_launches", lambda launch, name, comm, w, i: [float(launch("main-ptr"))])

    class Rt:
        def memcpy_async(self, dst, src, n, stream):
            events.append(("ce", dst, src, n))

    bound = {}

    def bind(dst, nbytes, src_ptr, sms):
        bound.update(dst=dst, nbytes=nbytes, src=src_ptr, sms=sms)
        return lambda stream: events.append(("store", stream)) or 0

    plan = [[0, 1000, 64, 0], [40, 0, 400, 8], [0, 0, 0, 0], [0, 0, 0, 0]]  # rank 0 sends 1000 to 1, 64 to 2
    comm = types.SimpleNamespace(rank=0, world=4, device="cuda:0")
    bufs = types.SimpleNamespace(rt=Rt(), peers={1: 10_000, 2: 20_000, 3: 30_000})
    source = types.SimpleNamespace(data_ptr=lambda: 5)
    assert ceiling.ce_and_store_samples_us(plan, comm, bufs, source, bind, 4, 0.5, 1, 2) == [0.0]
    # rank 1 receives only from rank 0 (offset 0); rank 2 receives from rank 0 first (offset 0)
    assert ("ce", 10_000, 5, 496) in events and ("ce", 20_000, 5, 32) in events
    assert not any(e[0] == "ce" and e[1] == 30_000 for e in events)
    assert bound == {"dst": {1: 10_496, 2: 20_032}, "nbytes": {1: 504, 2: 32}, "src": 5, "sms": 4}
    kinds = [e[0] for e in events]
    store_at = kinds.index("store")
    # one side stream, forked once; the copies queued first, in ring order (peer 1, then 2); joined once
    assert kinds[:store_at] == ["wait", "ce", "ce"] and [e[1] for e in events[1:3]] == [10_000, 20_000]
    assert events[store_at + 1:] == [("wait", "main", "side")]
    assert ceiling.ce_share_bytes(1000, 0.25) == 240 and ceiling.ce_share_bytes(15, 0.75) == 0


def test_copy_engine_and_store_ceiling_reaches_the_rows_and_table_with_its_share() -> None:
    c = ceiling.OpCeiling("dispatch", [100], None, {4: 900.0, 8: None}, None)
    c.ce_sm_us, c.ce_sm_share = {4: 512.0}, {4: 0.5}
    from epbench import metrics
    cols = metrics.ceiling_columns(c, 4)
    assert cols["ceiling_ce_sm_us"] == 512.0 and cols["ceiling_ce_sm_share"] == 0.5
    assert metrics.ceiling_columns(c, 8)["ceiling_ce_sm_us"] is None
    from rich.console import Console
    con = Console(width=320, record=True)
    con.print(ceiling.ceiling_table([c], "t"))
    assert "4: 512 (50%)" in con.export_text()


def test_every_measured_figure_is_one_csv_row_with_its_bandwidth_where_it_crossed_a_link(tmp_path) -> None:
    s = scenario(hidden=256, tokens_per_rank=16, topk=4, experts_per_rank=4)
    c = ceiling.OpCeiling("combine", [10**6, 2 * 10**6], 20.0, {4: 40.0, 8: None}, 10.0, scenario_ideal_us=12.5)
    c.copy_engine_by_split = {1: 20.0, 2: 25.0, ceiling.RING: 40.0}
    c.ce_sm_us, c.ce_sm_share = {4: 16.0}, {4: 0.75}
    c.sm_sum_us = {4: 50.0}
    rows = ceiling.figure_rows(s, [c], "abc")
    got = {(r["figure"], r["sms"], r["streams"], r["ce_fraction"]): (r["time_us"], r["gbps"] and round(r["gbps"], 9))
           for r in rows}
    assert got == {("copy_engine", None, 1, None): (20.0, 100.0), ("copy_engine", None, 2, None): (25.0, 80.0),
                   ("copy_engine_ring", None, 1, None): (40.0, 50.0),
                   ("sm_stores", 4, None, None): (40.0, 50.0),
                   ("copy_engine_and_sm_stores", 4, None, 0.75): (16.0, 125.0),
                   ("sm_local_sum", 4, None, None): (50.0, None),  # no link bytes
                   ("nominal_ideal", None, None, None): (10.0, 200.0),
                   ("scenario_ideal", None, None, None): (12.5, 160.0)}  # the 8-SM store figure was not measured
    assert all(r["bytes_per_rank"] == (None if r["figure"] == "sm_local_sum" else 2 * 10**6)
               and r["git_commit"] == "abc" and r["world"] == 4 for r in rows)
    ceiling.write_csv(tmp_path / "f.csv", rows, {"git_commit": "abc"})
    import pandas as pd
    df = pd.read_csv(tmp_path / "f.csv")
    assert len(df) == 8 and df.loc[df["figure"] == "sm_local_sum", "gbps"].isna().all()
    assert (tmp_path / "f.csv.json").read_text().startswith("{")


def test_figure_rows_give_no_bandwidth_where_no_byte_leaves_a_rank() -> None:
    """An op whose ranks send nothing over a link: its times are the timing's own cost, never a GB/s."""
    s = scenario(hidden=256, tokens_per_rank=16, topk=4, experts_per_rank=4)
    c = ceiling.OpCeiling("dispatch", [0, 0], 3.0, {4: 2.0}, None)
    c.copy_engine_by_split = {1: 3.0, ceiling.RING: 3.5}
    c.ce_sm_us, c.ce_sm_share = {4: 2.5}, {4: 0.25}
    rows = ceiling.figure_rows(s, [c], "abc")
    assert {r["figure"] for r in rows} >= {"copy_engine", "copy_engine_ring", "sm_stores", "copy_engine_and_sm_stores"}
    assert all(r["gbps"] is None for r in rows) and c.copy_engine_gbps is None


def test_ring_copies_go_one_after_another_on_one_stream_from_the_next_rank_on(monkeypatch) -> None:
    """RING: every destination's bytes whole, on one stream, in the order me + 1, me + 2, ... (wrapping), skipping
    a peer this rank sends nothing; the timed region ends only after that stream; the split variant keeps a
    stream per piece."""
    events = []

    class FakeStream:
        def __init__(self, device=None, name=None):
            self.name = name or f"s{sum(1 for e in events if e[0] == 'new')}"
            self.cuda_stream = self.name
            events.append(("new", self.name))

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    main = FakeStream(name="main")
    events.clear()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)

    class Timer:
        def __init__(self, device, n):
            self.n = n

        def time(self, i, fn, align=None):
            fn()

        def samples_us(self, skip):
            return [1.0]

    monkeypatch.setattr(ceiling, "Timer", Timer)

    class Rt:
        def memcpy_async(self, dst, src, n, stream):
            events.append(("ce", dst, n, stream))

    plan = [[0, 0, 0, 0], [0, 0, 0, 0], [48, 32, 0, 16], [0, 0, 0, 0]]  # rank 2 sends to 3, 0, 1 in ring order
    assert ceiling.ring_dests(plan, 2) == [3, 0, 1] and ceiling.ring_dests(plan, 0) == []
    comm = types.SimpleNamespace(rank=2, world=4, device="cuda:2", sync=None)
    bufs = types.SimpleNamespace(rt=Rt(), peers={0: 1000, 1: 2000, 3: 3000})
    source = types.SimpleNamespace(data_ptr=lambda: 0)
    ceiling.copy_engine_samples_us(plan, comm, bufs, source, 0, 1, split=ceiling.RING)
    copies = [e for e in events if e[0] == "ce"]
    assert [(e[1], e[2]) for e in copies] == [(3000, 16), (1000, 48), (2000, 32)]
    assert {e[3] for e in copies} == {"s0"} and [e for e in events if e[0] == "new"] == [("new", "s0")]
    assert events[-1] == ("wait", "main", "s0")
    events.clear()
    ceiling.copy_engine_samples_us(plan, comm, bufs, source, 0, 1, split=2)
    # a stream per piece: 2 pieces for 48 and 32 bytes, 1 for 16 (pieces are 16-byte aligned)
    assert len({e[3] for e in events if e[0] == "ce"}) == 5


def test_local_sum_takes_the_bulk_shape_only_for_tokens_of_at_most_4_rows(monkeypatch) -> None:
    """measure_sums times every shape the rows allow and keeps the fastest: the bulk-copy shape (896 threads) only
    where a token has at most 4 rows (csrc/ceiling.cu refuses more)."""
    import types

    torch = pytest.importorskip("torch")
    assert ceiling.sum_shapes(1) == (512, 256, 896) and ceiling.sum_shapes(4) == (512, 256, 896)
    assert ceiling.sum_shapes(5) == (512, 256)
    monkeypatch.setattr(ceiling, "_max_over_ranks", lambda samples, comm: max(samples))
    speed = {512: 30.0, 256: 20.0, 896: 10.0}
    peer_rows = [0]  # another rank's most rows a token: every rank takes the shapes the largest allows
    monkeypatch.setattr(ceiling, "_max_int_over_ranks", lambda v, comm: max(v, peer_rows[0]))
    for rows, peer, want_threads, want in ((12, 0, {512, 256, 896}, 10.0), (13, 0, {512, 256}, 20.0),
                                           (12, 5, {512, 256}, 20.0)):
        peer_rows[0] = peer
        seen = set()

        def summer(out, src, tokens, nrows, hidden, sms, threads, comm, warmup, iters):
            seen.add(threads)
            assert nrows == rows and tokens == 3 and src.shape[0] == -(-rows // 3)
            return [speed[threads] * 8 / sms] * iters

        monkeypatch.setattr(ceiling, "sum_rows", lambda tr, rank: rows)
        s = types.SimpleNamespace(model=types.SimpleNamespace(tokens_per_rank=3, hidden=64))
        comm = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
        assert ceiling.measure_sums(summer, s, None, comm, 1, 2, [8, 16]) == {8: want, 16: want / 2}
        assert seen == want_threads


def test_the_sm_store_note_names_why_it_has_no_figure():
    assert ceiling.sm_store_absent("cpu") == "plain SM-store ceiling: not measured (it needs CUDA GPUs)"
    on_gpu = ceiling.sm_store_absent("cuda")
    assert "not measured" in on_gpu and "make build" in on_gpu and "ep_store_ceiling" in on_gpu


@pytest.mark.parametrize("rank0", [True, False])
def test_measure_job_prints_and_writes_the_csv_on_rank_0_only(monkeypatch, tmp_path, rank0) -> None:
    """The GPU path of `epbench ceiling --csv` with the measurement faked: rank 0 prints the table and writes the
    figures (provenance beside them); another rank writes nothing."""
    from rich.console import Console

    s = scenario(hidden=256, tokens_per_rank=16, topk=4, experts_per_rank=4)
    c = ceiling.OpCeiling("dispatch", [10**6] * 4, 20.0, {4: 40.0}, 10.0)
    c.copy_engine_by_split = {1: 20.0}
    monkeypatch.setattr(ceiling, "every_ranks_limits", lambda comm: [ceiling.Limits(None, None, None, ())] * 4)
    monkeypatch.setattr(ceiling, "measure_ceilings", lambda *a: [c])
    con = Console(width=200, record=True)
    job = types.SimpleNamespace(scenario=s, options=types.SimpleNamespace(warmup=1, iters=2), comm=None,
                                rank0=rank0, console=con,
                                plan=types.SimpleNamespace(csv=tmp_path / "c.csv", argv=("ceiling", "x.yaml")))
    assert ceiling.measure_job(job) == 0
    if not rank0:
        assert not (tmp_path / "c.csv").exists() and con.export_text() == ""
        return
    import json

    import pandas as pd
    df = pd.read_csv(tmp_path / "c.csv")
    assert set(df["figure"]) == {"copy_engine", "sm_stores", "nominal_ideal"}
    assert df.loc[df["figure"] == "sm_stores", "gbps"].iloc[0] == pytest.approx(25.0)
    meta = json.loads((tmp_path / "c.csv.json").read_text())
    assert meta["device"] == "cuda" and meta["iters"] == 2 and meta["argv"] == ["ceiling", "x.yaml"]
    assert f"figures: {tmp_path / 'c.csv'}" in con.export_text().replace("\n", "")


def test_a_multi_node_scenario_without_gpus_prints_both_tiers_bytes(tmp_path):
    """--device cpu measures nothing, so a scenario of several nodes (h100x32: 4 x 8) is printed too: its NVLink
    bytes in the table, its NIC bytes and their ideal time at the scenario's nic_gbps in one line per op."""
    from pathlib import Path

    from epbench import scenario

    s = scenario.load(Path(__file__).resolve().parents[1] / "scenarios" / "h100x32.yaml")
    assert s.topology.nodes > 1 and s.topology.nic_gbps > 0
    text = local_ceilings(s, tmp_path)
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    most = max(int(row.sum()) for row in tr.nic) * ceiling.op_row_bytes(s, "dispatch")
    line = [x for x in text.splitlines() if x.startswith(f"NIC bytes ({s.topology.nodes} nodes): dispatch")]
    assert line == [f"NIC bytes ({s.topology.nodes} nodes): dispatch {most / 1e6:.3f} MB per rank (max over ranks); "
                    f"ideal: scenario {ceiling.ideal_time_us(most, s.topology.nic_gbps):.1f} us at "
                    f"{s.topology.nic_gbps:g} GB/s"]
    assert "NIC bytes (4 nodes): combine" in text and cell(text, "dispatch", "MB per rank") != "-"


def test_the_ceiling_command_without_gpus_takes_a_multi_node_scenario():
    """`epbench ceiling h100x32.yaml --device cpu` prints the byte counts (exit 0), as its help says; only a
    measurement (CUDA) is held to one node."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scenarios" / "h100x32.yaml"
    r = epbench_here("ceiling", path, "--device", "cpu")
    assert r.code == 0 and "NIC bytes (4 nodes): dispatch" in r.out, r.err
