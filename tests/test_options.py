"""epbench/options.py: backend options parsed, validated (one line each) and resolved."""

from __future__ import annotations

import pytest

from epbench import options, scenario
from epbench.errors import UserError


def test_scenario_mapping_is_typed_and_aliases_normalised() -> None:
    got = options.validate({"epbench": {"dispatch_impl": "lean-dyn", "combine_warps": 12},
                            "epbench-hier": {"send_share": 0.25}})
    assert got == {"epbench": {"dispatch_impl": "lean_dyn", "combine_warps": 12},
                   "epbench-hier": {"send_share": 0.25}}


@pytest.mark.parametrize("data,match", [
    ({"epbench": {"nope": 1}}, r"backend_options\.epbench\.nope: unknown option \(known: dispatch_impl"),
    ({"epbench": {"dispatch_impl": "spread"}}, r"dispatch_impl: must be one of lean_dyn, lean, got 'spread'"),
    ({"epbench": {"dispatch_warps": 33}}, r"dispatch_warps: must be an integer in \[1, 32\], got 33"),
    ({"epbench": {"dispatch_warps": True}}, r"must be an integer"),
    ({"epbench-hier": {"send_share": 1.0}}, r"send_share: must be a number in \(0, 1\)"),
    ({"reference": {"x": 1}}, r"backend 'reference' takes no options"),
    ({"epbench": [1]}, r"must be a mapping of option -> value"),
    ([1], r"must be a mapping of backend -> options"),
])
def test_bad_options_are_one_line_user_errors(data, match) -> None:
    with pytest.raises(UserError, match=match) as e:
        options.validate(data)
    assert "\n" not in str(e.value)


def test_cli_items_bare_and_qualified() -> None:
    got = options.parse_cli(["dispatch_impl=lean", "epbench.combine_warps=8", "epbench-ll.combine_chunk=2"])
    assert got == {"epbench": {"dispatch_impl": "lean", "combine_warps": 8}, "epbench-ll": {"combine_chunk": 2}}


@pytest.mark.parametrize("item,match", [
    ("dispatch_impl", r"must be \[backend\.\]key=value"),
    ("combine_chunk=2", r"'combine_chunk' is ambiguous or unknown \(epbench, epbench-ll have it"),
    ("nothing=1", r"no backend has it"),
    ("epbench.dispatch_warps=x", r"--option\.epbench\.dispatch_warps: must be an integer"),
])
def test_bad_cli_items(item, match) -> None:
    with pytest.raises(UserError, match=match):
        options.parse_cli([item])


def test_resolve_given_then_environment_then_default() -> None:
    env = {"EPBENCH_DISPATCH_WARPS": "8", "EPBENCH_DISPATCH_IMPL": "lean"}
    got = options.resolve("epbench", {"dispatch_impl": "lean_dyn"}, env)
    assert got["dispatch_impl"] == "lean_dyn" and got["dispatch_warps"] == 8 and got["combine_chunk"] == 2048
    with pytest.raises(UserError, match="EPBENCH_COMBINE_CHUNK: must be one of 1024, 2048, 4096"):
        options.resolve("epbench", {}, {"EPBENCH_COMBINE_CHUNK": "3000"})
    assert options.resolve("reference", {}) == {}


def test_scenario_key_is_validated_with_the_file() -> None:
    base = {"model": {"hidden": 64, "tokens_per_rank": 8, "topk": 2, "experts_per_rank": 2},
            "topology": {"nodes": 1, "gpus_per_node": 2}}
    s = scenario.parse({**base, "backend_options": {"epbench": {"dispatch_impl": "lean"}}}, "x.yaml")
    assert s.backend_options == {"epbench": {"dispatch_impl": "lean"}}
    assert scenario.parse(base, "x.yaml").backend_options == {}
    with pytest.raises(UserError, match=r"^x\.yaml: backend_options\.epbench\.warps: unknown option"):
        scenario.parse({**base, "backend_options": {"epbench": {"warps": 1}}}, "x.yaml")


