"""session.py: the cross-rank agreement check, in one process (the digest) and over gloo; the engine
(run_worker) running a verb's measurement and finishing its folder, at world 1 over gloo."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from epbench import scenario, session
from epbench.driver import RunOptions
from epbench.errors import UserError
from epbench.session import check_same_scenario, scenario_digest
from support import SCENARIOS

OPTS = RunOptions(backends=("reference",), sms=(4,), warmup=1, iters=2)


def test_digest_follows_content_not_file_name():
    s = scenario.load(SCENARIOS / "smoke.yaml")
    same = dataclasses.replace(s, source="elsewhere/copy.yaml")
    other = dataclasses.replace(s, model=dataclasses.replace(s.model, hidden=512))
    assert scenario_digest(s, OPTS) == scenario_digest(same, OPTS)
    assert scenario_digest(s, OPTS) != scenario_digest(other, OPTS)
    assert scenario_digest(s, OPTS) != scenario_digest(s, dataclasses.replace(OPTS, iters=3))


def _rank(rank: int, port: int, hidden_of_rank1: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    s = scenario.load(SCENARIOS / "smoke.yaml")
    if rank == 1:
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, hidden=hidden_of_rank1))
    try:
        check_same_scenario(s, OPTS)
        out.put((rank, "ok"))
    except UserError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hidden,agree", [(256, True), (512, False)])
def test_ranks_with_different_scenarios_stop_with_one_line(hidden, agree):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, hidden, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if agree:
        assert results == {0: "ok", 1: "ok"}
    else:
        assert all("differ across ranks" in m and "\n" not in m for m in results.values())


def test_no_ceiling_across_real_nodes_but_on_virtual_ones():
    """The ceiling kernels map peers with CUDA IPC, which cannot cross nodes: a real multi-node run
    skips them with a note (before touching a GPU); virtual nodes on one host do measure them."""
    from types import SimpleNamespace

    import epbench.session as session

    notes = []
    comm = SimpleNamespace(device=SimpleNamespace(type="cuda"), world=4, ranks_per_gpu=1)
    real = scenario.load(SCENARIOS / "h100x32.yaml")
    assert session.measure_ceilings(real, OPTS, comm, notes.append) is None
    assert notes == ["ceilings: measured inside one node only (this run spans 4 nodes; "
                     "`epbench ceiling` on one node measures that node's)"]
    virtual = scenario.load(SCENARIOS / "h200x2x2-virtual.yaml")
    notes.clear()  # virtual nodes pass this guard and reach the next one (tokens the run leaves out)
    assert session.measure_ceilings(virtual, dataclasses.replace(OPTS, tokens=(7,)), comm, notes.append) is None
    assert notes == ["ceilings: measured for the scenario's own tokens_per_rank, which --tokens leaves out"]


def test_low_latency_runs_measure_ceilings_of_their_own_batch(monkeypatch):
    """Low-latency mode: the ceilings of the scenario's own batch (one row per token and rank) with a
    note saying so; a token sweep that leaves that batch out measures none."""
    import epbench.ceiling as ceiling
    import epbench.session as session

    s = scenario.load(SCENARIOS / "dsv3x4-ll.yaml")
    seen = {}
    monkeypatch.setattr(ceiling, "every_ranks_limits", lambda comm: None)
    monkeypatch.setattr(ceiling, "rates_of", lambda limits: None)

    def measured(swept, tr, comm, warmup, iters, rates):
        seen["bytes"] = tr
        return [ceiling.OpCeiling(op=op, bytes_per_rank=[1], copy_engine_us=1.0, sm_store_us={132: 2.0}, ideal_us=None)
                for op in ("dispatch", "combine")]

    monkeypatch.setattr(ceiling, "measure_ceilings", measured)
    notes = []
    found = session.measure_ceilings(s, OPTS, _comm(4, 1), notes.append)
    assert "bytes" in seen and found is not None
    assert any(n.startswith("ceilings: for the 128-token batch, one row per token and rank") for n in notes)
    notes.clear()
    assert session.measure_ceilings(s, dataclasses.replace(OPTS, tokens=(1, 8)), _comm(4, 1), notes.append) is None
    assert notes == ["ceilings: measured for the scenario's own tokens_per_rank, which --tokens leaves out"]


def _comm(world, per_gpu, device="cuda"):
    from types import SimpleNamespace

    return SimpleNamespace(device=SimpleNamespace(type=device), world=world, ranks_per_gpu=per_gpu,
                           shared=per_gpu > 1)


def test_no_ceiling_where_nothing_crosses_a_link():
    """Ranks sharing a GPU, or one rank: a copy "ceiling" of bytes that never leave the GPU would
    be a figure with no meaning (issue 18: 0 MB in 1.25 us, % of ceiling above 100)."""
    import epbench.session as session

    s = scenario.load(SCENARIOS / "dsv3x4.yaml")
    for comm, why in ((_comm(4, 4), "4 ranks share each GPU"), (_comm(1, 1), "one rank")):
        notes = []
        assert session.measure_ceilings(s, OPTS, comm, notes.append) is None
        assert len(notes) == 1 and notes[0].startswith("ceilings: not measured (") and why in notes[0]


def test_sharing_is_recorded_with_mps_and_the_reason(monkeypatch, tmp_path):
    import epbench.session as session

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    info = session.sharing(_comm(4, 2))
    assert info == {"functional": "2 ranks share each GPU: their traffic stays in one GPU's memory",
                    "ranks_per_gpu": 2, "mps": "off"}
    notes = session.sharing_notes(_comm(4, 2))
    assert len(notes) == 2 and "MPS off: without it the ranks take turns" in notes[0]
    assert notes[1].startswith("functional run (2 ranks share each GPU")
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemon:  # the MPS control daemon's socket
        daemon.bind(str(tmp_path / "control"))
        daemon.listen(4)
        assert session.sharing(_comm(4, 2))["mps"] == "on"
        assert "MPS on" in session.sharing_notes(_comm(4, 2))[0]
        # separate GPUs: nothing to note, nothing functional; CPU runs say nothing about MPS
        assert session.sharing(_comm(4, 1)) == {"functional": None, "ranks_per_gpu": 1, "mps": "on"}
        assert session.sharing_notes(_comm(4, 1)) == []
        assert "mps" not in session.sharing(_comm(4, 1, "cpu"))


@pytest.fixture
def world_of_one(monkeypatch):
    """This process as rank 0 of 1 (gloo, CPU); the process group is gone afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _overlap_plan(tmp_path):
    from epbench.overlap import GemmSpec, OverlapOptions
    from epbench.plan import Plan

    opts = OverlapOptions(("reference",), (4,), 1, 2, GemmSpec("square", 8, 8, 8))
    return Plan(verb="overlap", scenario=scenario.load(SCENARIOS / "smoke.yaml"), options=opts,
                device="cpu", argv=("overlap",), results=tmp_path)


