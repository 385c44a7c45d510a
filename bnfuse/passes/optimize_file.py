"""File to file: ``optimize_file(source, output)``, the path `bnfuse optimize` takes.

When the input is one plain protobuf file, its weights are never copied into Python: they stay in a
read-only memory map, the fold reads them there, and the output is written from the map and from the
new arrays directly (bnfuse.protowire). Other inputs (external data, over 2 GiB) go through ``optimize``
and ``save_model``. Either way the written model is the one ``optimize`` returns for the same input,
``--check`` proves the file as written, and model and JSON report are committed together or not at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
from onnx import external_data_helper

from bnfuse.errors import ModelError
from bnfuse.io import (
    Staging,
    check_destinations,
    exceeds_protobuf_limit,
    load_model,
    ort_compatible,
    read_mapped,
    read_model_files,
    require_regular_file,
    save_model,
)
from bnfuse.passes.optimize import ProgressCallback, optimize_model, prove, reset_training_batchnorms
from bnfuse.passes.report import Report
from bnfuse.protowire import WireFormatError, write_external, write_model
from bnfuse.tensorcheck import check_strings, check_tensors


def optimize_file(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    json_path: str | os.PathLike[str] | None = None,
    standalone: str = "keep",
    activation_moves: bool = True,
    check: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    tolerance: float | None = None,
    full_check: bool = False,
    progress: ProgressCallback | None = None,
) -> Report:
    """Fold the model at ``source`` and write it to ``output`` (and the report to ``json_path``); see optimize.

    Raises what ``optimize`` raises (ModelError, CheckFailedError with ``.report``), and OSError when a
    file cannot be written; nothing is left behind then.
    """
    source, output = Path(source), Path(output)
    json_target = Path(json_path) if json_path is not None else None
    data_target = output.with_name(f"{output.name}.data")
    options = {
        "standalone": standalone,
        "activation_moves": activation_moves,
        "full_check": full_check,
        "progress": progress,
    }
    checks = {"input_shapes": input_shapes, "seed": seed, "tolerance": tolerance}
    require_regular_file(source)
    mapped = read_mapped(source)
    if mapped is None:
        model, files = read_model_files(source, check=False)
    else:
        files = [source.resolve()]
    destinations = {"output model": output, "JSON report": json_target}
    check_destinations(destinations, files, possible={"output's data file": data_target})
    if mapped is None:
        original_external = len(files) > 1
        optimized, report = optimize_model(model, str(source), original_external, check=check, **options, **checks)
        report.external_data = original_external or exceeds_protobuf_limit(optimized)
        report.external_data_reason = "input" if original_external else ("2 GiB" if report.external_data else "")
        extra = {json_target: report.to_json().encode()} if json_target else {}
        save_model(optimized, output, external_data=original_external, extra_files=extra)
        return report

    skeleton, payloads = mapped
    check_strings(skeleton, what=str(source))
    check_tensors(skeleton, what=str(source))
    optimized, report = optimize_model(
        skeleton, str(source), False, check=False, payloads=payloads, **options, **checks
    )
    ort_compatible(optimized)
    staging = Staging()
    try:
        written = staging.stage(output)
        try:
            write_model(optimized, payloads, written)
        except WireFormatError:  # grown past one protobuf's 2 GiB (expanded constants): external data instead
            report.external_data, report.external_data_reason = True, "2 GiB"
            data = staging.stage(data_target)
            try:  # named after the temporary data file until the check has read it
                write_external(optimized, payloads, written, data, location=data.name)
            except WireFormatError as exc:
                raise ModelError(f"{output}: cannot write the optimized model ({exc})") from exc
        payloads.clear()  # the new weights are in the file now; the check reads them from there
        del skeleton, payloads, mapped  # nor need the input's map outlive the write
        if check:  # prove the file as written against the input file: onnxruntime maps both, one at a time
            original: Path | onnx.ModelProto = source
            if any(r.reset_from_training for r in report.batchnorms):  # compare with the input in inference mode
                original, _ = reset_training_batchnorms(load_model(source, check=False))
            prove(original, written, report, **checks)
        if report.external_data:
            _rename_location(optimized, written, data.name, data_target.name)
        if json_target is not None:
            staging.stage(json_target).write_bytes(report.to_json().encode())
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return report


def _rename_location(model: onnx.ModelProto, path: Path, old: str, new: str) -> None:
    """Rewrite the (weight-less) model file at ``path`` with its external-data location ``old`` renamed ``new``."""
    for tensor in external_data_helper._get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new
    path.write_bytes(model.SerializeToString())