def test_a_cpu_run_records_the_options_it_was_given(tmp_path) -> None:
    """epbench's kernels skip on CPU; the requested options still land in meta.json, and every row has the
    impl / options columns (empty for the reference backend, which has none)."""
    from support import SCENARIOS, run_cli

    run = run_cli(tmp_path, "run", str(SCENARIOS / "smoke.yaml"), "--nproc", "2", "--iters", "2", "--warmup", "0",
                  "--device", "cpu", "--backends", "reference,epbench", "--option", "dispatch_impl=lean",
                  "--option", "epbench.combine_warps=12")
    assert run.result.code == 0, run.result.both
    assert run.meta()["scenario"]["backend_options"] == {"epbench": {"dispatch_impl": "lean", "combine_warps": 12}}
    rows = run.rows()
    assert {"impl", "options"} <= set(rows.columns) and rows["options"].isna().all()


def test_a_bad_option_is_one_line_and_exit_2(tmp_path) -> None:
    from support import SCENARIOS, assert_one_line_error, epbench_here

    r = epbench_here("run", str(SCENARIOS / "smoke.yaml"), "--device", "cpu", "--option", "epbench.dispatch_impl=spread",
                     "--results", str(tmp_path))
    assert r.code == 2
    assert_one_line_error(r, "dispatch_impl: must be one of lean_dyn, lean")


def test_own_rows_defaults_to_sm_and_takes_ce_from_the_cli_or_the_environment() -> None:
    assert options.resolve("epbench", {}, environ={})["own_rows"] == "sm"
    assert options.parse_cli(["own_rows=ce"]) == {"epbench": {"own_rows": "ce"}}
    assert options.resolve("epbench", {}, environ={"EPBENCH_OWN_ROWS": "ce"})["own_rows"] == "ce"
    assert options.parse_cli(["own_rows=all"]) == {"epbench": {"own_rows": "all"}}
    with pytest.raises(UserError, match=r"own_rows: must be one of sm, ce, all, got 'tma'"):
        options.validate({"epbench": {"own_rows": "tma"}})


@pytest.mark.parametrize("own", ["ce", "all"])
@pytest.mark.parametrize("layout,quantize,match", [
    ("expert_major", "before", r"^s.yaml: epbench\.own_rows={} needs model\.layout rank_major \(got expert_major\)"),
    ("rank_major", "fused", r"^s.yaml: epbench\.own_rows={} needs model\.quantize before \(got fused\)"),
])
def test_own_rows_ce_is_refused_in_one_line_where_a_copy_cannot_serve(layout, quantize, match, own) -> None:
    match = match.format(own)
    given = {"epbench": {"own_rows": own}}
    with pytest.raises(UserError, match=match) as e:
        options.check_payload(given, layout, quantize, "s.yaml", environ={})
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(UserError, match=f"own_rows={own}"):  # the environment counts where it is weighed
        options.check_payload({}, layout, quantize, "s.yaml", environ={"EPBENCH_OWN_ROWS": own})
    options.check_payload({}, layout, quantize, "s.yaml", environ={})  # sm serves every payload
    options.check_payload(given, "rank_major", "before", "s.yaml", environ={})


def test_combine_rows_defaults_to_pull_and_ce_needs_own_rows_all_in_one_line() -> None:
    assert options.resolve("epbench", {}, environ={})["combine_rows"] == "pull"
    assert options.parse_cli(["combine_rows=ce"]) == {"epbench": {"combine_rows": "ce"}}
    with pytest.raises(UserError, match=r"combine_rows: must be one of pull, ce, got 'tma'"):
        options.validate({"epbench": {"combine_rows": "tma"}})
    for own in ("sm", "ce"):
        with pytest.raises(UserError, match=rf"^s.yaml: epbench\.combine_rows=ce needs epbench\.own_rows=all \(got "
                                            rf"{own}\)") as e:
            options.check_payload({"epbench": {"combine_rows": "ce", "own_rows": own}}, "rank_major", "before",
                                  "s.yaml", environ={})
        assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(UserError, match="combine_rows=ce"):  # the environment counts where it is weighed
        options.check_payload({}, "rank_major", "before", "s.yaml", environ={"EPBENCH_COMBINE_ROWS": "ce"})
    options.check_payload({"epbench": {"combine_rows": "ce", "own_rows": "all"}}, "rank_major", "before", "s.yaml",
                          environ={})
    options.check_payload({}, "rank_major", "before", "s.yaml",
                          environ={"EPBENCH_COMBINE_ROWS": "ce", "EPBENCH_OWN_ROWS": "all"})