def test_the_engine_runs_a_verbs_measurement_and_finishes_its_folder(monkeypatch, tmp_path, world_of_one):
    """Whatever a verb measures (its hook, faked here), the engine gives it the process group,
    the results folder and the notes, records how the job ended, and shows the folder where no
    launcher waits."""
    from epbench.results import load_run

    def measure(job):
        job.note("a note")
        job.note("a note")
        job.open(job.meta(verb="overlap", overlap={"gemm": "bf16 8x8x8"}))
        rows = job.gather({"backend": "copy", "sms": 4, "rank": job.comm.rank, "wrong": 1})
        job.record(rows, [{"backend": "copy", "sms": 4, "rank": 0, "iter": 0, "time_us": 1.0}])
        return job.rank0_count(1)

    monkeypatch.setattr(session, "measurement", lambda verb: measure)
    shown = []
    assert session.run_worker(_overlap_plan(tmp_path), _overlap_plan(tmp_path).options, False, shown.append) == 1
    (folder,) = shown
    meta, df = load_run(folder)
    assert meta["status"] == "complete" and meta["wrong"] == 1 and meta["notes"] == ["a note"]
    assert meta["verb"] == "overlap" and meta["world"] == 1 and meta["options"]["sms"] == [4]
    assert list(df["backend"]) == ["copy"] and (folder / "samples.csv").is_file()


