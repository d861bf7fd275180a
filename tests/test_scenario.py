import dataclasses

import pytest

from support import DROP, SCENARIOS, scenario_dict
from epbench import scenario
from epbench.errors import UserError

SHIPPED = sorted(SCENARIOS.glob("*.yaml"))


def parse_error(data, source="s.yaml") -> str:
    with pytest.raises(UserError) as e:
        scenario.parse(data, source)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{source}: "), msg
    return msg


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path):
    s = scenario.load(path)
    assert s.name == path.stem
    assert s.source == str(path)
    assert s.model.topk <= s.num_experts


def shape(name):
    s = scenario.load(SCENARIOS / f"{name}.yaml")
    m, t = s.model, s.topology
    return (m.hidden, m.tokens_per_rank, m.topk, m.experts_per_rank, m.dispatch_dtype,
            t.nodes, t.gpus_per_node)


HYBRID_EP = (8192, 4096, 8, 2, "bf16")  # the Hybrid-EP intranode test shape


@pytest.mark.parametrize("name, want", [
    ("h200x4", HYBRID_EP + (1, 4)),
    ("h100x8", HYBRID_EP + (1, 8)),
    ("h100x32", HYBRID_EP + (4, 8)),
    ("gb200nvl36", HYBRID_EP + (1, 36)),
])
def test_the_hybrid_ep_shapes_ship(name, want):
    assert shape(name) == want


def test_h100x32_has_a_400_gbit_nic_per_gpu():
    assert scenario.load(SCENARIOS / "h100x32.yaml").topology.nic_gbps == 50.0


@pytest.mark.parametrize("name, hidden, experts", [
    ("dsv3x4", 7168, 256), ("dsv3x8", 7168, 256), ("qwen3x4", 4096, 128), ("qwen3x8", 4096, 128),
])
def test_the_model_shapes_ship(name, hidden, experts):
    s = scenario.load(SCENARIOS / f"{name}.yaml")
    assert (s.model.hidden, s.model.topk, s.num_experts) == (hidden, 8, experts)
    assert s.world == int(name[-1])