@pytest.mark.parametrize("key,value,env", [("ce_chunks", 8, "EPBENCH_CE_CHUNKS"), ("ce_streams", 4, "EPBENCH_CE_STREAMS")])
def test_the_push_shape_options_need_combine_rows_ce(key, value, env) -> None:
    assert options.resolve("epbench", {}, environ={})[key] == {"ce_chunks": 16, "ce_streams": 2}[key]
    with pytest.raises(UserError, match=rf"^s.yaml: epbench\.{key}={value} needs epbench\.combine_rows=ce \(got pull\)") as e:
        options.check_payload({"epbench": {key: value}}, "rank_major", "before", "s.yaml", environ={})
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(UserError, match=f"{key}={value}"):
        options.check_payload({}, "rank_major", "before", "s.yaml", environ={env: str(value)})
    options.check_payload({"epbench": {key: value, "combine_rows": "ce", "own_rows": "all"}}, "rank_major", "before",
                          "s.yaml", environ={})
    with pytest.raises(UserError, match=f"{key}: must be one of"):
        options.validate({"epbench": {key: 3}})


def test_fused_stores_16_needs_the_fused_cast_and_is_refused_in_one_line_elsewhere() -> None:
    assert options.resolve("epbench", {}, environ={})["fused_stores"] == 16
    options.check_payload({}, "rank_major", "before", "s.yaml", environ={})  # the default: not asked for
    options.check_payload({"epbench": {"fused_stores": 8}}, "rank_major", "before", "s.yaml", environ={})
    assert options.parse_cli(["fused_stores=16"]) == {"epbench": {"fused_stores": 16}}
    with pytest.raises(UserError, match=r"fused_stores: must be one of 8, 16, got '12'"):
        options.parse_cli(["fused_stores=12"])
    given = {"epbench": {"fused_stores": 16}}
    options.check_payload(given, "rank_major", "fused", "s.yaml", environ={})
    options.check_payload(given, "expert_major", "fused", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"^s.yaml: epbench\.fused_stores=16 needs model\.quantize fused \(got "
                                        r"before\)") as e:
        options.check_payload(given, "rank_major", "before", "s.yaml", environ={})
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(UserError, match="fused_stores=16"):
        options.check_payload({}, "rank_major", "before", "s.yaml", environ={"EPBENCH_FUSED_STORES": "16"})


def test_scenario_file_with_own_rows_ce_and_expert_major_is_refused() -> None:
    data = {"model": {"hidden": 256, "tokens_per_rank": 16, "topk": 4, "experts_per_rank": 4,
                      "dispatch_dtype": "bf16", "layout": "expert_major"},
            "topology": {"nodes": 1, "gpus_per_node": 2},
            "backend_options": {"epbench": {"own_rows": "ce"}}}
    with pytest.raises(UserError, match=r"^f.yaml: backend_options: epbench\.own_rows=ce needs model\.layout"):
        scenario.parse(data, "f.yaml")
    data["model"]["layout"] = "rank_major"
    assert scenario.parse(data, "f.yaml").backend_options == {"epbench": {"own_rows": "ce"}}


def test_diagnostic_is_set_only_where_its_variable_is() -> None:
    assert not options.diagnostic_is_set("align", {})
    assert options.diagnostic_is_set("align", {"EPBENCH_ALIGN": "alltoall"})
    assert options.diagnostic("align", {}) == "alltoall"  # run's default; overlap picks allreduce unless set


def test_ce_share_needs_own_rows_all() -> None:
    assert options.resolve("epbench", {}, environ={})["ce_share"] == 100
    with pytest.raises(UserError, match=r"^s.yaml: epbench\.ce_share=75 needs epbench\.own_rows=all \(got sm\)") as e:
        options.check_payload({"epbench": {"ce_share": 75}}, "rank_major", "before", "s.yaml", environ={})
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    with pytest.raises(UserError, match="ce_share=50"):
        options.check_payload({}, "rank_major", "before", "s.yaml", environ={"EPBENCH_CE_SHARE": "50"})
    options.check_payload({"epbench": {"ce_share": 25, "own_rows": "all"}}, "rank_major", "before", "s.yaml",
                          environ={})
    with pytest.raises(UserError, match="ce_share: must be one of"):
        options.validate({"epbench": {"ce_share": 60}})


