"""Finding libcsa and calling its C ABI (ctypes; nothing is compiled against PyTorch)."""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["Error", "LibraryError", "library", "find_library", "check", "STATUS_NAMES"]

#: The C ABI's status codes (csa.h).
STATUS_NAMES = {
    0: "ok",
    1: "invalid argument",
    2: "unsupported",
    3: "driver unavailable",
    4: "driver error",
    5: "compile error",
    6: "cache error",
    7: "capture unsafe",
    8: "jit disabled",
    9: "internal error",
}

ACCUMULATE_GRAD_APE = 1
DETERMINISTIC = 2

_PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"
_NAMES = ("libcsa.so.0", "libcsa.so")
_HOW_TO = (
    "install the package with `pip install .` from the csa repository (it builds libcsa.so and "
    "ships it inside the package), or point CSA_LIBRARY at a built libcsa.so "
    "(e.g. build/libcsa.so.0 after `cmake -S . -B build && cmake --build build`)"
)


class Error(RuntimeError):
    """A failure reported by libcsa: ``status`` is the C ABI's status code, the message is
    ``csa_last_error()``'s."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, "unknown")


class LibraryError(OSError):
    """libcsa could not be found or loaded; the message says how to build it or point to it."""


def find_library(
    package_dir: Path = _PACKAGE_LIB_DIR, environ: Optional[dict[str, str]] = None
) -> Path:
    """The libcsa to load: the one inside the package, else ``$CSA_LIBRARY``."""
    env = os.environ if environ is None else environ
    for name in _NAMES:
        candidate = package_dir / name
        if candidate.is_file():
            return candidate
    configured = env.get("CSA_LIBRARY", "")
    if configured:
        path = Path(configured).resolve()
        if not path.is_file():
            raise LibraryError(f"CSA_LIBRARY={configured!r} is not a file; {_HOW_TO}")
        return path
    raise LibraryError(f"libcsa.so is not inside the csa package ({package_dir}) and CSA_LIBRARY "
                       f"is not set; {_HOW_TO}")


def _preload_nvrtc() -> None:
    """libcsa needs NVRTC at load time: the CUDA toolkit's, or the one a PyTorch wheel brings
    (the nvidia-*-nvrtc packages), which is not on the loader's path by itself."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return
    for root in getattr(nvidia, "__path__", []):
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            for found in sorted(Path(root).glob(pattern)):
                if "builtins" in found.name or "alt" in found.name:
                    continue
                try:
                    ctypes.CDLL(str(found), mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64
_U32 = ctypes.c_uint32

class CompressorArgs(ctypes.Structure):
    """``csa_compressor_args`` of csa.h (the versioned arguments of the ``_ex`` calls)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("ratio", _I32), ("head_dim", _I32), ("coff", _I32), ("dtype", _I32), ("layout", _I32),
        ("flags", _U32),
        ("total_tokens", _I64), ("total_comp", _I64), ("seq_len", _I64),
        ("num_segments", _I32), ("reserved", _I32),
        ("kv_stride", _I64), ("score_stride", _I64), ("out_stride", _I64),
        ("grad_out_stride", _I64), ("grad_kv_stride", _I64), ("grad_score_stride", _I64),
        ("kv", _P), ("score", _P), ("ape", _P), ("cu_seqlens", _P), ("cu_seqlens_comp", _P),
        ("out", _P), ("grad_out", _P), ("grad_kv", _P), ("grad_score", _P), ("grad_ape", _P),
        # version 2: the fused tail
        ("tail_flags", _U32), ("rope_dim", _I32), ("eps", ctypes.c_float), ("reserved2", _I32),
        ("rope_max_blocks", _I64), ("norm_weight", _P), ("rope_cos", _P), ("rope_sin", _P),
        ("rstd", _P), ("grad_norm_weight", _P),
        # version 3: the long-window family's pooled rows
        ("pooled", _P),
    ]


# The first version's size (every field up to grad_ape): the calls without a tail pass it, so
# they run unchanged against a library of either version.
ARGS_SIZE = CompressorArgs.grad_ape.offset + ctypes.sizeof(ctypes.c_void_p)
assert ARGS_SIZE == 192, "csa_compressor_args changed: CSA_COMPRESSOR_ARGS_SIZE_V1 is 192"
ARGS_SIZE_V2 = CompressorArgs.pooled.offset
assert ARGS_SIZE_V2 == 256, "csa_compressor_args changed: CSA_COMPRESSOR_ARGS_SIZE_V2 is 256"
ARGS_SIZE_V3 = ctypes.sizeof(CompressorArgs)
assert ARGS_SIZE_V3 == 264, "csa_compressor_args changed: CSA_COMPRESSOR_ARGS_SIZE_V3 is 264"
TAIL_NORM = 1
TAIL_NORM_WEIGHT_BF16 = 2
TAIL_ROPE_HALF_SPLIT = 4
TAIL_HADAMARD = 8
_ARGS_P = ctypes.POINTER(CompressorArgs)

_SIGNATURES: dict[str, tuple[Any, Sequence[Any]]] = {
    "csa_compressor_forward": (
        ctypes.c_int, [_P, _P, _P, _P, _P, _P, _I64, _I32, _I64, _I32, _I32, _I32, _P]),
    "csa_compressor_backward": (
        ctypes.c_int,
        [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I32, _I64, _I32, _I32, _I32, _U32, _P]),
    "csa_prewarm": (ctypes.c_int, [_I32, _I32, _I32, ctypes.c_int]),
    "csa_compressor_forward_ex": (ctypes.c_int, [_ARGS_P, _P]),
    "csa_compressor_backward_ex": (ctypes.c_int, [_ARGS_P, _P]),
    "csa_prewarm_ex": (ctypes.c_int, [_ARGS_P, ctypes.c_int]),
    "csa_set_device": (ctypes.c_int, [_I32]),
    "csa_last_error": (ctypes.c_char_p, []),
    "csa_version": (ctypes.c_char_p, []),
    "csa_info_json": (ctypes.c_char_p, []),
}

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


def library() -> ctypes.CDLL:
    """libcsa, loaded on first use with every entry point's signature declared."""
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            path = find_library()
            _preload_nvrtc()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise LibraryError(f"cannot load {path}: {e}; {_HOW_TO}") from e
            for name, (restype, argtypes) in _SIGNATURES.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError as e:
                    raise LibraryError(
                        f"{path} has no {name}: it is not a csa library of this package's "
                        f"version; {_HOW_TO}") from e
                fn.restype = restype
                fn.argtypes = argtypes
            _library = lib
    return _library


def check(status: int) -> None:
    """Raises :class:`Error` for a nonzero status, with ``csa_last_error()``'s message."""
    if status != 0:
        message = (library().csa_last_error() or b"").decode(errors="replace")
        raise Error(status, message)


def version() -> str:
    return (library().csa_version() or b"").decode()


def info() -> dict[str, Any]:
    text = library().csa_info_json()
    if text is None:
        check(9)
    return json.loads(text)
