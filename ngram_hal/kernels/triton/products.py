"""Which product each of the model's projections runs, as a sweep on one device chose it.

A projection is known by its weight's shape ``[N, K]`` (``[2N, K]`` for a fused gate/up). For a
forward of ``rows`` rows it runs either the fused Triton product in one :class:`Tiling` or the
steps apart (the norm kernel, then the vendor BLAS). In the batch-invariant mode it runs a fused
product only, every one over the same runs of K (:meth:`Tiling.k_split`, the shape's ``invariant``
tiling's): a split's partial sums round otherwise than one walk over all of K, but tilings of the
same runs can give the same bits. Where the sweep found every swept tiling of those runs
bit-identical to every other at every row count (``tilings_agree``: on NVIDIA tensor cores each
output is the same chain of 16-deep products whatever the tile, and a split's partials are added in
split order), the mode takes the fastest of them for the bucket; elsewhere one tiling for every row
count.
A QKV tiling also says where the rotary embedding and the K/V store run (``rotate``): in the
product's epilogue, or in the rotary kernel after it; the two give the same bits, so the choice may
differ by row count in either mode.
``bench/bench_products.py --write-table`` times every candidate for
the projections of the shapes it is given and writes the fastest as a :class:`ProductTable`; a
backend loads the table of its device and hands it to the model kernels in its
:class:`~ngram_hal.kernels.triton.LaunchConfig`. Shapes the table does not list keep the backend's
fixed rule (``fused_linear_rows`` and ``fused_linear_max_bytes``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

SCHEMA = "ngram-hal/product-table/1"


class Tiling(NamedTuple):
    """Rows, output columns and reduction steps of one program of the fused product, its warps and
    software-pipelining stages, the parts its reduction is split into (``split_k`` programs per
    output tile, each over a run of K; the tile's last one to finish adds their float32 partial
    sums in split order), and whether a QKV product also rotates the queries and keys and stores
    K/V (``rotate``; False: the rotary kernel does it after the product, the same bits)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    rotate: bool = True

    @property
    def label(self) -> str:
        """``MxNxK``, then ``/wW``, ``/sS`` and ``/kP`` where warps, stages and splits differ from 4, 3
        and 1, and ``/rk`` where the rotary kernel rotates."""
        warps = "" if self.num_warps == 4 else f"/w{self.num_warps}"
        stages = "" if self.num_stages == 3 else f"/s{self.num_stages}"
        splits = "" if self.split_k == 1 else f"/k{self.split_k}"
        rotary = "" if self.rotate else "/rk"
        return f"{self.block_m}x{self.block_n}x{self.block_k}{warps}{stages}{splits}{rotary}"

    def k_split(self, k: int) -> int:
        """The length of the run of a reduction of ``k`` that one program walks: ``k / split_k`` rounded
        up to whole ``block_k`` steps (``k`` where that leaves one run; the last run may be short).
        Tilings of the same runs add the same products in the same order."""
        run = _cdiv(_cdiv(k, self.split_k), self.block_k) * self.block_k
        return k if run >= k else run


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _powers_of_two(tiling: Tiling | None) -> Tiling | None:
    """``tiling`` unchanged; a ValueError where a block or the warps are not a positive power of two
    or the stages or splits not positive."""
    for name, v in zip(Tiling._fields, tiling or ()):
        if name == "rotate":
            continue
        plain_int = name in ("num_stages", "split_k")
        if v < 1 or (not plain_int and v & (v - 1)):
            raise ValueError(f"tiling {list(tiling)}: {name} must be a positive "
                             f"{'int' if plain_int else 'power of two'}, got {v}")
    return tiling


