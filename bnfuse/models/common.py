"""Options every builder shares (batch, size, width, seed, opset, dtype) and their validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from bnfuse.errors import BnfuseError
from bnfuse.models.builder import DEFAULT_OPSET, GraphBuilder

BATCH_DIM = "batch"  # name of the dynamic batch dimension when no batch size is fixed


@dataclass(frozen=True)
class Options:
    """batch: fixed batch size, or None for a dynamic ``batch`` dimension; size: input length / height /
    width; width: channel multiplier (1.0 = the published network)."""

    batch: int | None
    size: int
    width: float
    seed: int = 0
    opset: int = DEFAULT_OPSET
    dtype: str = "float32"

    def check(self, model: str, *, min_size: int, multiple: int = 1) -> Options:
        if self.batch is not None and self.batch < 1:
            raise BnfuseError(f"{model}: batch must be >= 1 (or omitted for a dynamic batch), got {self.batch}")
        if self.size < min_size or self.size % multiple:
            rule = f" and a multiple of {multiple}" if multiple > 1 else ""
            raise BnfuseError(f"{model}: size must be >= {min_size}{rule}, got {self.size}")
        if not 0 < self.width <= 16:
            raise BnfuseError(f"{model}: width must be in (0, 16], got {self.width}")
        return self

    @property
    def batch_dim(self) -> int | str:
        return BATCH_DIM if self.batch is None else self.batch

    def builder(self, name: str, spatial_dims: int = 2) -> GraphBuilder:
        return GraphBuilder(name, opset=self.opset, dtype=self.dtype, seed=self.seed, spatial_dims=spatial_dims)

    def metadata(self, model: str, **extra: object) -> dict[str, object]:
        fields = {k: ("dynamic" if v is None else v) for k, v in asdict(self).items()}
        return {"bnfuse.model": model, **{f"bnfuse.{k}": v for k, v in {**fields, **extra}.items()}}
