"""The memory check before a launch for CPU ranks (scenario.cpu_rank_bytes, check_fits, cli.check_memory):
no ranks start here."""

import dataclasses
import math
import os

import pytest

from support import SCENARIOS, scenario_dict
from epbench import cli, scenario
from epbench.errors import UserError

GiB = 2**30
# the audit's host: 23 GiB, about 22 GiB of it available, shared by 2 ranks; an idle rank ~0.3 GiB
HOST_SHARE = 22 * GiB // 2
IDLE_RANK = 300 << 20


def dsv3_on_2() -> scenario.Scenario:
    return scenario.load(SCENARIOS / "dsv3x4.yaml").with_world(2)


def with_sets(s: scenario.Scenario, n: int) -> scenario.Scenario:
    return dataclasses.replace(s, bench=dataclasses.replace(s.bench, input_sets=(n,)))


def test_the_estimate_grows_with_what_it_models():
    s = dsv3_on_2()
    est = scenario.cpu_rank_bytes
    base = est(s, 2048)
    assert est(s, 4096) == pytest.approx(2 * base, rel=0.01)  # every term is per token
    assert est(with_sets(s, 8), 2048) > est(s, 2048) > est(with_sets(s, 1), 2048)
    assert est(s.with_world(4), 2048) > base  # more rows received, a larger dense combine buffer
    wide = scenario.parse(scenario_dict(model={"hidden": 4096}))
    assert est(wide) == pytest.approx(2 * est(scenario.parse(scenario_dict(model={"hidden": 2048}))), rel=0.01)
    fp8 = scenario.load(SCENARIOS / "dsv3x4-fp8.yaml").with_world(2)
    assert est(fp8, 2048) < base  # rows of about half the bytes (the checks' fp32 rows stay)
    em = scenario.load(SCENARIOS / "dsv3x4-expert.yaml").with_world(2)  # align 128
    loose = dataclasses.replace(em, model=dataclasses.replace(em.model, align=16))
    assert est(em, 2048) > est(loose, 2048)  # more padding per expert segment
    ll = scenario.parse(scenario_dict(mode="low_latency"))
    more = scenario.parse(scenario_dict(mode="low_latency", model={"experts_per_rank": 8}))
    assert est(more) > 1.5 * est(ll)  # a padded receive buffer per local expert


def test_the_estimate_is_far_above_the_old_lower_bound():
    """The defect: min_bytes_per_rank (own rows in and out, every rank's rows received) left out the
    backend's other buffers, the input sets, the kept output, the fp32 rows of the stand-in expert
    and of the checks: ranks measured 8 times its figure."""
    s = dsv3_on_2()
    assert scenario.cpu_rank_bytes(s, 32768) > 6 * scenario.min_bytes_per_rank(s, 32768)


def test_rows_received_per_token():
    assert scenario.received_per_token(scenario.parse(scenario_dict(topology={"gpus_per_node": 1}))) \
        == (1.0, 4.0)  # one rank: every row, every pick (4 experts per rank, top-4 of them)
    s = dsv3_on_2()  # top-8 of 128 experts, 64 on each rank
    rows, picks = scenario.received_per_token(s)
    assert rows == pytest.approx(1 - math.comb(64, 8) / math.comb(128, 8))
    assert picks == pytest.approx(4.0)
    hot = dataclasses.replace(s, routing=dataclasses.replace(s.routing, kind="hot"))
    assert scenario.received_per_token(hot) == (1.0, 8.0)  # no mean to lean on: the worst case


def test_the_audit_shape_is_refused_on_a_host_share_like_the_audits():
    s = dsv3_on_2()
    assert scenario.min_bytes_per_rank(s, 32768) < HOST_SHARE  # what let it through before
    with pytest.raises(UserError) as e:
        scenario.check_fits(s, 2, "this host's memory available to 2 CPU ranks", HOST_SHARE, 32768, "cpu",
                            IDLE_RANK)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(f"{s.source}: model: needs about ")
    for part in ("GiB per CPU rank", "tokens_per_rank 32768", "2 ranks", "4 input sets", "has 11 GiB per rank"):
        assert part in msg, msg


def test_a_small_shape_fits_and_the_idle_rank_counts():
    s = dsv3_on_2()
    scenario.check_fits(s, 2, "this host", HOST_SHARE, 512, "cpu", IDLE_RANK)
    need = scenario.cpu_rank_bytes(s, 512)
    scenario.check_fits(s, 2, "this host", need + IDLE_RANK, 512, "cpu", IDLE_RANK)
    with pytest.raises(UserError, match="GiB per CPU rank"):
        scenario.check_fits(s, 2, "this host", need + IDLE_RANK - 1, 512, "cpu", IDLE_RANK)


def test_check_memory_holds_cpu_ranks_to_the_estimate(monkeypatch):
    """cli.check_memory: the host's available memory shared by its ranks, against the CPU estimate
    plus this process's own resident bytes."""
    monkeypatch.setattr(cli, "_host_memory", lambda: 2 * HOST_SHARE)
    monkeypatch.setattr(cli, "_own_resident_bytes", lambda: IDLE_RANK, raising=False)
    s = dsv3_on_2()
    with pytest.raises(UserError, match=r"GiB per CPU rank .* has 11 GiB per rank"):
        cli.check_memory(s, "cpu", (512, 32768))
    cli.check_memory(s, "cpu", (512, 2048))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_own_resident_bytes_is_this_process():
    rss = cli._own_resident_bytes()
    peak = cli._kib_field("/proc/self/status", "VmHWM")  # read after: the peak so far, at least that
    assert 0 < rss <= peak
