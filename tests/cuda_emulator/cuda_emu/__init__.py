"""A CPU emulator for CUDA kernels, for bnfuse's tests: the exact .cu source, compiled by g++ as host C++.

`compile_module(code, options)` takes what NVRTC would get (source text, NVRTC options) and returns a
`Module` whose kernels launch as CuPy's RawKernel does: ``kernel(grid, block, args)``. Each launch
  - checks the grid and block against CUDA's limits and the kernel's ``__launch_bounds__``;
  - checks every argument against the kernel's C++ parameter type (pointer: a device array of that element
    type; scalar: a NumPy scalar of exactly that size and kind);
  - runs every block, one fiber per CUDA thread (fibers.cpp), three times: forward, reverse and seeded random
    block / thread orders, restoring the buffers in between; the results must agree bitwise (a race check).
Errors (divergent barriers or shuffles, exited lanes, deadlock, memory faults, races) raise EmulatorError.
The emulator is test infrastructure: it proves the kernels' logic, not their speed (see tests/README.md).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
EMU_HEADER = HERE / "emu.h"
FIBERS = HERE / "fibers.cpp"
SHARED_MEMORY_LIMIT = 48 * 1024
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
ORDERS = ("forward", "reverse", "random")
# -fno-strict-aliasing: CUDA code type-puns through reinterpret_cast; -fstack-clash-protection: a large frame
# probes each page, so it hits the fiber's guard page instead of jumping past it.
GXX_FLAGS = ("-O2", "-g", "-fPIC", "-shared", "-fno-strict-aliasing", "-fvisibility=hidden",
             "-fno-threadsafe-statics", "-fstack-clash-protection", "-Wno-attributes")  # fmt: skip


class EmulatorError(RuntimeError):
    """A kernel did something a GPU would not run correctly (or the emulator cannot run it)."""


# -- the CUDA toolkit -----------------------------------------------------------------------------------------


def toolkit_include() -> Path:
    """The include directory of the CUDA toolkit: CUDA_PATH / CUDA_HOME, else the nvcc on PATH."""
    candidates = [Path(os.environ[v]) / "include" for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
        # nvcc may be a wrapper script: ask it where its toolkit is (nvcc -dryrun prints TOP=...).
        result = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull], capture_output=True, text=True)
        for match in re.finditer(r"TOP=(\S+)", result.stdout + result.stderr):
            candidates.append(Path(match.group(1)).resolve() / "include")
    for candidate in candidates:
        if (candidate / "cuda_fp16.h").is_file() and (candidate / "cuda_bf16.h").is_file():
            return candidate
    raise EmulatorError("no CUDA toolkit headers found (set CUDA_PATH or put nvcc on PATH)")


def available() -> str | None:
    """None when the emulator can run here, else why not."""
    if shutil.which("g++") is None:
        return "g++ not found"
    try:
        toolkit_include()
    except EmulatorError as exc:
        return str(exc)
    return None


def _cache_dir() -> Path:
    path = Path(os.environ.get("BNFUSE_EMU_CACHE", Path(tempfile.gettempdir()) / f"bnfuse-cuda-emu-{os.getuid()}"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- device memory ------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
PAGE = mmap.PAGESIZE


class Allocation:
    """Device memory: its last byte sits right below an inaccessible guard page, so reading or writing one
    element past the end faults (SIGSEGV, reported by the launch). New memory is filled with 0xff bytes
    (NaN in every float type), so reading what was never written shows."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        pages = -(-max(nbytes, 1) // PAGE)
        self._map = mmap.mmap(-1, (pages + 1) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        guard = base + pages * PAGE
        if _libc.mprotect(guard, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        self.ptr = guard - nbytes
        self.bytes = np.frombuffer(self._map, np.uint8, count=nbytes, offset=pages * PAGE - nbytes)
        self.bytes.fill(0xFF)


# -- kernels ------------------------------------------------------------------------------------------------

_C_TYPES = {
    "float": (np.dtype(np.float32), ctypes.c_float),
    "double": (np.dtype(np.float64), ctypes.c_double),
    "int": (np.dtype(np.int32), ctypes.c_int32),
    "unsigned int": (np.dtype(np.uint32), ctypes.c_uint32),
    "unsigned": (np.dtype(np.uint32), ctypes.c_uint32),
    "long long": (np.dtype(np.int64), ctypes.c_int64),
    "i64": (np.dtype(np.int64), ctypes.c_int64),
    "unsigned long long": (np.dtype(np.uint64), ctypes.c_uint64),
}
_POINTEE = {"float": "float32", "double": "float64", "__half": "float16", "__nv_bfloat16": "bfloat16",
            "int": "int32", "i64": "int64", "long long": "int64", "unsigned int": "uint32"}  # fmt: skip


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # as written, qualifiers removed: "float", "__half", "i64"
    pointer: bool
    const: bool

    def describe(self) -> str:
        return f"{'const ' if self.const else ''}{self.ctype}{'*' if self.pointer else ''} {self.name}"


@dataclass(frozen=True)
class Signature:
    name: str
    params: tuple[Param, ...]
    launch_bound: int | None


_KERNEL = re.compile(
    r'extern\s+"C"\s+BNFUSE_GLOBAL\s+void\s+(?:BNFUSE_LAUNCH_BOUNDS\s*\(([^)]*)\)\s*)?(\w+)\s*\(([^)]*)\)'
)


def _parse_param(text: str) -> Param:
    text = " ".join(text.replace("*", " * ").split())
    tokens = [t for t in text.split() if t not in ("__restrict__", "__restrict", "restrict")]
    name = tokens.pop()
    pointer = "*" in tokens
    const = "const" in tokens
    ctype = " ".join(t for t in tokens if t not in ("*", "const"))
    return Param(name, ctype, pointer, const)


def _bound(expression: str) -> int:
    if not re.fullmatch(r"[\d\s*+()/-]+", expression):
        raise EmulatorError(f"cannot evaluate __launch_bounds__({expression})")
    return int(eval(expression, {"__builtins__": {}}))  # digits and arithmetic only (checked above)


def scan_kernels(preprocessed: str) -> dict[str, Signature]:
    kernels = {}
    for bound, name, params in _KERNEL.findall(preprocessed):
        parsed = tuple(_parse_param(p) for p in params.split(",") if p.strip() and p.strip() != "void")
        kernels[name] = Signature(name, parsed, _bound(bound.split(",")[0]) if bound else None)
    return kernels


def _stub(sig: Signature) -> str:
    """An entry point taking the launch's argument array (pointers to each argument's bytes)."""
    args = ", ".join(
        f"*({'const ' if p.const else ''}{p.ctype}{'*' if p.pointer else ''}*)a[{i}]" for i, p in enumerate(sig.params)
    )
    visible = '__attribute__((visibility("default")))'
    return f'extern "C" {visible} void bnemu_entry_{sig.name}(void* const* a) {{ {sig.name}({args}); }}\n'


_NVRTC_OPTION = re.compile(r"(--std=|-std=)(c\+\+\d\d)|(-I)(.+)|(-D)(.+)")


def _gxx_options(options: tuple[str, ...]) -> list[str]:
    """NVRTC options -> g++ options (only what bnfuse passes; anything else is an error, not ignored)."""
    out = []
    for option in options:
        match = _NVRTC_OPTION.fullmatch(option)
        if not match:
            raise EmulatorError(f"NVRTC option the emulator does not translate: {option}")
        if match.group(2):
            out.append(f"-std={match.group(2)}")
        else:
            out.append(option)
    return out


_compile_lock = threading.Lock()


class Module:
    """A compiled .cu source: `get_function(name)` -> Kernel."""

    def __init__(self, code: str, options: tuple[str, ...] = ()):
        include = toolkit_include()
        gxx = _gxx_options(tuple(options))
        common = ["-x", "c++", *gxx, f"-I{include}", "-include", str(EMU_HEADER)]
        if not any(o.startswith("-std=") for o in gxx):
            common.insert(2, "-std=c++17")
        key = hashlib.sha256(
            "\0".join([code, *common, *GXX_FLAGS, EMU_HEADER.read_text(), FIBERS.read_text()]).encode()
        ).hexdigest()[:24]
        directory = _cache_dir() / key
        library = directory / "module.so"
        with _compile_lock:
            if not library.exists():
                self._build(code, common, directory, library)
        self.signatures: dict[str, Signature] = _load_signatures(directory / "kernels.txt")
        self._lib = ctypes.CDLL(str(library))
        self._lib.bnemu_launch.restype = ctypes.c_int
        self._lib.bnemu_launch.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                           ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                           ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t)  # fmt: skip
        self.shared_bytes = self._register_shared(library)
        if self.shared_bytes > SHARED_MEMORY_LIMIT:
            raise EmulatorError(
                f"the module's __shared__ variables total {self.shared_bytes} bytes, over the 48 KiB static limit"
            )

    @staticmethod
    def _build(code: str, common: list[str], directory: Path, library: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix="build-", dir=directory.parent))
        source = work / "kernels.cu"
        source.write_text(code)
        scan = subprocess.run(
            ["g++", "-E", "-P", "-DBNFUSE_EMU_SCAN", *common, str(source)], capture_output=True, text=True
        )
        if scan.returncode != 0:
            raise EmulatorError(f"g++ -E failed:\n{scan.stderr[-4000:]}")
        kernels = scan_kernels(scan.stdout)
        if not kernels:
            raise EmulatorError('no extern "C" __global__ kernels in the source')
        source.write_text(code + "\n// cuda_emu entry points\n" + "".join(_stub(s) for s in kernels.values()))
        command = ["g++", *common, *GXX_FLAGS, str(source), "-x", "c++", str(FIBERS), "-o", str(work / "module.so")]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulatorError(f"g++ failed:\n{result.stderr[-6000:]}")
        (work / "kernels.txt").write_text(
            "\n".join(
                f"{s.name}|{s.launch_bound or ''}|" + ";".join(f"{p.name},{p.ctype},{int(p.pointer)},{int(p.const)}"
                                                                for p in s.params)
                for s in kernels.values()
            )
        )  # fmt: skip
        try:  # atomic: a cache entry is complete or absent (another process may have finished first)
            work.rename(directory)
        except OSError:
            shutil.rmtree(work, ignore_errors=True)

    def _register_shared(self, library: Path) -> int:
        """Finds the __shared__ variables (function-local statics of kernel code) in the symbol table, so the
        scheduler can poison them before each block; returns their total size."""
        nm = subprocess.run(["nm", "-S", "--defined-only", str(library)], capture_output=True, text=True, check=True)
        anchor = next(line.split() for line in nm.stdout.splitlines() if line.endswith(" bnemu_set_shared"))
        base = ctypes.cast(self._lib.bnemu_set_shared, ctypes.c_void_p).value - int(anchor[0], 16)
        found = []
        for line in nm.stdout.splitlines():  # "address size type name": a function's static (_ZZ), not bnemu's
            parts = line.split(maxsplit=3)
            if len(parts) == 4 and parts[2] in "bBdDuV" and parts[3].startswith("_ZZ") and "5bnemu" not in parts[3]:
                found.append((base + int(parts[0], 16), int(parts[1], 16)))
        self._shared_ptrs = (ctypes.c_void_p * max(1, len(found)))(*(p for p, _ in found))
        self._shared_sizes = (ctypes.c_size_t * max(1, len(found)))(*(s for _, s in found))
        self._lib.bnemu_set_shared(self._shared_ptrs, self._shared_sizes, len(found))
        return sum(s for _, s in found)

    def get_function(self, name: str) -> Kernel:
        if name not in self.signatures:
            raise EmulatorError(f"no kernel named {name} in the module")
        return Kernel(self, self.signatures[name])


