"""A stand-in for the pynvml module, so kvfid.environment.envinfo can be tested without a GPU.

`FakeNVML` exposes the pynvml functions envinfo calls, with the same return shapes (strings,
integer milliwatts, integer CUDA versions like 12080, [current, pending] mode pairs) and the same
error hierarchy (NVMLError with NVMLError_* subclasses carrying `.value`). A device is a dict of
field values; a field it lacks raises NVMLError_NotSupported, as the real library does for a
query the device does not support (a system version set to None does the same). `init_error`
makes nvmlInit fail, as on a machine without the library or the driver. The three presets
model the cases envinfo must handle.
"""

from __future__ import annotations


class NVMLError(Exception):
    value = 999  # NVML_ERROR_UNKNOWN

    def __str__(self):
        return type(self).__name__


class NVMLError_Uninitialized(NVMLError):
    value = 1


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


H200 = {
    "name": "NVIDIA H200",
    "uuid": "GPU-8d3c1f6e-0b57-4a21-9c1e-5f0a2b7d9e11",
    "capability": (9, 0),
    "clock_sm": 1980, "clock_mem": 3201, "max_clock_sm": 1980, "max_clock_mem": 3201,
    "power_limit_mw": 700000,
    "temperature": 31,
    "ecc": [1, 1],
    "mig": [0, 0],
    "persistence": 1,
    "pcie_gen": 5, "pcie_width": 16, "pcie_gen_max": 5, "pcie_width_max": 16,
}

# A consumer card through a restricted driver: identity is known, the rest is not supported.
SPARSE_GPU = {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-00000000-1111-2222-3333-444444444444",
              "capability": (8, 9)}


class FakeNVML:
    """A pynvml-like object over a list of device dicts (see module docstring)."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices=(), driver_version="570.86.15", cuda_driver_version=12080,
                 init_error: type[NVMLError] | None = None):
        self.devices = [dict(d) for d in devices]
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.init_error = init_error
        self.initialized = 0  # nvmlInit calls minus nvmlShutdown calls

    # lifecycle and system
    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error()
        self.initialized += 1

    def nvmlShutdown(self):
        self._check_init()
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self):
        return self._system(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self):
        return self._system(self.cuda_driver_version)

    def nvmlDeviceGetCount(self):
        self._check_init()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check_init()
        if not 0 <= index < len(self.devices):
            raise NVMLError()
        return index  # the handle is the index; real handles are opaque pointers

    # per-device fields
    def nvmlDeviceGetName(self, handle):
        return self._field(handle, "name")

    def nvmlDeviceGetUUID(self, handle):
        return self._field(handle, "uuid")

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._field(handle, "capability")

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return self._field(handle, {1: "clock_sm", 2: "clock_mem"}[clock])

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return self._field(handle, {1: "max_clock_sm", 2: "max_clock_mem"}[clock])

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._field(handle, "power_limit_mw")

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._field(handle, "temperature")

    def nvmlDeviceGetEccMode(self, handle):
        return self._field(handle, "ecc")

    def nvmlDeviceGetMigMode(self, handle):
        return self._field(handle, "mig")

    def nvmlDeviceGetPersistenceMode(self, handle):
        return self._field(handle, "persistence")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self._field(handle, "pcie_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._field(handle, "pcie_width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self._field(handle, "pcie_gen_max")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._field(handle, "pcie_width_max")

    def _check_init(self):
        if self.initialized <= 0:
            raise NVMLError_Uninitialized()

    def _system(self, value):
        self._check_init()
        if value is None:
            raise NVMLError_NotSupported()
        return value

    def _field(self, handle, key):
        self._check_init()
        device = self.devices[handle]
        if key not in device:
            raise NVMLError_NotSupported()
        return device[key]


def full_gpu() -> FakeNVML:
    """One H200 answering every query."""
    return FakeNVML([H200])


def sparse_gpu() -> FakeNVML:
    """One GPU that answers name, UUID and capability only; everything else is NotSupported."""
    return FakeNVML([SPARSE_GPU])


def no_driver() -> FakeNVML:
    """NVML present but no driver: nvmlInit raises NVMLError_DriverNotLoaded."""
    return FakeNVML(init_error=NVMLError_DriverNotLoaded)
