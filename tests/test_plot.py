"""epbench plot: PNGs drawn from results folders only (a CPU smoke run and the GPU runs kept in
docs/perf)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from epbench.plot import plot_run
from support import REPO, epbench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GPU_RUN = sorted((REPO / "docs" / "perf").glob("*_h200x4"))


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 10_000 and path.read_bytes()[:8] == PNG_MAGIC


def test_plot_command_writes_every_png_of_a_cpu_run(smoke_run, tmp_path):
    out = tmp_path / "pngs"
    r = epbench("plot", str(smoke_run.dir), "--out", str(out))
    assert r.code == 0, r.both
    written = sorted(p.name for p in (out / smoke_run.dir.name).iterdir())
    assert written == ["bandwidth_vs_sms.png", "expert_load.png", "per_rank.png"]
    assert all(_is_png(out / smoke_run.dir.name / name) for name in written)
    assert not (smoke_run.dir / "plots").exists()  # --out keeps the run folder as it was


@pytest.mark.skipif(not GPU_RUN, reason="no GPU run kept in docs/perf")
def test_plot_of_a_gpu_sweep_with_several_sm_counts(tmp_path):
    run = tmp_path / GPU_RUN[-1].name
    shutil.copytree(GPU_RUN[-1], run, ignore=shutil.ignore_patterns("plots"))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    pngs = plot_run(run)
    assert [p.name for p in pngs] == ["bandwidth_vs_sms.png", "per_rank.png", "expert_load.png"]
    assert all(_is_png(p) for p in pngs)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # plotting never touches the measured files


def test_plot_of_something_that_is_not_a_results_folder(tmp_path):
    r = epbench("plot", str(tmp_path))
    assert r.code == 2
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


LL_RUN = sorted((REPO / "docs" / "perf").glob("*_dsv3x4-ll"))


@pytest.mark.skipif(not LL_RUN, reason="no low-latency GPU run kept in docs/perf")
def test_plot_of_a_low_latency_tokens_sweep_adds_latency_against_tokens(tmp_path):
    run = tmp_path / LL_RUN[0].name
    shutil.copytree(LL_RUN[0], run, ignore=shutil.ignore_patterns("plots", "samples.csv"))
    pngs = plot_run(run)
    names = [p.name for p in pngs]
    assert "latency_vs_tokens.png" in names  # the first kept run swept 1..256 tokens
    assert all(_is_png(p) for p in pngs)


VIRTUAL_RUN = sorted((REPO / "docs" / "perf").glob("*/results/*_h200x2x2-virtual"))


@pytest.mark.skipif(not VIRTUAL_RUN, reason="no virtual-node GPU run kept in docs/perf")
def test_plot_of_a_virtual_node_run_draws_the_nic_tier_labelled_virtual(tmp_path):
    from epbench.metrics import summarize
    from epbench.plot import bus_tiers
    from epbench.results import load_run

    run = tmp_path / VIRTUAL_RUN[-1].name
    shutil.copytree(VIRTUAL_RUN[-1], run, ignore=shutil.ignore_patterns("plots", "samples.csv"))
    _, df = load_run(run)
    labels = [label for _, label, _ in bus_tiers(summarize(df), virtual=True)]
    assert labels == ["NVLink busbw", "NIC busbw (virtual)"]
    assert all(_is_png(p) for p in plot_run(run))
    one_node = summarize(df.assign(busbw_nic_gbps=None))
    assert [label for _, label, _ in bus_tiers(one_node)] == ["NVLink busbw"]


def test_output_path_names_the_file_that_will_be_written(tmp_path):
    from epbench.errors import UserError
    from epbench.plot import output_path

    assert output_path(tmp_path / "ab", False) == tmp_path / "ab.png"  # what matplotlib would write
    assert output_path(tmp_path / "ab.svg", False) == tmp_path / "ab.svg"
    (tmp_path / "old.png").write_bytes(b"kept")
    with pytest.raises(UserError, match="exists; --force overwrites it"):
        output_path(tmp_path / "old.png", False)
    assert output_path(tmp_path / "old.png", True) == tmp_path / "old.png"
    with pytest.raises(UserError, match="unknown image type 'txt'"):
        output_path(tmp_path / "a.txt", False)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(UserError, match="is a folder"):
        output_path(tmp_path / "d.png", True)
    assert (tmp_path / "old.png").read_bytes() == b"kept"