def _load_signatures(path: Path) -> dict[str, Signature]:
    out = {}
    for line in path.read_text().splitlines():
        name, bound, params = line.split("|")
        parsed = tuple(
            Param(n, t, bool(int(p)), bool(int(c))) for n, t, p, c in (q.split(",") for q in params.split(";") if q)
        )
        out[name] = Signature(name, parsed, int(bound) if bound else None)
    return out


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, tuple | list) else (value,)))
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise EmulatorError(f"{what} {value!r}: 1 to 3 dimensions, each at least 1 (CUDA: invalid configuration)")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


class Kernel:
    launches: list[str] = []  # names of every kernel launched in this process (tests check coverage)
    _seed = 0

    def __init__(self, module: Module, signature: Signature):
        self.module = module
        self.signature = signature
        self.entry = ctypes.cast(getattr(module._lib, f"bnemu_entry_{signature.name}"), ctypes.c_void_p).value

    def _check_config(self, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
        name = self.signature.name
        threads = block[0] * block[1] * block[2]
        limit = self.signature.launch_bound or MAX_THREADS
        if any(b > m for b, m in zip(block, MAX_BLOCK, strict=True)) or threads > MAX_THREADS:
            raise EmulatorError(f"{name}: block {block} exceeds CUDA's limits")
        if threads > limit:
            raise EmulatorError(f"{name}: block {block} has {threads} threads, over __launch_bounds__({limit})")
        if grid[0] > MAX_GRID_X or grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
            raise EmulatorError(f"{name}: grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")

    def _marshal(self, args: tuple[Any, ...]) -> tuple[list[Any], list[Allocation]]:
        sig = self.signature
        if len(args) != len(sig.params):
            raise EmulatorError(f"{sig.name} takes {len(sig.params)} arguments, got {len(args)}")
        values: list[Any] = []
        buffers: list[Allocation] = []
        for i, (param, arg) in enumerate(zip(sig.params, args, strict=True)):
            where = f"{sig.name} argument {i} ({param.describe()})"
            if param.pointer:
                device = getattr(arg, "__cuda_emu_device__", None)
                if device is None:
                    raise EmulatorError(f"{where}: expected a device array, got {type(arg).__name__}")
                want = _POINTEE.get(param.ctype)
                if want is None or arg.dtype.name != want:
                    raise EmulatorError(f"{where}: array of {arg.dtype.name}, the kernel reads {param.ctype}")
                allocation, ptr = device()
                values.append(ctypes.c_void_p(ptr))
                if all(allocation is not b for b in buffers):
                    buffers.append(allocation)
            else:
                dtype, ctype = _C_TYPES.get(param.ctype, (None, None))
                if dtype is None:
                    raise EmulatorError(f"{where}: parameter type the emulator does not know")
                if not isinstance(arg, np.generic) or arg.dtype != dtype:
                    got = arg.dtype.name if isinstance(arg, np.generic) else type(arg).__name__
                    raise EmulatorError(f"{where}: needs a numpy {dtype.name} scalar, got {got}")
                values.append(ctype(arg.item()))
        return values, buffers

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], **_: Any) -> None:
        grid3, block3 = _dims(grid, "grid"), _dims(block, "block")
        self._check_config(grid3, block3)
        values, buffers = self._marshal(tuple(args))
        argv = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
        grid_c = (ctypes.c_uint * 3)(*grid3)
        block_c = (ctypes.c_uint * 3)(*block3)
        before = [b.bytes.copy() for b in buffers]
        first: list[np.ndarray] = []
        for index, order in enumerate(ORDERS):
            if index:
                for buffer, saved in zip(buffers, before, strict=True):
                    buffer.bytes[...] = saved
            Kernel._seed += 1
            self._run(argv, grid_c, block_c, index, Kernel._seed)
            after = [b.bytes.copy() for b in buffers]
            if not index:
                first = after
                continue
            for k, (a, b) in enumerate(zip(first, after, strict=True)):
                if not np.array_equal(a, b):
                    at = int(np.flatnonzero(a != b)[0])
                    raise EmulatorError(
                        f"race: {self.signature.name} grid {grid3} block {block3} wrote different bytes under the "
                        f"{order} block/thread order than under the forward order (buffer {k}, byte {at})"
                    )
        Kernel.launches.append(self.signature.name)

    def _run(self, argv: Any, grid: Any, block: Any, order: int, seed: int) -> None:
        error = ctypes.create_string_buffer(4096)
        name = self.signature.name.encode()
        status = self.module._lib.bnemu_launch(self.entry, argv, name, grid, block, order, seed, error, len(error))
        if status:
            raise EmulatorError(f"{error.value.decode(errors='replace')} [{ORDERS[order]} order]")


def _write_launch_log() -> None:
    """BNFUSE_EMU_LAUNCH_LOG=path: the names of the kernels this process launched, one a line (coverage)."""
    Path(os.environ["BNFUSE_EMU_LAUNCH_LOG"]).write_text("\n".join(sorted(set(Kernel.launches))) + "\n")


if os.environ.get("BNFUSE_EMU_LAUNCH_LOG"):
    atexit.register(_write_launch_log)


def compile_module(code: str, options: tuple[str, ...] = ()) -> Module:
    return Module(code, tuple(options))
