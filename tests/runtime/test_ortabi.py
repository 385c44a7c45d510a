"""The ctypes side of the custom-op library: OrtApi table indices, struct layout, buffer views, hot-path tables."""

from __future__ import annotations

import ast
import ctypes
import importlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bnfuse.runtime import (
    conv_grad,
    conv_input_grad,
    library_path,
    ops,
    optimizer_ops,
    ortabi,
    registry,
    session_options,
    sync_ops,
)

# Checked by hand against onnxruntime_c_api.h (struct OrtApi, header order, ORT_API_VERSION 23) for every
# entry bnfuse calls. A wrong index calls the wrong function and crashes the process, so edits to the
# table in ortabi/api.py must keep these.
VERIFIED_INDICES = {
    "CreateStatus": 0,
    "GetErrorCode": 1,
    "GetErrorMessage": 2,
    "CreateCustomOpDomain": 26,
    "CustomOpDomain_Add": 27,
    "AddCustomOpDomain": 28,
    "GetTensorMutableData": 51,
    "GetTensorElementType": 60,
    "GetDimensionsCount": 61,
    "GetDimensions": 62,
    "GetTensorTypeAndShape": 65,
    "MemoryInfoGetName": 71,
    "MemoryInfoGetId": 72,
    "KernelInfoGetAttribute_float": 85,
    "KernelInfoGetAttribute_int64": 86,
    "KernelInfoGetAttribute_string": 87,
    "KernelContext_GetInputCount": 88,
    "KernelContext_GetOutputCount": 89,
    "KernelContext_GetInput": 90,
    "KernelContext_GetOutput": 91,
    "ReleaseStatus": 93,
    "ReleaseTensorTypeAndShapeInfo": 99,
    "KernelContext_GetGPUComputeStream": 193,
    "GetTensorMemoryInfo": 194,
    "KernelInfo_GetInputCount": 230,  # after RegisterCustomOpsUsingFunction (229), header order
    "KernelInfo_GetNodeName": 244,
    # header order: GetCurrentGpuDeviceId (161, an ORT static assert), KernelInfoGetAttributeArray_float, _int64;
    # exercised by ConvWeightGrad reading its list attributes (tests/runtime/test_conv_grad.py)
    "KernelInfoGetAttributeArray_float": 162,
    "KernelInfoGetAttributeArray_int64": 163,
    "GetBuildInfoString": 254,
    # API version 17 (onnxruntime 1.17), 20 entries after GetBuildInfoString in the header (read from the
    # onnxruntime 1.31 header); exercised by ConvWeightGrad's batch chunks, whose run fails loudly if a chunk
    # did not run (tests/runtime/test_conv_grad.py) and by the CPU BN kernels on the session pool.
    "KernelContext_ParallelFor": 274,
}

# onnxruntime_c_api.cc static_asserts these offsets (in pointers), the last entry of each finished API version
# 1..15, so that old API versions never move (checked in onnxruntime's main branch; 254 is version 15's end).
ORT_STATIC_ASSERTS = {
    "ReleaseCustomOpDomain": 101,
    "ReleaseModelMetadata": 118,
    "AddFreeDimensionOverrideByName": 124,
    "ReleaseAvailableProviders": 126,
    "SetGlobalSpinControl": 149,
    "ReleaseArenaCfg": 157,
    "GetCurrentGpuDeviceId": 161,
    "CreateSessionFromArrayWithPrepackedWeightsContainer": 169,
    "GetSparseTensorIndices": 191,
    "SynchronizeBoundOutputs": 203,
    "SessionOptionsAppendExecutionProvider_MIGraphX": 209,
    "ReleaseKernelInfo": 218,
    "ReleaseCANNProviderOptions": 224,
    "GetSessionConfigEntry": 238,
    "GetBuildInfoString": 254,
}


@pytest.fixture(scope="module")
def api() -> ortabi.OrtApi:
    session_options()  # onnxruntime hands over its API table when it registers the library
    return ortabi.ort_api()


