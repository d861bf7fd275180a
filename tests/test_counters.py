"""Counter readers against recorded values: a fake NVML (built from nvidia-ml-py's own structs)
and a fake sysfs tree."""

import sys
import types
from pathlib import Path

import pynvml
import pytest

from epbench import counters
from epbench.counters import GpuIdentity, open_counters

GPU_BUS = "00000000:18:00.0"  # NVML spells the domain with 8 digits
GPU = GpuIdentity(pci_bus_id="0000:18:00.0", uuid="3f2a0c1e-0000-1111-2222-333344445555")


class FakeNvml:
    """The parts of pynvml that counters.py calls. ``fields`` maps a field id to a list of
    successive readings in KiB, or to an NVML error code returned for that value."""

    NVML_SUCCESS = 0
    NVMLError = pynvml.NVMLError

    def __init__(self, fields, bus_ids=("00000000:07:00.0", GPU_BUS), old_api=False):
        self.fields = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in fields.items()}
        self.bus_ids = bus_ids
        self.old_api = old_api
        self.calls = []
        self.shutdowns = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=self.bus_ids[h].encode())

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlErrorString(self, ret):
        return {3: "Not Supported"}.get(ret, f"error {ret}")

    def nvmlDeviceGetFieldValues(self, handle, ids):
        if self.old_api and any(isinstance(i, tuple) for i in ids):
            raise TypeError("an integer is required")
        self.calls.append((handle, list(ids)))
        out = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for v, (field, scope) in zip(out, ids):
            v.fieldId, v.scopeId = field, scope
            spec = self.fields.get(field, 2)  # 2 = NVML_ERROR_INVALID_ARGUMENT
            if isinstance(spec, list):
                v.nvmlReturn = 0
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = spec.pop(0) if len(spec) > 1 else spec[0]
            else:
                v.nvmlReturn = spec
        return out


def no_nic(tmp_path):
    return tmp_path / "empty-sys"


def test_nvlink_counters_in_bytes_from_recorded_values(tmp_path):
    # Seen on the 4 x H200 host: 0 KiB before a run, ~84 GB after it on rank 0.
    # open_counters probes the fields once, so the first reading goes to the probe.
    nvml = FakeNvml({138: [0, 0, 84_000_000], 139: [0, 0, 81_000_000]})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c is not None and c.keys == ["nvlink_tx", "nvlink_rx"]
    assert "no InfiniBand NICs" in notes
    before = c.read()
    after = c.read()
    assert set(before) == {"nvlink_tx", "nvlink_rx"}  # no NIC keys: absent, not 0
    assert counters.delta(before, after) == {"nvlink_tx": 84_000_000 * 1024,
                                             "nvlink_rx": 81_000_000 * 1024}
    # The GPU matched by PCI bus id (index 1 in NVML), every field scoped to all links.
    handle, ids = nvml.calls[-1]
    assert handle == 1
    assert ids == [(138, 0xFFFFFFFF), (139, 0xFFFFFFFF)]


def test_raw_counters_and_link_capacity(tmp_path):
    # H200: 18 active links at 26562 MB/s each -> 478 GB/s per direction
    nvml = FakeNvml({138: [1], 139: [2], 140: [3], 141: [4], 91: [18], 165: [1], 164: [26562]})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c.read() == {"nvlink_tx": 1024, "nvlink_rx": 2048, "nvlink_raw_tx": 3072,
                        "nvlink_raw_rx": 4096}
    assert abs(c.link_capacity_gbps - 478.116) < 1e-9
    assert not [n for n in notes if "capacity" in n or "not supported" in n]
    # every link asked by its own scope id, state and speed
    (asked,) = [ids for _, ids in nvml.calls if ids[0] == (165, 0)]
    assert asked[:4] == [(165, 0), (164, 0), (165, 1), (164, 1)] and len(asked) == 36


def test_link_count_unsupported_asks_the_most_links(tmp_path):
    nvml = FakeNvml({138: [1], 139: [2], 91: 3, 165: [1], 164: [26562]})
    c, _ = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert abs(c.link_capacity_gbps - 18 * 26.562) < 1e-9