def test_scenarios_are_frozen():
    s = scenario.parse(scenario_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model.hidden = 512
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"


def test_name_defaults_to_the_file_stem_and_can_be_given():
    assert scenario.parse(scenario_dict(), "dir/my-shape.yaml").name == "my-shape"
    assert scenario.parse({**scenario_dict(), "name": "given"}, "x.yaml").name == "given"


def test_defaults_fill_optional_keys():
    data = scenario_dict()
    data.pop("routing")
    data.pop("bench")
    s = scenario.parse(data)
    assert s.routing.kind == "uniform"
    assert s.bench.iters > 0 and s.bench.backends


@pytest.mark.parametrize("data, key, rule", [
    (scenario_dict(model={"hiden": 256}), "model.hiden", "unknown key"),
    ({**scenario_dict(), "colour": "red"}, "colour", "unknown key"),
    (scenario_dict(model={"topk": DROP}), "model.topk", "missing"),
    (scenario_dict(topology={"nodes": DROP}), "topology.nodes", "missing"),
    (scenario_dict(model={"hidden": "big"}), "model.hidden", "integer"),
    (scenario_dict(model={"hidden": 256.0}), "model.hidden", "integer"),
    (scenario_dict(model={"topk": True}), "model.topk", "integer"),
    (scenario_dict(topology={"nvlink_gbps": "fast"}), "topology.nvlink_gbps", "number"),
    (scenario_dict(bench={"sms": 4}), "bench.sms", "list"),
    (scenario_dict(bench={"sms": []}), "bench.sms", "list"),
    (scenario_dict(bench={"backends": [1]}), "bench.backends", "string"),
    (scenario_dict(model=[1, 2]), "model", "mapping"),
    (scenario_dict(model={"topk": 17}), "model.topk", "must not exceed the total number of experts"),
    (scenario_dict(model={"hidden": 0}), "model.hidden", "positive"),
    (scenario_dict(model={"tokens_per_rank": -1}), "model.tokens_per_rank", "positive"),
    (scenario_dict(model={"experts_per_rank": 0}), "model.experts_per_rank", "positive"),
    (scenario_dict(model={"topk": 0}), "model.topk", "positive"),
    (scenario_dict(topology={"nodes": 0}), "topology.nodes", "positive"),
    (scenario_dict(topology={"gpus_per_node": -2}), "topology.gpus_per_node", "positive"),
    (scenario_dict(bench={"iters": 0}), "bench.iters", "positive"),
    (scenario_dict(bench={"sms": [8, 0]}), "bench.sms", "positive"),
    (scenario_dict(model={"hidden": 100}), "model.hidden", "multiple of 8"),
    (scenario_dict(model={"hidden": 1000, "dispatch_dtype": "fp8"}), "model.hidden",
     "multiple of 128"),
    (scenario_dict(model={"dispatch_dtype": "fp16"}), "model.dispatch_dtype", "one of"),
    (scenario_dict(routing={"kind": "random"}), "routing.kind", "one of"),
    (scenario_dict(routing={"kind": "hot", "hot_fraction": 0.5, "hot_multiplier": 2.0}),
     "routing.hot_multiplier", "below 1"),
    (scenario_dict(routing={"hot_fraction": 1.0}), "routing.hot_fraction", "between 0 and 1"),
    (scenario_dict(bench={"device": "tpu"}), "bench.device", "one of"),
])
def test_bad_scenarios_name_the_file_key_and_rule(data, key, rule):
    msg = parse_error(data)
    assert f"s.yaml: {key}:" in msg
    assert rule in msg


def test_rule_messages_show_the_value():
    assert "got 100" in parse_error(scenario_dict(model={"hidden": 100}))


def test_fp8_needs_128_but_bf16_accepts_any_multiple_of_8():
    assert scenario.parse(scenario_dict(model={"hidden": 1000})).model.hidden == 1000
    assert scenario.parse(scenario_dict(model={"hidden": 1024, "dispatch_dtype": "fp8"})) \
        .model.dispatch_dtype == "fp8"


def test_topk_equal_to_all_experts_is_allowed():
    assert scenario.parse(scenario_dict(model={"topk": 16})).model.topk == 16


def test_load_malformed_yaml_names_the_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  hidden: [256,\n")
    with pytest.raises(UserError) as e:
        scenario.load(p)
    assert str(e.value).startswith(f"{p}: malformed YAML")
    assert "line" in str(e.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such scenario file"):
        scenario.load(tmp_path / "nope.yaml")


def test_load_a_list_is_not_a_scenario(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must be a mapping"):
        scenario.load(p)


def test_with_world_keeps_the_shape_on_fewer_ranks():
    s = scenario.parse(scenario_dict(topology={"nodes": 2, "gpus_per_node": 4}))
    two = s.with_world(2)
    assert two.world == 2 and two.topology.nodes == 1 and two.num_experts == 8
    assert two.model == s.model
    assert s.with_world(8) is s


def test_with_world_rejects_too_few_experts_and_nonpositive():
    s = scenario.parse(scenario_dict(model={"topk": 8, "experts_per_rank": 2}))
    with pytest.raises(UserError, match="--nproc 3"):
        s.with_world(3)
    assert s.with_world(4).world == 4
    with pytest.raises(UserError, match="--nproc"):
        s.with_world(0)


def test_check_fits():
    s = scenario.parse(scenario_dict(), "four.yaml")
    scenario.check_fits(s, 4, "this host")
    with pytest.raises(UserError) as e:
        scenario.check_fits(s, 2, "this host")
    assert str(e.value).startswith("four.yaml: topology:")
    assert "needs 4" in str(e.value)


def test_maybe_int_list():
    assert scenario.maybe_int_list(None, "--sms") is None
    assert scenario.maybe_int_list("4,8, 16", "--sms") == (4, 8, 16)
    for bad in ("a,b", "0", "4,-8", "", ","):
        with pytest.raises(UserError, match="^--sms: "):
            scenario.maybe_int_list(bad, "--sms")


def test_shown_is_bounded_for_any_value():
    shared = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9  # 9^9 leaves, all shared: a full repr would never finish
    for value in (shared, "x" * 10_000_000, "a\nb\0c", 10**4000, {i: i for i in range(10**5)}):
        text = scenario.shown(value)
        assert len(text) <= 80 and text.isprintable()


def test_check_fits_compares_memory_per_rank():
    s = scenario.parse(scenario_dict(), "four.yaml")
    need = scenario.min_bytes_per_rank(s)
    assert need == 16 * 512 * 2 + 4 * 16 * 512  # own tokens in and out, every rank's tokens received
    scenario.check_fits(s, 4, "this host", need)
    with pytest.raises(UserError, match=r"^four.yaml: model: needs at least .* GiB per rank"):
        scenario.check_fits(s, 4, "this host", need - 1)
    with pytest.raises(UserError, match="tokens_per_rank 1024"):
        scenario.check_fits(s, 4, "this host", need * 10, tokens_per_rank=1024)
    ll = scenario.parse(scenario_dict(mode="low_latency"), "ll.yaml")
    assert scenario.min_bytes_per_rank(ll) == 16 * 512 * 2 + 4 * 4 * 16 * 512  # padded per expert


def test_a_name_from_an_odd_file_name_is_made_a_token():
    s = scenario.parse(scenario_dict(), "/tmp/my scenario (v2).yaml")
    assert s.name == "my_scenario__v2_"
    assert scenario.parse(scenario_dict(), "/tmp/.hidden.yaml").name == "hidden"


def test_load_limits_are_checked_on_the_composed_tree(tmp_path):
    p = tmp_path / "aliases.yaml"
    # a chain of anchors, each a list of the one before: deep only through aliases
    p.write_text("".join(f"a{i}: &a{i} [*a{i - 1}]\n" if i else "a0: &a0 [1]\n" for i in range(40)))
    with pytest.raises(UserError, match="nested more than 32 levels deep"):
        scenario.load(p)
    p.write_text("a: &a [1, 2]\nb: [*a, *a, *a]\n")  # shared, small: it is the unknown key that stops it
    with pytest.raises(UserError, match="a: unknown key"):
        scenario.load(p)


# -- input holes (issue 35, item 6) ------------------------------------------------------------

def test_a_key_written_twice_is_refused_with_both_lines(tmp_path):
    p = tmp_path / "twice.yaml"
    p.write_text("model:\n  hidden: 256\n  tokens_per_rank: 16\n  topk: 4\n  experts_per_rank: 4\n"
                 "  topk: 2\ntopology: {nodes: 1, gpus_per_node: 4}\n")
    with pytest.raises(UserError, match=r"twice.yaml: key topk appears twice in one mapping \(lines 4 and 6\)"):
        scenario.load(p)


def test_a_merge_key_may_still_be_overridden():
    import yaml

    data = yaml.load("a: &a {x: 1, y: 2}\nb: {<<: *a, x: 3}\n", Loader=scenario._Loader)
    assert data["b"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("text, value", [("1e3", 1000.0), ("1.0e308", 1e308), ("-2E-3", -0.002),
                                         ("4.5e+2", 450.0), (".5e1", 5.0), ("1.5", 1.5)])
def test_yaml_1_2_floats_are_floats(text, value):
    import yaml

    assert yaml.load(f"v: {text}", Loader=scenario._Loader) == {"v": value}
    assert yaml.safe_load("v: 1e3") == {"v": "1e3"}  # PyYAML's own loader is left as it was


def test_a_float_with_an_exponent_is_a_number_where_a_number_belongs(write_scenario):
    text = ("model: {hidden: 256, tokens_per_rank: 16, topk: 4, experts_per_rank: 4}\n"
            "topology: {nodes: 1, gpus_per_node: 4, nvlink_gbps: 4.5e2}\nbench: {timeout_s: 1e1}\n")
    s = scenario.load(write_scenario("exp", text))
    assert s.topology.nvlink_gbps == 450.0 and s.bench.timeout_s == 10.0
    with pytest.raises(UserError, match="bench.timeout_s: must be positive and at most 3600 seconds, got 1e"):
        scenario.load(write_scenario("huge", text.replace("1e1", "1.0e308")))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    import os

    fifo = tmp_path / "s.yaml"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"s.yaml: not a regular file \(a FIFO\)"):
        scenario.load(fifo)
    with pytest.raises(UserError, match=r"not a regular file \(a character device\)"):
        scenario.load("/dev/null")


def test_a_value_listed_twice_is_refused():
    with pytest.raises(UserError, match="--sms: 8 is listed twice"):
        scenario.maybe_int_list("8,16,8", "--sms")
    with pytest.raises(UserError, match="bench.sms: 4 is listed twice"):
        scenario.parse(scenario_dict(bench={"sms": [4, 4]}))


def test_every_nproc_in_readme_fits_its_scenario():
    """A README command must work on some host: `run X --nproc N` needs top-k <= N x experts_per_rank."""
    import re
    import shlex

    from support import REPO

    readme = (REPO / "README.md").read_text()
    found = 0
    for line in readme.splitlines():
        args = shlex.split(line.split("#")[0]) if line.startswith("epbench ") else []
        if "--nproc" in args and any(a.startswith("scenarios/") for a in args):
            path = next(a for a in args if a.startswith("scenarios/"))
            scenario.load(REPO / path).with_world(int(args[args.index("--nproc") + 1]))
            found += 1
    assert found, "README shows --nproc nowhere"
    assert not re.search(r"h200x4\.yaml --nproc 2", readme)
