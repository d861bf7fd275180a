"""Hardware traffic counters of the GPU a rank runs on: what actually left the GPU.

Two tiers, each optional:

NVLink (NVML)
    ``nvmlDeviceGetFieldValues`` with ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX`` / ``_RX``
    (field ids 138 / 139) and scope id ``0xFFFFFFFF``: cumulative payload KiB summed over all
    links of the GPU, which is what epbench's computed bus bytes count. The ``RAW`` fields
    140 / 141 count the same traffic with the protocol's overhead (packet headers, read
    requests, flow control): what the links actually carried, to hold against their raw
    capacity, the sum of the active links' rates (field 91 ``NVLINK_LINK_COUNT``, then per
    link 165 ``NVLINK_GET_STATE`` and 164 ``NVLINK_GET_SPEED``, MB/s per direction). The
    counters belong to the GPU, not to the process: anything else using the GPU's links at the
    same time is counted too.

InfiniBand / RoCE (sysfs)
    ``/sys/class/infiniband/<dev>/ports/<port>/counters/port_xmit_data`` and ``port_rcv_data``,
    cumulative, in units of 4 bytes, summed over the ports of the NIC nearest the GPU.

The NIC nearest the GPU is chosen by PCI placement: the NIC whose sysfs device path shares the
longest prefix with the GPU's (same PCIe switch beats same root port beats same root complex);
ties, and NICs that share nothing but the root of the tree, are decided by the NUMA node
(``/sys/bus/pci/devices/<bus id>/numa_node``) and then by name. A NIC on another root complex
and another NUMA node is not "near": the GPU then has no NIC tier.

``Counters.read()`` returns cumulative bytes under the keys ``nvlink_tx``, ``nvlink_rx``,
``nvlink_raw_tx``, ``nvlink_raw_rx``, ``nic_tx``, ``nic_rx``; a counter that cannot be read is
absent from the dict, never 0.
Take differences with ``delta`` around a block of work that has been synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

NVLINK_TX_FIELD = 138  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
NVLINK_RX_FIELD = 139  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB
NVLINK_RAW_TX_FIELD = 140  # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX: payload + protocol, KiB
NVLINK_RAW_RX_FIELD = 141  # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX
NVLINK_LINK_COUNT_FIELD = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT
NVLINK_SPEED_FIELD = 164  # NVML_FI_DEV_NVLINK_GET_SPEED, scoped by link: MB/s (1e6 B/s) per direction
NVLINK_STATE_FIELD = 165  # NVML_FI_DEV_NVLINK_GET_STATE, scoped by link: 1 = active
NVML_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS: asked when the link count itself is unsupported
ALL_LINKS = 0xFFFFFFFF  # scope id: summed over every link
KIB = 1024
IB_COUNTER_UNIT = 4  # port_xmit_data / port_rcv_data count 4-byte words
SYSFS = Path("/sys")

NVLINK_FIELDS = {"nvlink_tx": NVLINK_TX_FIELD, "nvlink_rx": NVLINK_RX_FIELD,
                 "nvlink_raw_tx": NVLINK_RAW_TX_FIELD, "nvlink_raw_rx": NVLINK_RAW_RX_FIELD}

# nvmlValueType_t -> member of the c_nvmlValue_t union
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                  6: "usVal"}


# -- identifying the GPU -------------------------------------------------------------------

@dataclass(frozen=True)
class GpuIdentity:
    """How a CUDA device is found again in NVML and sysfs."""

    pci_bus_id: Optional[str] = None  # "0000:18:00.0", any case, 4- or 8-digit domain
    uuid: Optional[str] = None  # with or without the "GPU-" prefix


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:18:00.0' / '0000:18:00.0' / '18:00.0' -> '0000:18:00.0' (sysfs spelling)."""
    text = bus_id.strip().lower()
    if text.count(":") == 1:
        text = "0:" + text
    domain, bus, rest = text.split(":")
    device, _, function = rest.partition(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function or '0', 16)}"


