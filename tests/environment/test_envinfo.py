"""kvfid.environment.envinfo against a fake NVML (full, sparse, no driver) and on this real machine."""

import importlib.util
import inspect
import json
import shutil
import subprocess

import pynvml
import pytest
import torch

import fake_nvml  # tests/ is on sys.path under pytest's default (rootdir-less) import mode
from fake_nvml import H200, FakeNVML, full_gpu, no_driver, sparse_gpu
from kvfid.environment import envinfo
from kvfid.environment.envinfo import collect, describe, environment_key


@pytest.fixture(autouse=True)
def _no_visible_devices_filter(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# --- the fake is faithful to pynvml -------------------------------------------------------------

def test_fake_only_offers_functions_and_errors_that_pynvml_has():
    for name, member in inspect.getmembers(FakeNVML):
        if name.startswith("nvml"):
            assert callable(getattr(pynvml, name, None)), f"pynvml has no {name}"
        if name.startswith("NVMLError_"):
            real = getattr(pynvml, name)
            assert issubclass(real, pynvml.NVMLError) and issubclass(member, fake_nvml.NVMLError)
            assert real().value == member.value, name
        if name.startswith("NVML_"):
            assert getattr(pynvml, name) == member, name


# --- a GPU that answers everything --------------------------------------------------------------

def test_full_gpu_record():
    nvml = full_gpu()
    record = collect(nvml)
    assert record["nvml_error"] is None
    (gpu,) = record["gpus"]
    assert gpu == {
        "index": 0, "name": "NVIDIA H200", "uuid": H200["uuid"], "compute_capability": "9.0",
        "driver_version": "570.86.15", "cuda_driver_version": "12.8",
        "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980,
        "memory_clock_mhz": 3201, "memory_clock_max_mhz": 3201,
        "power_limit_w": 700.0, "temperature_c": 31,
        "ecc_mode": True, "mig_mode": False, "persistence_mode": True,
        "pcie_gen": 5, "pcie_width": 16, "pcie_gen_max": 5, "pcie_width_max": 16,
    }
    assert nvml.initialized == 0  # every nvmlInit was matched by nvmlShutdown
    json.dumps(record)  # the record is plain data


def test_full_gpu_key_and_description():
    record = collect(full_gpu())
    device, driver, cuda, torch_version, triton_version = environment_key(record).split("/")
    assert (device, driver) == ("NVIDIA-H200", "570.86.15")
    assert cuda == (torch.version.cuda or "none")
    assert torch_version == envinfo._folder_name(torch.__version__)
    text = describe(record)
    assert "GPU 0: NVIDIA H200" in text and "ECC on, MIG off, persistence on" in text
    assert "power limit 700 W" in text and "PCIe gen 5 x16" in text


def test_cuda_visible_devices_selects_and_orders_gpus(monkeypatch):
    second = dict(H200, uuid="GPU-ffff0000-0000-0000-0000-000000000000", name="NVIDIA H100")
    nvml = FakeNVML([H200, second])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert [g["index"] for g in collect(nvml)["gpus"]] == [1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    assert [g["name"] for g in collect(nvml)["gpus"]] == ["NVIDIA H100"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # the usual way to hide every GPU
    assert collect(nvml)["gpus"] == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,7,1")  # CUDA stops at the first bad entry
    assert [g["index"] for g in collect(nvml)["gpus"]] == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")  # cannot map: keep every device
    assert len(collect(nvml)["gpus"]) == 2


# --- a GPU with unsupported fields --------------------------------------------------------------

def test_unsupported_fields_are_none():
    nvml = sparse_gpu()
    (gpu,) = collect(nvml)["gpus"]
    assert (gpu["name"], gpu["compute_capability"]) == ("NVIDIA GeForce RTX 4090", "8.9")
    unsupported = set(gpu) - {"index", "name", "uuid", "compute_capability",
                              "driver_version", "cuda_driver_version"}
    assert unsupported and all(gpu[field] is None for field in unsupported)
    assert nvml.initialized == 0
    assert "ECC n/a, MIG n/a" in describe(collect(nvml))


def test_missing_system_fields_and_missing_functions_are_none():
    nvml = FakeNVML([H200], driver_version=None, cuda_driver_version=None)
    nvml.nvmlDeviceGetCudaComputeCapability = None  # deprecated in NVML; may vanish from pynvml
    (gpu,) = collect(nvml)["gpus"]
    assert gpu["driver_version"] is None and gpu["cuda_driver_version"] is None
    assert gpu["compute_capability"] is None and gpu["name"] == "NVIDIA H200"
    assert environment_key(collect(nvml)).split("/")[:2] == ["NVIDIA-H200", "none"]


def test_bytes_from_old_pynvml_are_decoded():
    nvml = FakeNVML([dict(H200, name=b"NVIDIA H200")], driver_version=b"535.104.05")
    (gpu,) = collect(nvml)["gpus"]
    assert (gpu["name"], gpu["driver_version"]) == ("NVIDIA H200", "535.104.05")


# --- no driver, no library ----------------------------------------------------------------------

def test_no_driver_is_a_normal_cpu_environment():
    record = collect(no_driver())
    assert record["gpus"] == []
    assert "NVMLError_DriverNotLoaded" in record["nvml_error"]
    assert environment_key(record).startswith("cpu")
    assert "GPU: none" in describe(record)


def test_no_library():
    record = collect(FakeNVML(init_error=fake_nvml.NVMLError_LibraryNotFound))
    assert record["gpus"] == [] and "LibraryNotFound" in record["nvml_error"]


# --- the key ------------------------------------------------------------------------------------

def _record(gpu_name=None, driver=None, cpu_model=None, cuda=None, torch_version=None, triton=None,
            capability=None):
    gpus = [{"name": gpu_name, "driver_version": driver}] if gpu_name else []
    return {"gpus": gpus, "cpu": {"model": cpu_model, "capability": capability},
            "versions": {"cuda_runtime": cuda, "torch": torch_version, "triton": triton}}


def test_environment_key_examples():
    gpu = _record("NVIDIA H200", "570.86.15", "AMD EPYC 7B13", "12.8", "2.11.0", "3.6.0")
    assert environment_key(gpu) == "NVIDIA-H200/570.86.15/12.8/2.11.0/3.6.0"
    cpu = _record(cpu_model="AMD EPYC 7B13", torch_version="2.13.0+cpu", triton="3.9.0")
    assert environment_key(cpu) == "cpu-AMD-EPYC-7B13/none/none/2.13.0+cpu/3.9.0"


def test_cpus_that_differ_only_in_capability_get_two_keys():
    """One model name, two code paths torch dispatches to: their numerics differ, so do the keys."""
    avx2, avx512 = (_record(cpu_model="AMD EPYC", torch_version="2.13.0+cpu", triton="3.9.0",
                            capability=c) for c in ("AVX2", "AVX512"))
    assert environment_key(avx2) == "cpu-AMD-EPYC-avx2/none/none/2.13.0+cpu/3.9.0"
    assert environment_key(avx512) == "cpu-AMD-EPYC-avx512/none/none/2.13.0+cpu/3.9.0"


def test_the_record_names_what_decides_cpu_numerics(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    record = collect(no_driver())
    cpu = record["cpu"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(cpu) >= {"model", "vendor", "capability", "flags", "blas", "mkl", "onednn", "torch_threads"}
    assert cpu["flags"] is None or set(cpu["flags"]) >= {"amx_bf16", "avx512_bf16", "avx512_fp16"}
    assert record["numerics_env"]["MKL_CBWR"] == "COMPATIBLE"
    assert record["numerics_env"]["OMP_NUM_THREADS"] is None
    text = describe(record)
    assert f"capability {cpu['capability']}" in text and "MKL_CBWR=COMPATIBLE" in text
    assert (cpu["capability"] or "").lower() in environment_key(record)


def test_environment_key_parts_are_safe_folder_names():
    key = environment_key(_record(cpu_model="Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz",
                                  torch_version="2.13.0+cpu"))
    assert key == "cpu-Intel-Xeon-Platinum-8480+-CPU-2.00GHz/none/none/2.13.0+cpu/none"
    weird = environment_key(_record("../a/b c", "x y", cuda="", torch_version="..", triton=" "))
    parts = weird.split("/")
    assert len(parts) == 5 and all(p and p not in (".", "..") and " " not in p for p in parts)
    assert parts == ["a-b-c", "x-y", "none", "none", "none"]
    assert environment_key(_record()) == "cpu/none/none/none/none"


# --- this real machine --------------------------------------------------------------------------

def test_collect_on_this_machine():
    record = collect()
    json.dumps(record)
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_nvml = True
    except pynvml.NVMLError:
        has_nvml = False
    if has_nvml:
        assert record["gpus"] and record["gpus"][0]["name"]
    else:
        assert record["gpus"] == [] and record["nvml_error"]
    versions = record["versions"]
    assert versions["torch"] == torch.__version__ and versions["cuda_runtime"] == torch.version.cuda
    assert versions["python"] and versions["numpy"] and versions["transformers"]
    assert record["cpu"]["cpu_count"] >= 1 and record["cpu"]["torch_threads"] >= 1
    assert record["git"] is None or len(record["git"]["revision"]) == 40
    assert environment_key(record).count("/") == 4
    assert describe(record).splitlines()[-1] == f"key {environment_key(record)}"


def test_envinfo_does_not_import_triton_at_module_import():
    source = inspect.getsource(envinfo)
    module_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not any("triton" in line for line in module_level)


# --- git revision -------------------------------------------------------------------------------

def _envinfo_copy_in(folder):
    """Load a copy of envinfo placed at folder/harness/environment/envinfo.py, so its git view is folder's."""
    (folder / "harness" / "environment").mkdir(parents=True)
    target = folder / "harness" / "environment" / "envinfo.py"
    shutil.copy(envinfo.__file__, target)
    spec = importlib.util.spec_from_file_location("envinfo_copy", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_revision_and_dirty_flag(tmp_path):
    module = _envinfo_copy_in(tmp_path)
    assert module._git_revision() is None  # not a checkout
    _git(tmp_path, "init", "-q")
    assert module._git_revision() is None  # a checkout without commits has no revision
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "c")
    git = module._git_revision()
    assert len(git["revision"]) == 40 and git["dirty"] is False
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "new.md").write_text("x")
    assert module._git_revision()["dirty"] is False  # rendered output is not code
    (tmp_path / "harness" / "new.py").write_text("x = 1\n")
    assert module._git_revision()["dirty"] is True  # a new module changes what runs
    (tmp_path / "harness" / "new.py").unlink()
    with open(tmp_path / "harness" / "environment" / "envinfo.py", "a") as f:
        f.write("# edited\n")
    assert module._git_revision()["dirty"] is True


def test_the_whole_call_lines_count_bands_and_list_each_span_that_stops_early():
    spans = {"mm [M, 576] x [576, 576] bfloat16 @t1": {"floor": 1, "ceiling": 32, "probed": 33, "tile": 32,
                                                        "why": "one call from 1 to 32 rows, tiles of 32 above"},
             "mm [M, 64] x [64, 64] bfloat16 @t1": {"floor": 2, "ceiling": 256, "probed": 256, "tile": 0,
                                                     "why": "one call, floor 2"},
             "bmm [M, 16] x [16, 4] bfloat16 @t1": {"floor": None, "ceiling": 0, "probed": 128,
                                                     "why": "no floor up to 64 rows"}}
    lines = envinfo.whole_lines(spans)
    assert lines[0] == ("whole calls: 2 of 3 product shapes take one call (floors 1, 2), 1 of them up "
                        "to a band's last count and in its tiles above")
    assert lines[1:] == ["  bmm [M, 16] x [16, 4] bfloat16 @t1: no floor up to 64 rows",
                         "  mm [M, 576] x [576, 576] bfloat16 @t1: one call from 1 to 32 rows, tiles of 32 above"]
