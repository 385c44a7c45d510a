"""bnfuse.SGDStep and bnfuse.AdamStep: a training graph's whole optimizer update as one node (CPU, float32).

The standard-ONNX update (bnfuse/passes/training/optimizers.py) takes 3-12 elementwise nodes per parameter, each
a pass over memory and a kernel launch; a ResNet's step runs ~250 of them. These ops take every parameter at
once: one variadic float32 input list, one variadic output list, the per-parameter hyperparameters as attributes.

    SGDStep(lr, p_1, g_1[, buf_1], ..., p_n, g_n[, buf_n]) -> (p_1'[, buf_1'], ..., p_n'[, buf_n'])
        attributes: momentum, nesterov, weight_decays[n], lr_scales[n]  (momentum 0: no buffers)
    AdamStep(step_size, root, p_1, g_1, m_1, v_1, ...) -> (p_1', m_1', v_1', ...)
        step_size = lr / (1 - beta1^t), root = sqrt(1 - beta2^t); attributes beta1, beta2, epsilon,
        weight_decays[n], lr_scales[n]

Both compute in float32 in the order of the standard nodes, one rounding per node, and so give their bits. They are
defined, created and computed by the native library only (bnfuse/runtime/native/optimizer_ops.c); their schema
(attributes and defaults) is :data:`bnfuse.runtime.schema.SGD_STEP` / ``ADAM_STEP``.
"""

from __future__ import annotations

from bnfuse.runtime import schema

DOMAIN = schema.DOMAIN
SGD_STEP = schema.SGD_STEP.name
ADAM_STEP = schema.ADAM_STEP.name
OP_NAMES = (SGD_STEP, ADAM_STEP)
