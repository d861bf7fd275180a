"""deepep_v2_env: V2's private NCCL, named by the build stamp, preloaded into deepep-v2's jobs
only, and the launcher's environment put back after each job."""

import json
import os

from epbench import provenance
from epbench.backends import deepep_v2_env as v2env


def stamp(tmp_path, monkeypatch, **fields):
    path = tmp_path / provenance.BASELINES_STAMP
    path.write_text(json.dumps(fields))
    monkeypatch.setattr(provenance, "baselines_stamp_path", lambda: path)


def private_nccl(tmp_path, shim=True):
    lib = tmp_path / "epbench-nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_text("nccl")
    if shim:
        (tmp_path / "epbench-nccl" / v2env.TORCH_SHIM).mkdir()
    return str(lib)


def test_version_tuple_keeps_the_leading_numbers():
    assert v2env.version_tuple("2.30.4") == (2, 30, 4)
    assert v2env.version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert v2env.version_tuple("2.10.0a0") == (2, 10, 0)
    assert v2env.version_tuple("2.x") == (2,)
    assert v2env.version_tuple("2.28.9") < v2env.MIN_NCCL <= v2env.version_tuple("2.30.4")


def test_preload_puts_the_library_first_and_the_shim_only_where_it_exists(tmp_path):
    lib = private_nccl(tmp_path, shim=False)
    assert v2env.preload_env(lib, {"PYTHONPATH": "/x"}) == {"LD_PRELOAD": lib}
    (tmp_path / "epbench-nccl" / v2env.TORCH_SHIM).mkdir()
    shim = str(tmp_path / "epbench-nccl" / v2env.TORCH_SHIM)
    assert v2env.preload_env(lib, {"LD_PRELOAD": "/y.so"}) == {"LD_PRELOAD": f"{lib} /y.so", "PYTHONPATH": shim}


def test_only_a_v2_stamp_with_a_library_that_exists_is_preloaded(tmp_path, monkeypatch):
    lib = private_nccl(tmp_path)
    stamp(tmp_path, monkeypatch, flavor="v1", nccl={"preload": lib})
    assert v2env.v2_nccl() is None
    stamp(tmp_path, monkeypatch, flavor="v2", nccl={"preload": str(tmp_path / "gone.so")})
    assert v2env.v2_nccl() is None
    stamp(tmp_path, monkeypatch, flavor="v2")
    assert v2env.v2_nccl() is None and v2env.job_env(["deepep-v2"]) == {}
    stamp(tmp_path, monkeypatch, flavor="v2", nccl={"preload": lib, "version": "2.32.3"})
    assert v2env.v2_nccl()["version"] == "2.32.3"


def test_the_job_environment_is_set_for_deepep_v2_and_put_back_after(tmp_path, monkeypatch):
    lib = private_nccl(tmp_path)
    stamp(tmp_path, monkeypatch, flavor="v2", nccl={"preload": lib})
    monkeypatch.setenv("LD_PRELOAD", "/y.so")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with v2env.job_environment(["reference"]) as extra:
        assert extra == {} and os.environ["LD_PRELOAD"] == "/y.so"
    with v2env.job_environment(["reference", "deepep-v2"]) as extra:
        assert os.environ["LD_PRELOAD"] == extra["LD_PRELOAD"] == f"{lib} /y.so"
        assert os.environ["PYTHONPATH"] == str(tmp_path / "epbench-nccl" / v2env.TORCH_SHIM)
    assert os.environ["LD_PRELOAD"] == "/y.so" and "PYTHONPATH" not in os.environ