def test_a_measurement_that_raises_leaves_a_failed_folder(monkeypatch, tmp_path, world_of_one):
    from epbench.results import load_run

    def measure(job):
        job.note("before the failure")
        job.open(job.meta(verb="overlap"))
        raise RuntimeError("the GEMM broke")

    monkeypatch.setattr(session, "measurement", lambda verb: measure)
    with pytest.raises(RuntimeError, match="the GEMM broke"):
        session.run_worker(_overlap_plan(tmp_path), _overlap_plan(tmp_path).options, False, print)
    (folder,) = list(tmp_path.iterdir())
    meta = load_run(folder)[0]
    assert meta["status"] == "failed" and "the GEMM broke" in meta["error"]
    assert meta["notes"] == ["before the failure"]


def test_rank0_records_how_each_backends_points_are_timed_before_timing_them(tmp_path, world_of_one):
    """meta.json's ``variants``: what the launcher needs to record every point a job lost, the
    point it died in included (results.lost_rows)."""
    from epbench.plan import Plan
    from epbench.results import load_run

    opts = RunOptions(backends=("reference",), sms=(4,), warmup=1, iters=2, tokens=(8,), progress=False,
                      ceilings=False, input_sets=(1,))
    p = Plan(verb="run", scenario=scenario.load(SCENARIOS / "smoke.yaml"), options=opts, device="cpu",
             argv=("run",), results=tmp_path, control_timeout_s=60)
    shown = []
    assert session.run_worker(p, opts, False, shown.append) == 0
    (folder,) = shown
    meta, df = load_run(folder)
    assert meta["variants"] == {"reference": [{"call_mode": "call", "input_sets": 1},
                                              {"call_mode": "kernel", "input_sets": 1}]}
    assert list(df["call_mode"]) == ["call", "call", "kernel", "kernel"]


def test_the_variants_are_recorded_before_the_backend_is_built(tmp_path, world_of_one, monkeypatch):
    """A job that dies while it builds its backend (allocating its buffers: where a CPU rank peaks) has
    its variants in meta.json already, from the backend's class, so every point it lost is recorded."""
    from epbench.backends.reference import ReferenceBackend
    from epbench.plan import Plan
    from epbench.results import load_run

    def dies(self, *args, **kwargs):
        raise RuntimeError("the buffers did not fit")

    monkeypatch.setattr(ReferenceBackend, "__init__", dies)
    opts = RunOptions(backends=("reference",), sms=(4,), warmup=1, iters=2, tokens=(8,), progress=False,
                      ceilings=False, input_sets=(1,))
    p = Plan(verb="run", scenario=scenario.load(SCENARIOS / "smoke.yaml"), options=opts, device="cpu",
             argv=("run",), results=tmp_path, control_timeout_s=60)
    with pytest.raises(RuntimeError, match="the buffers did not fit"):
        session.run_worker(p, opts, False, print)
    (folder,) = list(tmp_path.iterdir())
    assert load_run(folder)[0]["variants"] == {"reference": [{"call_mode": "call", "input_sets": 1},
                                                             {"call_mode": "kernel", "input_sets": 1}]}


@pytest.mark.parametrize("name", ["x[/]y", "ü n[i]"])
def test_show_run_prints_the_folder_as_it_is(tmp_path, name):
    """A '[' in the --results path the user chose is text: rich markup there ended the run after its
    table with a MarkupError ('[/]') or dropped part of the path ('[i]')."""
    from rich.console import Console

    from epbench.results import RunWriter

    d = tmp_path / name / "run"
    meta = {"scenario": {"name": "s"}, "world": 1, "device": "cpu"}
    row = {"scenario": "s", "backend": "reference", "op": "dispatch", "sms": 0, "rank": 0, "world": 1,
           "time_us": 10.0, "wrong": 0, "problem": ""}
    w = RunWriter(d, meta)
    w.add([row], [])
    w.finish("complete")
    c = Console(record=True, width=400, color_system=None)
    session.show_run(d, c)
    assert f"results: {d}" in c.export_text().splitlines()[-1]