def test_no_link_capacity_is_noted_not_guessed(tmp_path):
    nvml = FakeNvml({138: [1], 139: [2], 91: [18], 165: [0], 164: [26562]})  # no link active
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c.link_capacity_gbps is None
    assert any("link capacity unknown (18 links asked: no active link)" in n for n in notes)
    assert any("field 140 (nvlink_raw_tx) not supported" in n for n in notes)
    nvml = FakeNvml({138: [1], 139: [2], 91: [18], 165: [1], 164: 3})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c.link_capacity_gbps is None and any("Not Supported" in n and "capacity" in n for n in notes)


def test_match_by_uuid_when_no_bus_id(tmp_path):
    nvml = FakeNvml({138: [5], 139: [6]})
    c, _ = open_counters(0, nvml=nvml, identity=GpuIdentity(uuid="1"), sysfs=no_nic(tmp_path))
    assert c.read() == {"nvlink_tx": 5 * 1024, "nvlink_rx": 6 * 1024}
    assert nvml.calls[-1][0] == 1


def test_unmatched_gpu_has_no_nvlink_counters(tmp_path):
    nvml = FakeNvml({138: [5], 139: [6]})
    c, notes = open_counters(0, nvml=nvml, identity=GpuIdentity("0000:99:00.0"),
                             sysfs=no_nic(tmp_path))
    assert c is None
    assert any("no NVML device matches" in n for n in notes)


def test_not_supported_field_is_absent_and_noted(tmp_path):
    nvml = FakeNvml({138: 3, 139: [7]})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c.read() == {"nvlink_rx": 7 * 1024}
    assert any("field 138" in n and "not supported" in n and "Not Supported" in n for n in notes)


def test_every_field_unsupported_means_no_counters(tmp_path):
    nvml = FakeNvml({138: 3, 139: 3, 140: 3, 141: 3})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c is None
    assert sum("not supported" in n for n in notes) == 4
    assert nvml.shutdowns == 1


def test_old_nvml_binding_is_not_misread(tmp_path):
    # Plain ids would read link 0 only; reporting that as the GPU's traffic would be wrong.
    nvml = FakeNvml({138: [1], 139: [1]}, old_api=True)
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    assert c is None
    assert any("scope id" in n for n in notes)


def test_field_error_at_read_time_drops_the_key(tmp_path):
    nvml = FakeNvml({138: [1, 2], 139: [1]})
    c, _ = open_counters(0, nvml=nvml, identity=GPU, sysfs=no_nic(tmp_path))
    nvml.fields[139] = 3
    assert c.read() == {"nvlink_tx": 2 * 1024}


def test_no_nvml_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    c, notes = open_counters(0, identity=GPU, sysfs=no_nic(tmp_path))
    assert c is None
    assert any(n.startswith("no NVML") for n in notes)
    assert "no InfiniBand NICs" in notes


def test_nvml_without_driver(monkeypatch, tmp_path):
    fake = types.ModuleType("pynvml")

    def init():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    c, notes = open_counters(0, identity=GPU, sysfs=no_nic(tmp_path))
    assert c is None and notes[0].startswith("no NVML:")


@pytest.mark.parametrize("text, norm", [
    ("00000000:18:00.0", "0000:18:00.0"), ("0000:1A:00.0", "0000:1a:00.0"),
    ("18:00.0", "0000:18:00.0"), ("0001:c1:1f.3", "0001:c1:1f.3"),
])
def test_normalize_bus_id(text, norm):
    assert counters.normalize_bus_id(text) == norm


# -- InfiniBand ---------------------------------------------------------------------------

def make_pci(root: Path, path: str, numa: int) -> Path:
    d = root / "devices" / path
    d.mkdir(parents=True)
    (d / "numa_node").write_text(f"{numa}\n")
    bus = path.split("/")[-1]
    link = root / "bus/pci/devices" / bus
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(d)
    return d


def make_nic(root: Path, name: str, pci_dir: Path, ports=(("1", 100, 200),)) -> None:
    dev = root / "class/infiniband" / name
    dev.mkdir(parents=True)
    (dev / "device").symlink_to(pci_dir)
    for port, xmit, rcv in ports:
        c = dev / "ports" / port / "counters"
        c.mkdir(parents=True)
        (c / "port_xmit_data").write_text(f"{xmit}\n")
        (c / "port_rcv_data").write_text(f"{rcv}\n")
        (dev / "ports" / port / "rate").write_text("400 Gb/sec (4X NDR)\n")