def test_every_used_entry_has_its_verified_index() -> None:
    used = set(ortabi._SIGNATURES) | set(ortabi._TENSOR_API) | {"KernelContext_ParallelFor"}
    assert used <= set(VERIFIED_INDICES)
    assert {name: ortabi.API_INDEX[name] for name in VERIFIED_INDICES} == VERIFIED_INDICES


def test_table_agrees_with_onnxruntimes_own_asserts() -> None:
    assert {index: ortabi._API_ENTRIES[index] for index in ORT_STATIC_ASSERTS.values()} == {
        index: name for name, index in ORT_STATIC_ASSERTS.items()
    }
    last = VERIFIED_INDICES["KernelContext_ParallelFor"]
    assert len(ortabi._API_ENTRIES) == len(set(ortabi._API_ENTRIES)) == last + 1


def test_status_round_trip_and_build_info_call_the_right_entries(api: ortabi.OrtApi) -> None:
    status = api.make_status("bnfuse says hi", ortabi.ORT_INVALID_ARGUMENT)
    assert api.GetErrorCode(status) == ortabi.ORT_INVALID_ARGUMENT
    assert api.status_message(status) == "bnfuse says hi"
    with pytest.raises(ortabi.OrtError, match="bnfuse says hi"):
        api.check(api.make_status("bnfuse says hi"))  # check() releases it
    api.ReleaseStatus(status)
    assert api.build_info().startswith("ORT Build Info")  # the last entry bnfuse indexes


def test_used_entries_are_distinct_functions(api: ortabi.OrtApi) -> None:
    pointers = {name: api.pointer(name) for name in VERIFIED_INDICES}
    assert all(pointers.values())
    assert len(set(pointers.values())) == len(pointers)


def test_custom_op_struct_layout() -> None:
    """struct OrtCustomOp as onnxruntime reads it: raw memory of a registered struct, by pointer slot (not
    by our field names): a uint32 version 16 at offset 0, CreateKernelV2 / KernelComputeV2 in slots 17 / 18
    (the header's order), the V1 CreateKernel / KernelCompute (slots 1 / 8) NULL so ORT takes the V2 pair.
    Every other slot is a library function (native/python_hook.c): bnfuse_compute (the Python callback), the
    kernel's creation and destruction (Python only while the interpreter is not finalizing), and the questions
    about the op, answered in C from the description after the struct (no Python at all)."""
    session_options()
    address, (struct, spec, _, _) = next(iter(ortabi._registry.ops.items()))
    assert ctypes.c_uint32.from_address(address).value == ortabi.CUSTOM_OP_VERSION == 16
    slots = (ctypes.c_void_p * 21).from_address(address)
    library = ctypes.CDLL(str(ortabi.entry_library_path()))

    def exported(name: str) -> int:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0

    assert slots[17] == exported("bnfuse_create_kernel") != 0
    assert slots[18] == exported("bnfuse_compute") != 0
    assert slots[9] == exported("bnfuse_destroy_kernel") != 0
    assert slots[1] is None and slots[8] is None and slots[19] is None  # CreateKernel, KernelCompute, InferShape
    assert [slots[i] for i in (2, 3, 4, 5, 6, 7)] == [
        exported(f"bnfuse_op_{name}")
        for name in ("name", "provider", "input_type", "input_count", "output_type", "output_count")
    ]
    assert [slots[i] for i in (10, 11, 12)] == [
        exported(f"bnfuse_op_{name}") for name in ("input_characteristic", "output_characteristic", "input_memory_type")
    ]
    assert [slots[i] for i in (13, 14, 15, 16)] == [exported("bnfuse_op_one")] * 4
    assert ortabi.OP_INFO_OFFSET == ctypes.sizeof(ortabi.OrtCustomOp)  # the description right after the struct
    assert ctypes.string_at(struct.GetName(address)).decode() == spec.name


