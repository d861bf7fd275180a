"""The driver's pieces that need no process group."""


def test_a_normal_only_backend_runs_its_normal_path_in_a_low_latency_run():
    from epbench.driver import runs_as_normal

    class NormalOnly:
        modes = ("normal",)

    class Both:
        modes = ("normal", "low_latency")

    class LowLatencyOnly:
        modes = ("low_latency",)

    assert runs_as_normal(NormalOnly, "low_latency")
    assert not runs_as_normal(NormalOnly, "normal")
    assert not runs_as_normal(Both, "low_latency")  # has its own low-latency path
    assert not runs_as_normal(LowLatencyOnly, "low_latency")
    assert not runs_as_normal(None, "low_latency")


def test_backends_without_mxfp8_or_expert_major_are_skipped_with_a_reason():
    from epbench import scenario as sc
    from epbench.backends import backend_class
    from epbench.driver import _payload_reason
    from support import scenario_dict

    m = sc.parse(scenario_dict(model={"dispatch_dtype": "mxfp8", "layout": "expert_major"})).model
    assert _payload_reason(backend_class("reference"), m) is None
    assert _payload_reason(backend_class("epbench"), m) is None  # both since the expert-major kernels
    for name in ("epbench-ll", "epbench-hier", "deepep"):
        try:
            cls = backend_class(name)
        except ImportError:
            continue
        assert _payload_reason(cls, m) == "does not implement dispatch_dtype mxfp8 (it implements: bf16, fp8)"
    bf16_em = sc.parse(scenario_dict(model={"layout": "expert_major"})).model
    assert _payload_reason(backend_class("epbench-hier"), bf16_em) == \
        "does not implement layout expert_major (it implements: rank_major)"


def test_measure_size_keeps_the_timing_module_in_reach():
    """_measure_size ends with ``timing.host_gate()`` (the module) on GPUs: a local variable of that
    name (a loop over timing modes) made it a string there, and every GPU run failed at its end."""
    from epbench import driver

    assert "timing" not in driver._measure_size.__code__.co_varnames


def _setup(mode="low_latency", world=1):
    import torch

    from epbench.contract import RankSetup

    return RankSetup(rank=0, world=world, gpus_per_node=world, device=torch.device("cpu"), hidden=128,
                     max_tokens_per_rank=4, topk=2, experts_per_rank=2, dispatch_dtype="bf16", mode=mode)


def _backend(graphs: bool, reason=None):
    from epbench.backends.base import Backend

    class Fake(Backend):  # never instantiated: timings_of reads class attributes only
        modes = ("low_latency",)
        supports_cuda_graphs = graphs

        @classmethod
        def chain_reason(cls, setup):
            return reason if reason is not None else super().chain_reason(setup)

    return Fake


def test_graph_and_chain_timings_only_for_cuda_graph_backends_on_gpus():
    from epbench.driver import timings_of

    graphs, plain = _backend(True), _backend(False)
    assert timings_of(graphs, _setup(), "cuda", False, 8) == (("launch", "graph", "chain"), None)
    assert timings_of(graphs, _setup(), "cuda", False, 0) == (("launch", "graph"), None)  # --graph-chain 0
    assert timings_of(graphs, _setup(), "cpu", False, 8) == (("launch",), None)
    assert timings_of(plain, _setup(), "cuda", False, 8) == (("launch",), None)
    assert timings_of(graphs, _setup(mode="normal"), "cuda", False, 8) == (("launch",), None)
    assert timings_of(plain, _setup(mode="normal"), "cuda", True, 8) == (("normal",), None)
    assert timings_of(_backend(True, "no chains here"), _setup(), "cuda", False, 8) == \
        (("launch", "graph"), "no chains here")
    assert plain.chain_reason(_setup()) == "its calls cannot be captured in a CUDA graph"


def test_epbench_ll_chains_at_world_1_only():
    import pytest

    ll = pytest.importorskip("epbench.backends.epbench_ll").EpbenchLowLatencyBackend
    from epbench.driver import timings_of

    assert ll.chain_reason(_setup(world=1)) is None
    why = ll.chain_reason(_setup(world=2))
    assert why and "world 1" in why
    assert timings_of(ll, _setup(world=2), "cuda", False, 8) == (("launch", "graph"), why)


def fake_timer(monkeypatch, seen, samples=(8.0, 16.0)):
    """driver.Timer replaced: each timed call appends (iteration, gated) to ``seen`` and runs; samples_us
    gives ``samples`` (cycled) for the timed iterations."""
    from epbench import driver

    class FakeTimer:
        def __init__(self, device, n):
            self.n = n

        def time(self, i, fn, align=None, gated=False, align_on_stream=False):
            seen.append((i, gated))
            return fn()

        def samples_us(self, skip):
            return [samples[k % len(samples)] for k in range(self.n - skip)]

    monkeypatch.setattr(driver, "Timer", FakeTimer)


