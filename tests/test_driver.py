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
