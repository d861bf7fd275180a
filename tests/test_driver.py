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