def test_ce_chunks_default_depends_on_the_world() -> None:
    """Not given, ce_chunks is 16 at 2 ranks and 4 at 3 or more (one push stream there); given by option or
    environment variable, it is what was given at any world."""
    r = options.resolve("epbench", {}, environ={})
    assert options.ce_chunks_for(2, r, {}, environ={}) == 16
    assert options.ce_chunks_for(4, r, {}, environ={}) == options.CE_CHUNKS_WIDE == 4
    assert options.ce_chunks_for(4, options.resolve("epbench", {"ce_chunks": 16}, environ={}), {"ce_chunks": 16},
                                 environ={}) == 16
    env = {"EPBENCH_CE_CHUNKS": "8"}
    assert options.ce_chunks_for(3, options.resolve("epbench", {}, environ=env), {}, environ=env) == 8


def test_ce_chunking_grow_refuses_ce_chunks_and_needs_ce() -> None:
    """ce_chunking grow sizes its own chunks: ce_chunks given beside it (option or variable) is refused in one line;
    ce_chunking needs combine_rows ce; grow alone passes."""
    grow = {"epbench": {"own_rows": "all", "combine_rows": "ce", "ce_chunking": "grow"}}
    options.check_payload(grow, "rank_major", "before", "x", environ={})
    with pytest.raises(UserError, match="ce_chunks=8 with epbench.ce_chunking=grow"):
        options.check_payload({"epbench": {**grow["epbench"], "ce_chunks": 8}}, "rank_major", "before", "x",
                              environ={})
    with pytest.raises(UserError, match="ce_chunks=32 with epbench.ce_chunking=grow"):
        options.check_payload(grow, "rank_major", "before", "x", environ={"EPBENCH_CE_CHUNKS": "32"})
    with pytest.raises(UserError, match="ce_chunking=grow needs epbench.combine_rows=ce"):
        options.check_payload({"epbench": {"own_rows": "all", "ce_chunking": "grow"}}, "rank_major", "before", "x",
                              environ={})
    with pytest.raises(UserError, match="ce_chunking: must be one of"):
        options.validate({"epbench": {"ce_chunking": "fast"}})


def test_ce_streams_default_depends_on_the_world() -> None:
    """Not given, ce_streams is 2 at 2 ranks and 1 at 3 or more; given (option or variable), what was given at any
    world (at 3+ ranks the chunks alternate over that many streams in all)."""
    r = options.resolve("epbench", {}, environ={})
    assert options.ce_streams_for(2, r, {}, environ={}) == 2
    assert options.ce_streams_for(4, r, {}, environ={}) == options.CE_STREAMS_WIDE == 1
    assert options.ce_streams_for(4, options.resolve("epbench", {"ce_streams": 2}, environ={}), {"ce_streams": 2},
                                  environ={}) == 2
    env = {"EPBENCH_CE_STREAMS": "4"}
    assert options.ce_streams_for(3, options.resolve("epbench", {}, environ=env), {}, environ=env) == 4
    options.check_payload({"epbench": {"own_rows": "all", "combine_rows": "ce", "ce_streams": 4}}, "rank_major",
                          "before", "x", environ={})


def test_pull_kernel_code_auto_gives_way_to_the_tma_knobs() -> None:
    """auto is the library's per-call choice (2) unless the tma kernel is shaped (combine_warps, combine_stages,
    combine_chunk given or set by environment variable): then the tma kernel (0); tma 0 and bulk 1 as asked."""
    code = lambda given, env=None: options.pull_kernel_code(options.resolve("epbench", given, env or {}), given, env or {})
    assert code({}) == 2 and code({"pull_kernel": "tma"}) == 0 and code({"pull_kernel": "bulk"}) == 1
    assert code({"combine_stages": 3}) == 0 and code({"combine_chunk": 4096}) == 0
    assert code({}, {"EPBENCH_COMBINE_WARPS": "8"}) == 0 and code({}, {"EPBENCH_PULL_KERNEL": "bulk"}) == 1
    options.check_payload({"epbench": {"pull_kernel": "auto", "own_rows": "all", "combine_rows": "ce"}},
                          "rank_major", "before", "x", environ={}, world=8)  # auto is refused nowhere


