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

from bnfuse.errors import ModelError
from bnfuse.io import Staging, load_model, ort_compatible, read_mapped, save_model
from bnfuse.passes.optimize import ProgressCallback, _optimize, optimize, prove, reset_training_batchnorms
from bnfuse.passes.report import Report
from bnfuse.protowire import WireFormatError, write_model


def optimize_file(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    json_path: str | os.PathLike[str] | None = None,
    standalone: str = "keep",
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
    options = {"standalone": standalone, "full_check": full_check, "progress": progress}
    checks = {"input_shapes": input_shapes, "seed": seed, "tolerance": tolerance}
    mapped = read_mapped(source)
    if mapped is None:
        model, report = optimize(source, check=check, **options, **checks)
        extra = {Path(json_path): report.to_json().encode()} if json_path else {}
        save_model(model, output, external_data=report.external_data, extra_files=extra)
        return report

    skeleton, payloads = mapped
    optimized, report = _optimize(skeleton, str(source), False, check=False, payloads=payloads, **options, **checks)
    ort_compatible(optimized)
    staging = Staging()
    try:
        written = staging.stage(output)
        try:
            write_model(optimized, payloads, written)
        except WireFormatError as exc:  # grown past one protobuf's 2 GiB: rare, since the input fitted
            raise ModelError(f"{output}: cannot write the optimized model ({exc})") from exc
        del optimized, skeleton, payloads, mapped  # written: the folded weights need not outlive the check
        if check:  # prove the file as written against the input file, both read by onnxruntime itself
            original: Path | onnx.ModelProto = source
            if any(r.reset_from_training for r in report.batchnorms):  # compare with the input in inference mode
                original, _ = reset_training_batchnorms(load_model(source, check=False))
            prove(original, written, report, **checks)
        if json_path:
            staging.stage(Path(json_path)).write_bytes(report.to_json().encode())
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return report
