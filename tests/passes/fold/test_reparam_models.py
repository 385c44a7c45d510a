"""Real re-parameterizable timm models (the ``oracle`` extra): `optimize` on the eval-mode training-form export
reaches the deploy form (``timm.utils.model.reparameterize_model``): no more Conv and BatchNormalization than the
deploy export, every merge proven by ``--check``, outputs within 1e-4 of PyTorch. bench/bench_reparam.py measures
the families at full size, with latency."""

from __future__ import annotations

import copy
import importlib.util
import io
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

if not all(importlib.util.find_spec(m) for m in ("torch", "torchvision", "timm")):
    pytest.skip("needs the oracle extra (torch, torchvision, timm)", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench import archs  # noqa: E402
from bnfuse.passes.optimize import optimize  # noqa: E402
from tests.loaders import bench_module  # noqa: E402

RTOL = 1e-4
# small inputs keep the exports fast: repvgg (dense 3x3 + 1x1 + identity BN, stride-2 blocks), mobileone (k=4
# over-parameterized depthwise branches, scale branches), fastvit (RepMixer's layer scale over a difference,
# large-kernel + small-kernel pairs, RepCPE)
CASES = {"repvgg_a0": 64, "mobileone_s0": 64, "fastvit_t8": 64}


def export(net, side: int) -> onnx.ModelProto:  # noqa: ANN001
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 3, side, side),), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])  # fmt: skip
    return onnx.load_from_string(buffer.getvalue())


def conv_and_bn(model: onnx.ModelProto) -> tuple[int, int]:
    ops = Counter(n.op_type for n in model.graph.node)
    return ops["Conv"], ops["BatchNormalization"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_optimize_reaches_the_deploy_form(name: str) -> None:
    archs.import_torchvision()  # before timm (see bench/archs.py)
    import torch
    from timm.utils.model import reparameterize_model

    side = CASES[name]
    net = bench_module("bench_reparam").randomize_batchnorms(archs.create(name, classes=10))
    raw, deploy = export(net, side), export(reparameterize_model(copy.deepcopy(net)), side)
    optimized, report = optimize(raw, check=True)
    conv, bn = conv_and_bn(optimized)
    deploy_conv, deploy_bn = conv_and_bn(deploy)
    assert conv <= deploy_conv and bn <= deploy_bn, (conv, bn, deploy_conv, deploy_bn)
    assert conv_and_bn(raw)[0] > conv and report.merges and all(m.status == "merged" for m in report.merges)
    assert report.check is not None and report.check.passed
    assert all(f.outcome == "ok" for f in report.check.folds if f.status == "merged")
    x = np.random.default_rng(0).standard_normal((1, 3, side, side)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy().astype(np.float64)
    session = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0].astype(np.float64)
    assert float(np.max(np.abs(got - want))) <= RTOL * float(np.max(np.abs(want)))
