"""A strict stand-in for the part of cupy that hetconv uses, so CI tests the GPU path.

Test-only. ``HETCONV_TEST_GPU_MODULE=tests.support.strict_gpu`` makes
:mod:`hetconv.backend` use this module wherever it would use cupy (``gpu:N``
devices), in the test process and in every subprocess that inherits the variable.
Its arrays wrap numpy arrays, so every result (dtypes, rounding) is numpy's, but:

* they refuse every implicit conversion: ``np.asarray``/``np.array``/``__array__``,
  numpy functions such as ``np.concatenate`` (``__array_function__``), arithmetic or
  indexing that mixes them with host arrays, ``float()``/``int()``/``bool()``;
* the only ways across are explicit and counted per device: ``asarray`` of a host
  array (host -> device) and ``asnumpy`` / ``.get()`` (device -> host);
* every array remembers the device that was current (``cuda.Device(n)``, per thread,
  like CUDA) when it was made; using it while another device is current is refused.

Every refusal raises :class:`StrictDeviceError` and is also recorded, so a refusal
that some layer turns into an error reply still shows in :func:`counters`. With
``HETCONV_STRICT_REPORT_DIR`` set, each process writes its counters to
``<dir>/<pid>.json`` when it exits. ``HETCONV_STRICT_GPUS`` sets how many devices it
pretends to have (default 2).
"""
from __future__ import annotations

import atexit
import json
import operator
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

DEVICE_COUNT_VARIABLE = "HETCONV_STRICT_GPUS"
REPORT_DIR_VARIABLE = "HETCONV_STRICT_REPORT_DIR"
DIRECTIONS = ("host_to_device", "device_to_host")

float16, float32, float64 = np.float16, np.float32, np.float64
uint8, int32, int64, bool_ = np.uint8, np.int32, np.int64, np.bool_


class StrictDeviceError(TypeError):
    """An implicit host/device conversion or a computation on the wrong device."""


# ---------------------------------------------------------------- counters
_lock = threading.Lock()
_copies: dict[str, dict[int, int]] = {}
_copy_bytes: dict[str, dict[int, int]] = {}
_violations: list[str] = []
_devices_used: set[int] = set()
_synchronizations = 0


def reset() -> None:
    """Forget every count (tests call this before the code they check)."""
    global _synchronizations
    with _lock:
        for table in (_copies, _copy_bytes):
            table.clear()
            table.update({direction: {} for direction in DIRECTIONS})
        _violations.clear()
        _devices_used.clear()
        _synchronizations = 0


reset()


def counters() -> dict[str, Any]:
    """Copies and bytes per direction and device (keys "gpu:N"), violations, devices used."""
    with _lock:
        return {
            "copies": {d: {f"gpu:{k}": v for k, v in _copies[d].items()} for d in DIRECTIONS},
            "bytes": {d: {f"gpu:{k}": v for k, v in _copy_bytes[d].items()} for d in DIRECTIONS},
            "violations": list(_violations),
            "devices_used": sorted(f"gpu:{d}" for d in _devices_used),
            "synchronizations": _synchronizations,
        }


def _count(direction: str, device: int, nbytes: int) -> None:
    with _lock:
        _copies[direction][device] = _copies[direction].get(device, 0) + 1
        _copy_bytes[direction][device] = _copy_bytes[direction].get(device, 0) + nbytes


def _refuse(message: str) -> StrictDeviceError:
    with _lock:
        _violations.append(message)
    return StrictDeviceError(f"strict_gpu: {message}")