def test_pull_kernel_bulk_is_refused_where_it_cannot_run() -> None:
    """pull_kernel bulk pulls rank-major rows at <= 4 ranks: with combine_rows ce, the expert-major layout or 5+
    ranks it is refused in one line naming why (the pull itself in the words tma's refusal uses); rank-major at 4
    ranks (or world unknown) passes."""
    bulk = {"epbench": {"pull_kernel": "bulk"}}
    options.check_payload(bulk, "rank_major", "before", "x", environ={}, world=4)
    options.check_payload(bulk, "rank_major", "before", "x", environ={})
    with pytest.raises(UserError, match=r"pull_kernel=bulk cannot run with world 8 \(it takes at most 4 ranks\)"):
        options.check_payload(bulk, "rank_major", "before", "x", environ={}, world=8)
    with pytest.raises(UserError, match="pull_kernel=bulk cannot run with model.layout expert_major"):
        options.check_payload(bulk, "expert_major", "before", "x", environ={}, world=2)
    with pytest.raises(UserError, match=r"^x: epbench\.pull_kernel=bulk needs epbench\.combine_rows=pull \(got ce\)"):
        options.check_payload({"epbench": {"pull_kernel": "bulk", "own_rows": "all", "combine_rows": "ce"}},
                              "rank_major", "before", "x", environ={}, world=4)
    with pytest.raises(UserError, match="pull_kernel=bulk cannot run with world 5"):
        options.check_payload({}, "rank_major", "before", "x", environ={"EPBENCH_PULL_KERNEL": "bulk"}, world=5)
    with pytest.raises(UserError, match="combine_stages=3 shapes the tma pull kernel"):
        options.check_payload({"epbench": {"pull_kernel": "bulk", "combine_stages": 3}}, "rank_major", "before", "x",
                              environ={}, world=4)
    with pytest.raises(UserError, match="combine_chunk=4096 shapes the tma pull kernel"):
        options.check_payload(bulk, "rank_major", "before", "x", environ={"EPBENCH_COMBINE_CHUNK": "4096"}, world=2)


def test_pull_kernel_tma_needs_the_pull() -> None:
    """tma names the pull's kernel: with combine_rows ce (no pull) it is refused in one line, not ignored."""
    options.check_payload({"epbench": {"pull_kernel": "tma"}}, "rank_major", "before", "x", environ={}, world=4)
    with pytest.raises(UserError, match=r"^x: epbench\.pull_kernel=tma needs epbench\.combine_rows=pull \(got ce\)"):
        options.check_payload({"epbench": {"pull_kernel": "tma", "own_rows": "all", "combine_rows": "ce"}},
                              "rank_major", "before", "x", environ={}, world=4)


@pytest.mark.parametrize("t,asked,made", [(100, 32, 25), (8, 16, 8), (4096, 16, 16), (4096, 4, 4), (1, 4, 1),
                                          (0, 4, 0), (33, 32, 17)])
def test_ce_chunks_made_follows_the_librarys_even_bounds(t, asked, made) -> None:
    """ceil(T / chunks) rows a chunk, as csrc/buffers.cu ep_ce_bounds: fewer chunks than asked where they do not
    divide T; the count recorded beside the one asked."""
    assert options.ce_chunks_made(t, asked) == made
    if t:  # the same bounds walked as the library walks them
        rows, b, n = max(1, -(-t // asked)), 0, 0
        while b < t:
            b, n = min(t, b + rows), n + 1
        assert n == made


@pytest.mark.parametrize("items,match", [
    (["epbench.dispatch_warps=8", "epbench.dispatch_warps=4"], r"epbench\.dispatch_warps is listed twice \(8, then 4\)"),
    (["dispatch_warps=8", "epbench.dispatch_warps=8"], r"--option: epbench\.dispatch_warps is listed twice; give it once"),
    (["epbench-ll.warps=4", "warps=4"], r"epbench-ll\.warps is listed twice"),
])
def test_an_option_given_twice_is_refused_as_sms_are(items, match) -> None:
    """Last-wins would run with a value the user may not have meant; the same value twice says
    nothing, and --sms 4,4 is refused as listed twice too."""
    with pytest.raises(UserError, match=match):
        options.parse_cli(items)
    assert options.parse_cli(["epbench.dispatch_warps=8", "epbench-ll.warps=8"]) == {
        "epbench": {"dispatch_warps": 8}, "epbench-ll": {"warps": 8}}


def test_an_option_given_twice_stops_run_in_one_line(tmp_path) -> None:
    from support import SCENARIOS, assert_one_line_error, epbench_here

    r = epbench_here("run", str(SCENARIOS / "smoke.yaml"), "--backends", "epbench", "--option",
                     "epbench.dispatch_warps=8", "--option", "epbench.dispatch_warps=4", "--results", str(tmp_path / "res"))
    assert_one_line_error(r, "--option: epbench.dispatch_warps is listed twice (8, then 4)")
    assert not (tmp_path / "res").exists()