def test_numpy_view_shares_memory_and_respects_writability() -> None:
    base = np.arange(12, dtype=np.float32)
    view = ortabi.numpy_view(base.ctypes.data, (3, 4), np.dtype(np.float32), writable=True)
    assert view.ctypes.data == base.ctypes.data and view.shape == (3, 4)
    view[1, 2] = -1.0
    assert base[6] == -1.0
    readonly = ortabi.numpy_view(base.ctypes.data, (12,), np.dtype(np.float32), writable=False)
    with pytest.raises(ValueError, match="read-only"):
        readonly[0] = 1.0
    assert ortabi.numpy_view(0, (0, 3), np.dtype(np.float16), writable=True).shape == (0, 3)


def test_output_rows_encode_rank_and_dims() -> None:
    rows = ortabi._rows_for(((2, 3, 4), None, (3,)))
    assert rows.shape == (3, ortabi.TENSOR_FIELDS)
    assert rows[0, ortabi._RANK] == 3 and list(rows[0, ortabi._DIMS : ortabi._DIMS + 3]) == [2, 3, 4]
    assert rows[1, ortabi._RANK] == -1
    assert rows[2, ortabi._RANK] == 1 and rows[2, ortabi._DIMS] == 3
    with pytest.raises(ortabi.OrtError, match="at most 8 dimensions"):
        ortabi._rows_for(((1,) * 9,))


def test_element_types_follow_onnx() -> None:
    assert ortabi.element_type(np.float32) == 1 and ortabi.element_type("float16") == 10
    assert ortabi.dtype_of(11) == np.float64 and ortabi.dtype_of(7) == np.int64  # int64: the collective ops' token
    with pytest.raises(ortabi.OrtError, match="element type 6 is not supported"):
        ortabi.dtype_of(6)


def test_entry_library_has_the_callback_installed() -> None:
    session_options()
    library = ctypes.CDLL(str(ortabi.entry_library_path()))
    assert library.bnfuse_has_register_callback() == 1
    assert library.bnfuse_tensor_fields() == ortabi.TENSOR_FIELDS
    assert library.bnfuse_abi_version() == ortabi.ENTRY_ABI_VERSION


def test_op_structs_are_shared_between_session_options() -> None:
    """Registering the library in many options reuses the Python ops' OrtCustomOp structs (no growth per options)."""
    session_options()
    structs = dict(ortabi._registry.ops)
    for _ in range(20):
        session_options()
    assert ortabi._registry.ops == structs
    assert ort.get_version_string()  # onnxruntime still fine


def test_custom_op_callbacks_describe_each_kernel() -> None:
    """Every registered OrtCustomOp answers onnxruntime's questions from its spec (CUDA ones included)."""
    options = ort.SessionOptions()
    with registry.registering_for((ops.CPU, ops.CUDA)):  # CUDA kernels too, even in a CPU-only onnxruntime
        options.register_custom_ops_library(library_path())
    model = ops.single_op_model(ops.INFERENCE).SerializeToString()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].name == "Y"
    specs = {spec for _, spec, _, _ in ortabi._registry.ops.values()}
    assert {s.provider for s in specs} == {ops.CPU, ops.CUDA}
    for address, (struct, spec, _, _) in ortabi._registry.ops.items():
        assert struct.version == ortabi.CUSTOM_OP_VERSION
        if spec.name in optimizer_ops.OP_NAMES:  # one variadic float32 input list and output list
            assert ctypes.string_at(struct.GetName(address)).decode() == spec.name
            assert (struct.GetInputTypeCount(address), struct.GetOutputTypeCount(address)) == (1, 1)
            assert struct.GetInputCharacteristic(address, 0) == ortabi.INPUT_OUTPUT_VARIADIC
            assert struct.GetOutputCharacteristic(address, 0) == ortabi.INPUT_OUTPUT_VARIADIC
            assert struct.GetInputType(address, 0) == struct.GetOutputType(address, 0) == 1  # float
            assert (struct.GetVariadicInputMinArity(address), struct.GetVariadicInputHomogeneity(address)) == (1, 1)
            continue
        assert ctypes.string_at(struct.GetName(address)).decode() == spec.name
        assert ctypes.string_at(struct.GetExecutionProviderType(address)).decode() == spec.provider
        input_names = {
            **ops.INPUT_NAMES,
            **sync_ops.INPUT_NAMES,
            conv_grad.OP: conv_grad.INPUT_NAMES,
            conv_input_grad.OP: conv_input_grad.INPUT_NAMES,
        }[spec.name]
        input_names += ops.OPTIONAL_INPUT_NAMES.get(spec.name, ())  # Grad's Y (activation "relu")
        optional_in = [struct.GetInputCharacteristic(address, i) for i in range(len(input_names))]
        first_optional = len(input_names) - len(ops.OPTIONAL_INPUT_NAMES.get(spec.name, ()))
        assert optional_in == [
            ortabi.INPUT_OUTPUT_OPTIONAL if i >= first_optional else ortabi.INPUT_OUTPUT_REQUIRED
            for i in range(len(input_names))
        ]
        output_names = {
            **ops.OUTPUT_NAMES,
            **sync_ops.OUTPUT_NAMES,
            conv_grad.OP: conv_grad.OUTPUT_NAMES,
            conv_input_grad.OP: conv_input_grad.OUTPUT_NAMES,
        }[spec.name]
        assert struct.GetInputTypeCount(address) == len(input_names)
        assert struct.GetOutputTypeCount(address) == len(output_names)
        inputs = [struct.GetInputType(address, i) for i in range(struct.GetInputTypeCount(address))]
        assert inputs == [ortabi.element_type(d) for d in spec.input_dtypes]
        optional = [struct.GetOutputCharacteristic(address, i) for i in range(struct.GetOutputTypeCount(address))]
        assert optional == [
            ortabi.INPUT_OUTPUT_OPTIONAL if i in spec.optional_outputs else ortabi.INPUT_OUTPUT_REQUIRED
            for i in range(len(optional))
        ]


