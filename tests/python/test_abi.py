"""The C ABI through ctypes alone (no torch): routing on CPU data equals a plain-Python
reference, and the library's errors become Python exceptions that carry its message."""
import ctypes
import math
import random

import pytest

from epmoe import _abi


def c_tensor(array, dtype, shape):
    tensor = _abi.Tensor()
    tensor.data = ctypes.cast(array, ctypes.c_void_p)
    tensor.dtype = _abi.DTYPE_CODES[dtype]
    tensor.device = _abi.CPU
    tensor.rank = len(shape)
    stride = 1
    for d in reversed(range(len(shape))):
        tensor.shape[d] = shape[d]
        tensor.strides[d] = stride
        stride *= shape[d]
    return tensor


def routing(kind, experts, k, renormalize):
    return _abi.Routing(kind.encode(), experts, k, int(renormalize), b"softmax", 1, 1, 1.0)


def test_version_is_the_one_this_package_expects():
    assert _abi.abi_version() == 1


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_route_matches_plain_python(renormalize):
    tokens, experts, k = 5, 16, 4
    rng = random.Random()
    logits = [rng.gauss(0.0, 2.0) for _ in range(tokens * experts)]
    c_logits = (ctypes.c_float * len(logits))(*logits)
    ids = (ctypes.c_int32 * (tokens * k))(*([-7] * tokens * k))
    weights = (ctypes.c_float * (tokens * k))(*([float("nan")] * tokens * k))
    code = _abi.LIB.epmoe_route(routing("softmax_topk", experts, k, renormalize),
                                c_tensor(c_logits, "float32", (tokens, experts)), None,
                                c_tensor(ids, "int32", (tokens, k)), c_tensor(weights, "float32", (tokens, k)), None)
    _abi.check(code, "route")
    for t in range(tokens):
        row = logits[t * experts:(t + 1) * experts]
        top = max(row)
        probabilities = [math.exp(v - top) for v in row]
        total = sum(probabilities)
        probabilities = [p / total for p in probabilities]
        expected = sorted(range(experts), key=lambda e: (-probabilities[e], e))[:k]
        assert list(ids[t * k:(t + 1) * k]) == expected
        chosen = [probabilities[e] for e in expected]
        if renormalize:
            chosen = [p / sum(chosen) for p in chosen]
        assert list(weights[t * k:(t + 1) * k]) == pytest.approx(chosen, rel=1e-5)


def test_library_errors_raise_with_the_message():
    logits = (ctypes.c_float * 8)()
    ids = (ctypes.c_int32 * 2)()
    weights = (ctypes.c_float * 2)()
    code = _abi.LIB.epmoe_route(routing("top2", 8, 2, False), c_tensor(logits, "float32", (1, 8)), None,
                                c_tensor(ids, "int32", (1, 2)), c_tensor(weights, "float32", (1, 2)), None)
    with pytest.raises(ValueError, match=r"route: routing.kind: expected one of softmax_topk.*got 'top2'"):
        _abi.check(code, "route")
    code = _abi.LIB.epmoe_route(routing("softmax_topk", 8, 9, False), c_tensor(logits, "float32", (1, 8)), None,
                                c_tensor(ids, "int32", (1, 2)), c_tensor(weights, "float32", (1, 2)), None)
    with pytest.raises(ValueError, match=r"routing.top_k: expected 1 <= top_k <= num_experts \(8\), got 9"):
        _abi.check(code, "route")