def _write_report() -> None:
    directory = os.environ.get(REPORT_DIR_VARIABLE)
    if not directory:
        return
    report = {"pid": os.getpid(), "argv": sys.argv, **counters()}
    path = os.path.join(directory, f"{os.getpid()}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    os.replace(path + ".tmp", path)


atexit.register(_write_report)


# ---------------------------------------------------------------- devices
_thread = threading.local()


def device_count() -> int:
    return int(os.environ.get(DEVICE_COUNT_VARIABLE, "2"))


def _current() -> int:
    return int(getattr(_thread, "device", 0))


class Device:
    """``cuda.Device(n)``: a context that makes device n current in this thread;
    ``cuda.Device()`` is the current one."""

    def __init__(self, device: int | None = None):
        self.id = _current() if device is None else int(device)
        if not 0 <= self.id < device_count():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def __enter__(self) -> Device:
        stack = _thread.__dict__.setdefault("stack", [])
        stack.append(_current())
        _thread.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _thread.device = _thread.stack.pop()

    def use(self) -> None:
        _thread.device = self.id

    def synchronize(self) -> None:
        get_current_stream().synchronize()


class Stream:
    def synchronize(self) -> None:
        global _synchronizations
        with _lock:
            _synchronizations += 1


def get_current_stream() -> Stream:
    return Stream()


def _device_properties(index: int) -> dict[str, Any]:
    Device(index)  # validates the index
    return {"name": f"strict test device {index}".encode(), "totalGlobalMem": 1 << 34}


cuda = types.SimpleNamespace(
    Device=Device, Stream=Stream, get_current_stream=get_current_stream,
    runtime=types.SimpleNamespace(getDeviceCount=device_count,
                                  getDeviceProperties=_device_properties))


# ---------------------------------------------------------------- arrays
def _wrap(data: Any) -> ndarray:
    """A device array on the current device around a numpy result (0-d for scalars)."""
    if isinstance(data, np.generic):
        data = np.asarray(data)
    if not isinstance(data, np.ndarray):
        raise TypeError(f"strict_gpu: internal error, cannot wrap {type(data).__name__}")
    return ndarray(data, _current())


def _unwrap(value: Any, where: str) -> Any:
    """The numpy data behind a device operand; scalars pass; host arrays are refused."""
    if isinstance(value, ndarray):
        if value._device != _current():
            raise _refuse(f"{where}: array on gpu:{value._device} used while gpu:{_current()} "
                          "is the current device")
        return value._data
    if isinstance(value, np.ndarray):
        raise _refuse(f"{where}: host numpy array {value.shape} mixed with device arrays; "
                      "copy it with asarray() first")
    if isinstance(value, (np.generic, int, float, bool, complex)) or value is None:
        return value
    raise _refuse(f"{where}: {type(value).__name__} mixed with device arrays")


def _index(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_index(part) for part in key)
    if isinstance(key, (slice, type(Ellipsis))) or key is None:
        return key
    return _unwrap(key, "indexing")


def _binary(func: Callable[[Any, Any], Any], reflected: bool = False) -> Any:
    def method(self: ndarray, other: Any) -> ndarray:
        a, b = _unwrap(self, func.__name__), _unwrap(other, func.__name__)
        return _wrap(func(b, a) if reflected else func(a, b))
    return method


def _in_place(func: Callable[[Any, Any], Any]) -> Any:
    def method(self: ndarray, other: Any) -> ndarray:
        func(_unwrap(self, func.__name__), _unwrap(other, func.__name__))
        return self
    return method


def _unary(func: Callable[[Any], Any]) -> Any:
    def method(self: ndarray) -> ndarray:
        return _wrap(func(_unwrap(self, func.__name__)))
    return method


def _refused(what: str) -> Any:
    def method(self: ndarray, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"implicit device->host conversion ({what}) of a gpu:{self._device} "
                      "array; use asnumpy() or .get()")
    return method


class ndarray:  # noqa: N801 - cupy's name
    """A device array: numpy data that only explicit, counted copies may leave."""

    __slots__ = ("_data", "_device")
    __array_ufunc__ = None  # numpy operators defer to ours, which refuse host operands
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, data: np.ndarray, device: int):
        self._data = data
        self._device = device
        _devices_used.add(device)

    # what a device array may tell without a copy
    shape = property(lambda self: self._data.shape)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)
    dtype = property(lambda self: self._data.dtype)
    strides = property(lambda self: self._data.strides)
    itemsize = property(lambda self: self._data.itemsize)
    nbytes = property(lambda self: self._data.nbytes)
    device = property(lambda self: Device(self._device))
    T = property(lambda self: _wrap(_unwrap(self, "T").T))

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"strict_gpu.ndarray(shape={self.shape}, dtype={self.dtype}, gpu:{self._device})"

    def get(self) -> np.ndarray:
        """Device -> host copy (counted)."""
        return asnumpy(self)

    def reshape(self, *shape: Any) -> ndarray:
        return _wrap(_unwrap(self, "reshape").reshape(*shape))

    def transpose(self, *axes: Any) -> ndarray:
        return _wrap(_unwrap(self, "transpose").transpose(*axes))

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        result = _unwrap(self, "astype").astype(dtype, copy=copy)
        return self if result is self._data else _wrap(result)

    def copy(self) -> ndarray:
        return _wrap(_unwrap(self, "copy").copy())

    def sum(self, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> ndarray:
        return _wrap(_unwrap(self, "sum").sum(axis=axis, dtype=dtype, keepdims=keepdims))

    def max(self, axis: Any = None, keepdims: bool = False) -> ndarray:
        return _wrap(_unwrap(self, "max").max(axis=axis, keepdims=keepdims))

    def min(self, axis: Any = None, keepdims: bool = False) -> ndarray:
        return _wrap(_unwrap(self, "min").min(axis=axis, keepdims=keepdims))

    def __getitem__(self, key: Any) -> ndarray:
        return _wrap(_unwrap(self, "indexing")[_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        _unwrap(self, "assignment")[_index(key)] = _unwrap(value, "assignment")

    __add__, __radd__ = _binary(operator.add), _binary(operator.add, True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, True)
    __matmul__, __rmatmul__ = _binary(operator.matmul), _binary(operator.matmul, True)
    __iadd__, __isub__ = _in_place(operator.iadd), _in_place(operator.isub)
    __imul__, __itruediv__ = _in_place(operator.imul), _in_place(operator.itruediv)
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)
    __eq__, __ne__ = _binary(operator.eq), _binary(operator.ne)  # type: ignore[assignment]
    __neg__, __abs__ = _unary(operator.neg), _unary(operator.abs)

    # implicit conversions: refused
    __array__ = _refused("__array__: np.asarray / np.array")
    __bool__ = _refused("bool()")
    __float__ = _refused("float()")
    __int__ = _refused("int()")
    __index__ = _refused("index")
    __complex__ = _refused("complex()")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise _refuse(f"numpy.{func.__name__} called with a gpu:{self._device} array; use the "
                      "device module's function or copy to the host with asnumpy()")


# ---------------------------------------------------------------- the only ways across
def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A device array: ``a`` itself when it already is one, else a counted host -> device copy."""
    if isinstance(a, ndarray):
        data = _unwrap(a, "asarray")
        if dtype is None or np.dtype(dtype) == data.dtype:
            return a
        return _wrap(data.astype(dtype))
    host = np.array(a, dtype=dtype, copy=True)  # device memory never aliases host memory
    _count("host_to_device", _current(), host.nbytes)
    return _wrap(host)


def asnumpy(a: Any) -> np.ndarray:
    """A host copy of a device array (counted; any current device, like cupy's)."""
    if isinstance(a, ndarray):
        _count("device_to_host", a._device, a._data.nbytes)
        return a._data.copy()
    return np.asarray(a)


# ---------------------------------------------------------------- functions the ops use
def _shape_function(func: Callable[..., Any]) -> Callable[..., ndarray]:
    def make(shape: Any, dtype: Any = float) -> ndarray:
        return _wrap(func(shape, dtype))
    make.__name__ = func.__name__
    return make


zeros, ones, empty = (_shape_function(f) for f in (np.zeros, np.ones, np.empty))


def _like_function(func: Callable[..., Any]) -> Callable[..., ndarray]:
    def make(a: Any, dtype: Any = None) -> ndarray:
        if not isinstance(a, ndarray):
            raise _refuse(f"{func.__name__} of a host array: make device arrays from device ones")
        return _wrap(func(_unwrap(a, func.__name__), dtype=dtype))
    make.__name__ = func.__name__
    return make


zeros_like, ones_like, empty_like = (_like_function(f) for f in
                                     (np.zeros_like, np.ones_like, np.empty_like))


class _Ufunc:
    """A numpy ufunc over device arrays (``__call__`` and ``reduce``)."""

    def __init__(self, ufunc: np.ufunc):
        self.ufunc = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args: Any, out: ndarray | None = None) -> ndarray:
        data = [_unwrap(a, self.__name__) for a in args]
        if out is None:
            return _wrap(self.ufunc(*data))
        self.ufunc(*data, out=_unwrap(out, self.__name__))
        return out

    def reduce(self, a: Any, axis: Any = 0, dtype: Any = None, keepdims: bool = False) -> ndarray:
        return _wrap(self.ufunc.reduce(_unwrap(a, self.__name__), axis=axis, dtype=dtype,
                                       keepdims=keepdims))


add, maximum, minimum, exp, log, sqrt, matmul = (
    _Ufunc(f) for f in (np.add, np.maximum, np.minimum, np.exp, np.log, np.sqrt, np.matmul))


def where(condition: Any, x: Any, y: Any) -> ndarray:
    return _wrap(np.where(*(_unwrap(a, "where") for a in (condition, x, y))))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if not isinstance(a, ndarray):
        raise _refuse("ascontiguousarray of a host array: copy it with asarray() first")
    return _wrap(np.ascontiguousarray(_unwrap(a, "ascontiguousarray"), dtype=dtype))


def result_type(*arrays_and_dtypes: Any) -> np.dtype[Any]:
    return np.result_type(*(a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes))


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _wrap(np.arange(*args, dtype=dtype))


def pad(a: Any, pad_width: Any, mode: str = "constant") -> ndarray:
    return _wrap(np.pad(_unwrap(a, "pad"), pad_width, mode=mode))


def einsum(subscripts: str, *operands: Any) -> ndarray:
    return _wrap(np.einsum(subscripts, *(_unwrap(a, "einsum") for a in operands)))


def _as_strided(x: Any, shape: Any = None, strides: Any = None) -> ndarray:
    return _wrap(np.lib.stride_tricks.as_strided(_unwrap(x, "as_strided"), shape, strides))


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))