def test_openmp_settings_kept_puts_back_every_loaded_runtime() -> None:
    """Thread count, dynamic adjustment and nesting set inside the block (what numba's OpenMP layer does when it
    starts) on every loaded runtime are undone on leaving it; the settings ortabi reads are the runtime's own."""
    torch = pytest.importorskip("torch")  # loads an OpenMP runtime (its libgomp) into the process
    runtimes = ortabi._loaded_openmp_runtimes()
    assert runtimes, "no OpenMP runtime found in /proc/self/maps although torch is loaded"
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        before = ortabi.openmp_settings()
        for path, handle in runtimes.items():
            assert before[path][0] == handle.omp_get_max_threads()
        assert any(threads == 1 for threads, _, _ in before.values())
        with ortabi.openmp_settings_kept():
            for handle in runtimes.values():
                handle.omp_set_num_threads(3)
                handle.omp_set_dynamic(1)
                handle.omp_set_max_active_levels(1 if handle.omp_get_max_active_levels() != 1 else 2)
            assert torch.get_num_threads() == 3
        assert ortabi.openmp_settings() == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_the_package_reads_as_the_one_module_it_was() -> None:
    """Every name of ortabi's modules is ``ortabi.<name>``, the very object its module holds; state rebound after
    import (the entry library, the hot path) is read where it lives, not a copy taken at import."""
    session_options()  # installs the entry library and, with the first session, binds the hot path
    ort.InferenceSession(ops.single_op_model(ops.INFERENCE).SerializeToString(), session_options())
    package = Path(ortabi.__file__).parent
    for path in sorted(package.glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"bnfuse.runtime.ortabi.{path.stem}")
        for name in _top_level_names(path):
            assert getattr(ortabi, name) is getattr(module, name), f"ortabi.{name} is not {path.name}'s"
    assert ortabi._entry is not None and ortabi._hot is not None


def test_no_other_module_of_bnfuse_touches_ctypes() -> None:
    """The onnxruntime C ABI lives in one place: only bnfuse/runtime/ortabi imports ctypes."""
    root = Path(ortabi.__file__).parents[2]  # the bnfuse package
    users = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            imported = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(name == "ctypes" or name.startswith("ctypes.") for name in imported):
                users.add(path.relative_to(root.parent).parent.as_posix())
    assert users == {"bnfuse/runtime/ortabi"}, users