def test_a_chain_sample_is_one_replay_over_k(monkeypatch):
    from types import SimpleNamespace

    import torch

    from epbench import driver

    seen = []
    fake_timer(monkeypatch, seen)
    comm = SimpleNamespace(rank=0, device=torch.device("cpu"), sync=lambda: None)
    loaded = []

    def calls(per_replay, gated):
        return driver.PointCalls(lambda: torch.zeros(1), lambda out: torch.ones(1), loaded.append, lambda out: None,
                                 gated=gated, per_replay=per_replay)

    samples, last = driver._time_pair(comm, 0, 2, calls(4, True), ["set0", "set1"])
    assert samples == {"dispatch": [2.0, 4.0], "combine": [2.0, 4.0]} and all(g for _, g in seen)
    assert loaded == ["set0", "set1"] and last.draw_index == 1 and float(last.got) == 1.0
    samples, _ = driver._time_pair(comm, 0, 2, calls(1, False), ["set0"])
    assert samples["dispatch"] == [8.0, 16.0] and not seen[-1][1]


def test_switch_gate_launches_gates_the_timed_plain_calls_of_host_free_backends_only(monkeypatch):
    from types import SimpleNamespace

    import torch

    from epbench import driver

    seen = []
    fake_timer(monkeypatch, seen, (1.0,))
    comm = SimpleNamespace(rank=0, device=torch.device("cpu"), sync=lambda: None)
    inp = SimpleNamespace()

    def plain(host_free, switch, warmup=2):
        monkeypatch.setenv("EPBENCH_GATE_LAUNCHES", switch)
        be = SimpleNamespace(host_free_calls=host_free, dispatch=lambda i, n: torch.zeros(1),
                             combine=lambda o, n: torch.ones(1), prepare_combine=lambda o: None)
        monkeypatch.setattr(driver, "_fill_expert_output", lambda be, out, rank: None)
        seen.clear()
        driver._time_pair(comm, warmup, 3, driver.normal_calls(be, inp, 8, 0), [inp])
        return seen[:]

    # 2 warm-up and 3 timed iterations, dispatch and combine each: only the timed ones are gated
    assert plain(True, "1") == [(i, i >= 2) for i in range(5) for _ in range(2)]
    assert not any(g for _, g in plain(True, "0"))  # the default: graph replays only
    assert not any(g for _, g in plain(False, "1"))  # a backend whose calls may wait on the host
    # no warm-up: the very first launch (which may load its kernels) is still not gated
    assert plain(True, "1", warmup=0) == [(i, i >= 1) for i in range(3) for _ in range(2)]


def test_overlap_loop_runs_the_stand_in_expert_after_the_first_and_last_dispatch_only(monkeypatch):
    """expert_each False (overlap): the expert's whole-buffer kernels stay out of the loop beside the
    GEMM except where the combine's output is checked (the last iteration) and before the first combine;
    the default writes it after every dispatch."""
    from types import SimpleNamespace

    import torch

    from epbench import driver

    seen = []
    fake_timer(monkeypatch, seen, (1.0,))
    comm = SimpleNamespace(rank=0, device=torch.device("cpu"), sync=lambda: None)
    filled = []
    n = [0]

    def dispatch():
        n[0] += 1
        return n[0]

    calls = driver.PointCalls(dispatch, lambda out: torch.ones(1), lambda inp: None, filled.append)
    driver._time_pair(comm, 2, 4, calls, ["set0"], expert_each=False)
    assert filled == [1, 6]
    filled.clear()
    n[0] = 0
    _, last = driver._time_pair(comm, 2, 4, calls, ["set0"])
    assert filled == [1, 2, 3, 4, 5, 6] and last.out == 6


def test_a_backend_that_uses_more_sms_than_asked_says_so_in_the_notes():
    from epbench.backends import backend_class
    from epbench.driver import backend_notes

    assert backend_notes("epbench", backend_class("epbench")) == []  # its kernels run on --sms blocks
    (note,) = backend_notes("deepep-v2", backend_class("deepep-v2"))  # the adapter imports without deep_ep
    assert note.startswith("backend deepep-v2: ") and "every SM of the GPU whatever --sms says" in note


def test_an_option_that_adds_blocks_is_a_note_of_the_instance():
    from epbench.backends.epbench_kernels import EpbenchBackend
    from epbench.driver import backend_notes

    be = object.__new__(EpbenchBackend)  # as __init__ leaves it with em_sms on (the library call not made here)
    be.sms_beyond = "em_sms=132: its expert-major expansion and reduce passes run on 132 blocks of their own"
    assert backend_notes("epbench", be) == [f"backend epbench: {be.sms_beyond}"]