def normalize_uuid(uuid: str) -> str:
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def torch_identity(device_index: int) -> GpuIdentity:
    """The PCI bus id and UUID of torch's CUDA device ``device_index``. torch numbers devices
    after CUDA_VISIBLE_DEVICES; the bus id and UUID do not depend on it, so matching on them
    finds the right NVML device whatever the environment renumbers."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    uuid = getattr(props, "uuid", None)
    return GpuIdentity(bus, str(uuid) if uuid is not None else None)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_handle(nvml: Any, ident: GpuIdentity) -> Tuple[Optional[Any], Optional[str]]:
    """(handle, None) for the NVML device with the same PCI bus id (else UUID), or
    (None, why not)."""
    want_bus = normalize_bus_id(ident.pci_bus_id) if ident.pci_bus_id else None
    want_uuid = normalize_uuid(ident.uuid) if ident.uuid else None
    if not want_bus and not want_uuid:
        return None, "cannot identify the CUDA device (no PCI bus id or UUID from torch)"
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            if want_bus and normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(h).busId)) == want_bus:
                return h, None
            if want_uuid and normalize_uuid(_text(nvml.nvmlDeviceGetUUID(h))) == want_uuid:
                return h, None
        except nvml.NVMLError:
            continue
    return None, f"no NVML device matches PCI bus id {ident.pci_bus_id} / UUID {ident.uuid}"


# -- NVLink through NVML -------------------------------------------------------------------

def _field_value(v: Any) -> int:
    member = _VALUE_MEMBERS.get(int(v.valueType), "ullVal")
    return int(getattr(v.value, member))


class NvlinkReader:
    """Reads the NVLink throughput fields that proved readable when it was opened."""

    def __init__(self, nvml: Any, handle: Any, keys: Sequence[str]) -> None:
        self.nvml = nvml
        self.handle = handle
        self.keys = list(keys)

    def read(self) -> Dict[str, int]:
        values, _ = read_nvlink_fields(self.nvml, self.handle, self.keys)
        return values


def read_nvlink_fields(nvml: Any, handle: Any,
                       keys: Sequence[str]) -> Tuple[Dict[str, int], List[str]]:
    """Cumulative bytes for each readable key, and a note for each key that is not."""
    ids = [NVLINK_FIELDS[k] for k in keys]
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, [(f, ALL_LINKS) for f in ids])
    except TypeError:
        # nvidia-ml-py too old to pass scope ids: plain ids would read link 0 alone.
        return {}, ["nvidia-ml-py cannot pass the all-links scope id (too old); no NVLink counters"]
    except nvml.NVMLError as e:
        return {}, [f"nvmlDeviceGetFieldValues failed: {e}"]
    out: Dict[str, int] = {}
    notes: List[str] = []
    for key, field, v in zip(keys, ids, values):
        ret = int(v.nvmlReturn)
        if ret != nvml.NVML_SUCCESS:
            notes.append(f"field {field} ({key}) not supported: {_nvml_error_text(nvml, ret)}")
            continue
        out[key] = _field_value(v) * KIB
    return out, notes


def nvlink_capacity_gbps(nvml: Any, handle: Any) -> Tuple[Optional[float], Optional[str]]:
    """(GB/s the GPU's active links carry per direction, raw, None) or (None, why not): the sum
    over the links that NVML reports active of each one's rate (fields 165 state and 164 speed,
    scoped by link id, as NCCL reads them; the device-wide field 90 is not supported on H200)."""
    def ok(v: Any) -> bool:
        return int(v.nvmlReturn) == nvml.NVML_SUCCESS

    try:
        (count,) = nvml.nvmlDeviceGetFieldValues(handle, [(NVLINK_LINK_COUNT_FIELD, 0)])
        links = _field_value(count) if ok(count) else NVML_MAX_LINKS
        values = nvml.nvmlDeviceGetFieldValues(
            handle, [(f, link) for link in range(links) for f in (NVLINK_STATE_FIELD, NVLINK_SPEED_FIELD)])
    except TypeError:
        return None, "nvidia-ml-py too old for scoped field ids; no link capacity"
    except nvml.NVMLError as e:
        return None, f"link capacity: nvmlDeviceGetFieldValues failed: {e}"
    pairs = list(zip(values[0::2], values[1::2]))
    mbps = [_field_value(speed) for state, speed in pairs
            if ok(state) and ok(speed) and _field_value(state) == 1]
    if not mbps or sum(mbps) <= 0:
        why = next((_nvml_error_text(nvml, int(v.nvmlReturn)) for pair in pairs for v in pair if not ok(v)),
                   "no active link")
        return None, f"link capacity unknown ({len(pairs)} links asked: {why})"
    return sum(mbps) * 1e6 / 1e9, None


def _nvml_error_text(nvml: Any, ret: int) -> str:
    try:
        return _text(nvml.nvmlErrorString(ret))
    except Exception:
        return f"NVML error {ret}"


def _import_nvml() -> Tuple[Optional[Any], Optional[str]]:
    try:
        import pynvml
    except ImportError:
        return None, "no NVML: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver, no GPU
        return None, f"no NVML: {e}"
    return pynvml, None


# -- InfiniBand through sysfs --------------------------------------------------------------

@dataclass(frozen=True)
class IbPort:
    device: str
    port: str
    xmit: Path
    rcv: Path


class NicReader:
    def __init__(self, ports: Sequence[IbPort]) -> None:
        self.ports = list(ports)

    def read(self) -> Dict[str, int]:
        """Sum over the NIC's ports; a tier whose file cannot be read is absent."""
        out: Dict[str, int] = {}
        for key, attr in (("nic_tx", "xmit"), ("nic_rx", "rcv")):
            try:
                out[key] = sum(int(getattr(p, attr).read_text().split()[0]) for p in self.ports) \
                    * IB_COUNTER_UNIT
            except (OSError, ValueError, IndexError):
                continue
        return out


