"""The C ABI of libepmoe_c (include/epmoe/c_api.h) through ctypes: its structs, the
library, and the translation of its error codes into Python exceptions."""
import ctypes
import os
from pathlib import Path

_EXPECTED_VERSION = 1

# Error codes (epmoe::StatusCode) -> the Python exception a caller expects.
_ERRORS = {1: ValueError, 2: OSError, 3: NotImplementedError, 4: MemoryError, 5: RuntimeError}

DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float8_e4m3fn": 3, "int32": 4, "int64": 5}
CPU, CUDA = 0, 1


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * 4), ("strides", ctypes.c_int64 * 4)]


class Routing(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_char_p), ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("renormalize", ctypes.c_int32), ("score_func", ctypes.c_char_p), ("n_group", ctypes.c_int32),
                ("topk_group", ctypes.c_int32), ("routed_scaling_factor", ctypes.c_float)]


class Spec(ctypes.Structure):
    _fields_ = [("routing", Routing), ("quant_scheme", ctypes.c_char_p), ("block_n", ctypes.c_int32),
                ("block_k", ctypes.c_int32), ("activation", ctypes.c_char_p),
                ("apply_router_weight_on_input", ctypes.c_int32)]


class MoeTensors(ctypes.Structure):
    _fields_ = [(name, Tensor) for name in ("x", "w13", "w2", "w13_scale", "w2_scale", "input_scale",
                                            "intermediate_scale", "topk_ids", "topk_weights", "expert_map", "out")]


def _library_path():
    override = os.environ.get("EPMOE_C_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).with_name("libepmoe_c.so")


def _load():
    path = _library_path()
    if not path.exists():
        raise ImportError(f"epmoe: the C library is missing at {path} (install with "
                          "'pip install --no-build-isolation ./python', or set EPMOE_C_LIBRARY)")
    library = ctypes.CDLL(str(path))
    library.epmoe_c_api_version.restype = ctypes.c_int
    library.epmoe_last_error.restype = ctypes.c_char_p
    library.epmoe_fused_experts_workspace_bytes.argtypes = [
        ctypes.POINTER(Spec), ctypes.POINTER(MoeTensors), ctypes.POINTER(ctypes.c_size_t)]
    library.epmoe_fused_experts.argtypes = [
        ctypes.POINTER(Spec), ctypes.POINTER(MoeTensors), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    library.epmoe_route.argtypes = [ctypes.POINTER(Routing)] + [ctypes.POINTER(Tensor)] * 4 + [ctypes.c_void_p]
    version = library.epmoe_c_api_version()
    if version != _EXPECTED_VERSION:
        raise ImportError(f"epmoe: {path} has C ABI version {version}, this package expects {_EXPECTED_VERSION}")
    return library


LIB = _load()


def abi_version():
    return LIB.epmoe_c_api_version()


def check(code, function):
    """Raises the exception that matches a C ABI error code, with the library's message."""
    if code != 0:
        message = LIB.epmoe_last_error().decode()
        raise _ERRORS.get(code, RuntimeError)(f"{function}: {message}")
