"""Virtual nodes: a multi-node shape run on one host, its inter-node tier labelled virtual."""

from __future__ import annotations

import pytest
import torch

from epbench import scenario
from epbench.routing import all_on_nvlink, route_all, traffic
from support import SCENARIOS, run_cli


def test_virtual_nodes_run_all_ranks_on_one_host():
    s = scenario.load(SCENARIOS / "h200x2x2-virtual.yaml")
    assert s.topology.virtual_nodes and s.world == 4
    assert s.topology.ranks_per_host == 4
    real = scenario.load(SCENARIOS / "h100x32.yaml")
    assert not real.topology.virtual_nodes and real.topology.ranks_per_host == 8
    assert not s.with_world(4).topology.virtual_nodes or s.with_world(4) is s
    small = scenario.load(SCENARIOS / "smoke-virtual.yaml").with_world(2)
    assert not small.topology.virtual_nodes and small.world == 2  # --nproc: one plain node


def test_flat_traffic_across_virtual_nodes_counts_nic_copies():
    s = scenario.load(SCENARIOS / "smoke-virtual.yaml")
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    # ranks 0,1 on node 0 and 2,3 on node 1: copies between the pairs are NIC-tier copies
    assert int(tr.nic[0, 2]) == int(tr.total[0, 2]) > 0
    assert int(tr.nic[0, 1]) == 0 and int(tr.nvlink[0, 1]) == int(tr.total[0, 1])
    # the ceiling of a virtual-node run covers both tiers: every off-GPU copy on NVLink, none twice
    both = all_on_nvlink(tr)
    assert torch.equal(both.nvlink, tr.nvlink + tr.nic) and int(both.nic.sum()) == 0
    assert int(both.nvlink[0, 2]) == int(tr.total[0, 2]) and int(both.nvlink[0, 0]) == 0


@pytest.mark.slow
def test_cpu_run_marks_the_nic_tier_virtual_and_shows_no_link_figures(results_root):
    # the reference backend alone: the scenario's epbench backend is skipped on CPU (one job less)
    run = run_cli(results_root, "run", "scenarios/smoke-virtual.yaml", "--backends", "reference")
    assert run.result.code == 0, run.result.both
    rows = run.rows()
    assert rows["nic_virtual"].all()
    # CPU ranks over gloo cross no link, virtual NIC included: no link bytes, no bus bandwidth, said so
    assert rows["nic_bytes"].isna().all() and rows["busbw_nic_gbps"].isna().all()
    assert "NIC busbw" not in run.result.out and "nothing crossed a link" in run.result.out
    assert int(rows["wrong"].sum()) == 0