@pytest.fixture
def sysfs(tmp_path):
    """Two root complexes: GPU 18:00.0 shares a switch with mlx5_0 and a root complex with
    mlx5_1; mlx5_2 sits on the other root complex and NUMA node."""
    root = tmp_path / "sys"
    make_pci(root, "pci0000:17/0000:17:01.0/0000:18:00.0", 0)
    nic0 = make_pci(root, "pci0000:17/0000:17:01.0/0000:19:00.0", 0)
    nic1 = make_pci(root, "pci0000:17/0000:17:02.0/0000:1a:00.0", 0)
    nic2 = make_pci(root, "pci0000:97/0000:97:01.0/0000:98:00.0", 1)
    make_nic(root, "mlx5_0", nic0, ports=(("1", 1000, 2000), ("2", 10, 20)))
    make_nic(root, "mlx5_1", nic1)
    make_nic(root, "mlx5_2", nic2)
    return root


def test_nearest_nic_prefers_the_same_switch(sysfs):
    assert counters.nearest_nic("0000:18:00.0", sysfs) == ("mlx5_0", "same PCI root")
    name, why = counters.nearest_nic("0000:55:00.0", sysfs)  # not in this sysfs
    assert name is None and "not found" in why


def test_nic_counters_in_bytes_summed_over_ports(sysfs):
    nvml = FakeNvml({138: 3, 139: 3})
    c, notes = open_counters(0, nvml=nvml, identity=GPU, sysfs=sysfs)
    assert c is not None and c.keys == ["nic_tx", "nic_rx"]
    assert c.read() == {"nic_tx": (1000 + 10) * 4, "nic_rx": (2000 + 20) * 4}
    port = sysfs / "class/infiniband/mlx5_0/ports/1/counters/port_xmit_data"
    port.write_text("1250\n")
    assert c.read()["nic_tx"] == (1250 + 10) * 4


def test_nic_by_numa_node_when_no_shared_root(tmp_path):
    root = tmp_path / "sys"
    make_pci(root, "pci0000:17/0000:17:01.0/0000:18:00.0", 1)
    make_nic(root, "mlx5_0", make_pci(root, "pci0000:30/0000:30:01.0/0000:31:00.0", 0))
    make_nic(root, "mlx5_1", make_pci(root, "pci0000:40/0000:40:01.0/0000:41:00.0", 1))
    assert counters.nearest_nic("0000:18:00.0", root) == ("mlx5_1", "same NUMA node")


def test_far_nic_is_not_near(tmp_path):
    root = tmp_path / "sys"
    make_pci(root, "pci0000:17/0000:17:01.0/0000:18:00.0", 0)
    make_nic(root, "mlx5_0", make_pci(root, "pci0000:30/0000:30:01.0/0000:31:00.0", 1))
    name, why = counters.nearest_nic("0000:18:00.0", root)
    assert name is None and "mlx5_0" in why


def test_unreadable_nic_counter_is_absent(sysfs):
    nvml = FakeNvml({138: [1], 139: [1]})
    c, _ = open_counters(0, nvml=nvml, identity=GPU, sysfs=sysfs)
    (sysfs / "class/infiniband/mlx5_0/ports/2/counters/port_rcv_data").write_text("garbage\n")
    got = c.read()
    assert "nic_rx" not in got and got["nic_tx"] == 1010 * 4 and got["nvlink_tx"] == 1024


# -- arithmetic ---------------------------------------------------------------------------

def test_delta_drops_missing_and_backwards_counters():
    assert counters.delta({"a": 5, "b": 9, "c": 1}, {"a": 8, "b": 3}) == {"a": 3}


def test_measured_busbw_and_disagreement():
    # 10 iterations of 400 us that moved 1 GB in all: 100 MB per 400 us = 250 GB/s.
    assert counters.measured_busbw_gbps(10**9, 10, 400.0) == pytest.approx(250.0)
    assert counters.measured_busbw_gbps(None, 10, 400.0) is None
    assert counters.measured_busbw_gbps(10**9, 10, None) is None
    assert counters.disagrees(250.0, 240.0) is False
    assert counters.disagrees(280.0, 240.0) is True
    assert counters.disagrees(None, 240.0) is None
