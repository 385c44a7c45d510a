"""The training pass: inference model -> training graph (forward in training mode, loss, backward, optimizer step).

``build_training_graph(model) -> (model, TrainingReport)``; ``export_inference_model(train_model, state)``
turns trained state back into the inference model, which ``bnfuse.optimize`` folds.
"""

from bnfuse.passes.training.build import build_training_graph
from bnfuse.passes.training.export import export_inference_model
from bnfuse.passes.training.optimizers import SGD, Adam
from bnfuse.passes.training.report import TrainingReport
from bnfuse.passes.training.spec import TrainingSpec, read_spec

__all__ = [
    "SGD",
    "Adam",
    "TrainingReport",
    "TrainingSpec",
    "build_training_graph",
    "export_inference_model",
    "read_spec",
]