def _numa_node(pci_dir: Path) -> Optional[int]:
    try:
        node = int((pci_dir / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _common_depth(a: Path, b: Path) -> int:
    n = 0
    for x, y in zip(a.parts, b.parts):
        if x != y:
            break
        n += 1
    return n


def ib_ports(sysfs: Path, device: str) -> List[IbPort]:
    ports = []
    for port in sorted((sysfs / "class/infiniband" / device / "ports").glob("*")):
        c = port / "counters"
        if (c / "port_xmit_data").is_file() and (c / "port_rcv_data").is_file():
            ports.append(IbPort(device, port.name, c / "port_xmit_data", c / "port_rcv_data"))
    return ports


def nearest_nic(gpu_bus_id: Optional[str], sysfs: Path = SYSFS) -> Tuple[Optional[str], str]:
    """(NIC device name, how it was chosen) or (None, why there is none); see the module
    docstring for the rule."""
    ib = sysfs / "class/infiniband"
    names = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    names = [n for n in names if ib_ports(sysfs, n)]
    if not names:
        return None, "no InfiniBand NICs"
    if not gpu_bus_id:
        return None, "no NIC tier: the GPU's PCI bus id is unknown"
    gpu_dir = sysfs / "bus/pci/devices" / normalize_bus_id(gpu_bus_id)
    if not gpu_dir.exists():
        return None, f"no NIC tier: {gpu_dir} not found"
    gpu_path = gpu_dir.resolve()
    gpu_numa = _numa_node(gpu_dir)
    # Every device path starts <sysfs>/devices/pci<domain>:<bus>/...: sharing that host
    # bridge component is "same PCI root"; each further shared component is a closer bridge.
    root_depth = _common_depth(gpu_path, (sysfs / "devices").resolve()) + 1
    best: Optional[Tuple[int, int, str]] = None
    for name in names:
        nic_dir = ib / name / "device"
        depth = _common_depth(gpu_path, nic_dir.resolve()) if nic_dir.exists() else 0
        same_root = depth >= root_depth
        same_numa = gpu_numa is not None and _numa_node(nic_dir) == gpu_numa
        if not same_root and not same_numa:
            continue
        key = (depth, int(same_numa), name)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None, f"no InfiniBand NIC on the GPU's PCI root or NUMA node ({', '.join(names)} elsewhere)"
    how = "same PCI root" if best[0] >= root_depth else "same NUMA node"
    return best[2], how


# -- both tiers ----------------------------------------------------------------------------

class Counters:
    """The counters available for one GPU. ``read()`` merges every tier's cumulative bytes."""

    def __init__(self, nvlink: Optional[NvlinkReader], nic: Optional[NicReader],
                 nvml: Any = None, link_capacity_gbps: Optional[float] = None) -> None:
        self.nvlink = nvlink
        self.nic = nic
        self._nvml = nvml
        self.link_capacity_gbps = link_capacity_gbps  # raw, per direction; None: unknown

    @property
    def keys(self) -> List[str]:
        return (self.nvlink.keys if self.nvlink else []) + (["nic_tx", "nic_rx"] if self.nic else [])

    def read(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        if self.nvlink:
            out.update(self.nvlink.read())
        if self.nic:
            out.update(self.nic.read())
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def open_counters(device_index: int, *, nvml: Any = None, identity: Optional[GpuIdentity] = None,
                  sysfs: Path = SYSFS) -> Tuple[Optional[Counters], List[str]]:
    """Counters for torch's CUDA device ``device_index`` and notes on what was skipped and why.
    Returns (None, notes) when no counter at all is readable. ``nvml`` (an initialised pynvml-
    like module), ``identity`` and ``sysfs`` are for tests; by default pynvml, torch and /sys."""
    notes: List[str] = []
    if identity is None:
        try:
            identity = torch_identity(device_index)
        except Exception as e:  # CPU build, no driver
            identity = GpuIdentity()
            notes.append(f"no CUDA device {device_index}: {e}")
    if nvml is None:
        nvml, why = _import_nvml()
        if why:
            notes.append(why)
    nvlink = None
    capacity = None
    if nvml is not None:
        handle, why = nvml_handle(nvml, identity)
        if why:
            notes.append(why)
        if handle is not None:
            values, why_not = read_nvlink_fields(nvml, handle, list(NVLINK_FIELDS))
            notes += why_not
            if values:
                nvlink = NvlinkReader(nvml, handle, list(values))
                capacity, why = nvlink_capacity_gbps(nvml, handle)
                if why:
                    notes.append(why)
    nic_name, how = nearest_nic(identity.pci_bus_id, sysfs)
    nic = None
    if nic_name is None:
        notes.append(how)
    else:
        nic = NicReader(ib_ports(sysfs, nic_name))
        if not nic.read():
            notes.append(f"{nic_name}: port counters unreadable")
            nic = None
    if nvlink is None and nic is None:
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
        return None, notes
    return Counters(nvlink, nic, nvml, capacity), notes


# -- arithmetic on readings ----------------------------------------------------------------

def delta(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
    """Bytes counted between two readings, for the keys read both times. A counter that went
    backwards (reset, wrapped) is dropped rather than reported as a negative or a zero."""
    return {k: after[k] - before[k] for k in before
            if k in after and after[k] >= before[k]}


def measured_busbw_gbps(counted_bytes: Optional[int], iters: int,
                        time_us: Optional[float]) -> Optional[float]:
    """Bus bandwidth from a counter: bytes counted over ``iters`` iterations, divided by the
    iterations and the per-iteration time. None when the counter or the time is missing."""
    if counted_bytes is None or iters <= 0 or time_us is None or not time_us > 0:
        return None
    return counted_bytes / iters / (time_us * 1e-6) / 1e9


def disagrees(measured: Optional[float], computed: Optional[float], tolerance: float = 0.10) -> Optional[bool]:
    """True when measured and computed differ by more than ``tolerance`` of the computed value;
    None when either is missing (nothing to compare)."""
    if measured is None or computed is None:
        return None
    if computed == 0:
        return measured != 0
    return abs(measured - computed) > tolerance * abs(computed)

