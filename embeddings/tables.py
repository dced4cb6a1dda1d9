"""Table specs: what the store needs to know about each embedding table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from embeddings.errors import UnknownTableError


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    ``init_scale`` is the half-width of the uniform init; ``None`` means torchrec's default
    for ``EmbeddingBagConfig``, ``sqrt(1 / num_rows)``.
    """

    name: str
    num_rows: int
    dim: int
    feature_names: tuple[str, ...] = field(default=())
    init_scale: float | None = None

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name:
            raise ValueError(f"table name {self.name!r} must be non-empty and contain no ':'")
        if self.num_rows <= 0:
            raise ValueError(f"table {self.name!r}: num_rows={self.num_rows} must be > 0")
        if self.dim <= 0:
            raise ValueError(f"table {self.name!r}: dim={self.dim} must be > 0")
        if not self.feature_names:
            object.__setattr__(self, "feature_names", (self.name,))

    @property
    def scale(self) -> float:
        return self.init_scale if self.init_scale is not None else math.sqrt(1.0 / self.num_rows)


class TableSet:
    """An ordered set of tables; a table's index is its position (used in keys and shard maps)."""

    def __init__(self, tables: Iterable[TableSpec]) -> None:
        self.specs: tuple[TableSpec, ...] = tuple(tables)
        if not self.specs:
            raise ValueError("at least one table is required")
        self._index = {t.name: i for i, t in enumerate(self.specs)}
        if len(self._index) != len(self.specs):
            names = [t.name for t in self.specs]
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate table names: {dup}")

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.specs]

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise UnknownTableError(name, self.names) from None

    def spec(self, name: str) -> TableSpec:
        return self.specs[self.index(name)]

    @classmethod
    def from_torchrec(cls, configs) -> TableSet:
        """Build from a list of ``torchrec.EmbeddingBagConfig``."""
        return cls(
            TableSpec(
                name=c.name,
                num_rows=c.num_embeddings,
                dim=c.embedding_dim,
                feature_names=tuple(c.feature_names),
            )
            for c in configs
        )