class RowsChoice(BaseModel):
    """Forwards of at most ``max_rows`` rows (and more than the previous bucket's) run ``tiling``
    (None: the steps apart); ``fused`` is the fastest fused tiling there of the invariant mode's runs
    of K (None: not swept)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_rows: int = Field(ge=1)
    tiling: Tiling | None
    fused: Tiling | None = None

    _tiling = field_validator("tiling", "fused")(_powers_of_two)


class ShapeChoice(BaseModel):
    """The choices for one weight shape: by row count, and the one tiling of the invariant mode
    where the tilings' results differ."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n: int = Field(ge=1, description="rows of the weight (2N for a fused gate/up)")
    k: int = Field(ge=1, description="the reduction length")
    by_rows: tuple[RowsChoice, ...] = Field(min_length=1)
    invariant: Tiling
    tilings_agree: bool = Field(False, description="every swept tiling of the invariant tiling's runs of K gave "
                                                   "each row the same bits at every row count")

    _invariant = field_validator("invariant")(_powers_of_two)

    @model_validator(mode="after")
    def _consistent(self) -> ShapeChoice:
        bounds = [c.max_rows for c in self.by_rows]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"weight [{self.n}, {self.k}]: by_rows bounds must increase, got {bounds}")
        runs = self.invariant.k_split(self.k)
        for c in self.by_rows:
            if c.fused is not None and c.fused.k_split(self.k) != runs:
                raise ValueError(f"weight [{self.n}, {self.k}]: the invariant mode's tilings must walk K in the same "
                                 f"runs: {c.fused.label} walks {c.fused.k_split(self.k)}, {self.invariant.label} "
                                 f"{runs}")
        return self


class ProductTable(BaseModel):
    """The products one device runs fastest, per weight shape (JSON schema :data:`SCHEMA`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_: str = Field(SCHEMA, alias="schema")
    device: str = Field(description="the device name the sweep ran on (torch.cuda.get_device_name)")
    dtype: str
    source: str = Field(description="the command and commit that wrote the table")
    shapes: tuple[ShapeChoice, ...]
    _by_shape: dict[tuple[int, int], ShapeChoice] = PrivateAttr(default_factory=dict)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: str) -> str:
        if value != SCHEMA:
            raise ValueError(f"product table schema {value!r}: expected {SCHEMA!r}")
        return value

    @model_validator(mode="after")
    def _unique(self) -> ProductTable:
        self._by_shape.update(((s.n, s.k), s) for s in self.shapes)
        if len(self._by_shape) != len(self.shapes):
            raise ValueError(f"product table for {self.device}: a weight shape is listed twice")
        return self

    def lookup(self, n: int, k: int) -> ShapeChoice | None:
        """The choices for a weight ``[n, k]``, or None where the sweep did not time it."""
        return self._by_shape.get((n, k))

    @classmethod
    def load(cls, path: str | Path) -> ProductTable:
        """Read and validate a table file; a clear ValueError names the file on a bad one."""
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"product table {path}: {exc}") from exc

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(by_alias=True, indent=1) + "\n")


def choose(choice: ShapeChoice, rows: int) -> Tiling | None:
    """The tiling for a forward of ``rows`` rows, or None (the steps apart); more rows than the
    last bucket run apart."""
    for bucket in choice.by_rows:
        if rows <= bucket.max_rows:
            return bucket.tiling
    return None


def choose_invariant(choice: ShapeChoice, rows: int) -> Tiling:
    """The batch-invariant mode's tiling for a forward of ``rows`` rows: the bucket's fastest fused
    tiling of the invariant tiling's runs of K where those tilings agree (more rows than the last
    bucket: the last bucket's), else the shape's one ``invariant`` tiling."""
    if choice.tilings_agree:
        bucket = next((b for b in choice.by_rows if rows <= b.max_rows), choice.by_rows[-1])
        if bucket.fused is not None:
            return bucket.fused
    return choice.invariant


def table_for(directory: str | Path, device_name: str) -> ProductTable | None:
    """The table among ``directory``'s ``*.json`` files swept on ``device_name``, or None."""
    for path in sorted(Path(directory).glob("*.json")):
        table = ProductTable.load(path)
        if table.device == device_name:
            return table
    return None
