"""Tables as records: :class:`TableEncoder` turns pandas DataFrames of numeric and categorical
columns into the float64 rows the attacks read, fitted on the reference (population) records
only, never on the members; :class:`TableLayout` says which columns are which, and what the
distances and densities of mixed-type records read from them. User guide: *Synthetic tables*."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privmon._validation import is_table
from privmon.estimators.density import BLOCK_ELEMENTS_CPU, BLOCK_ELEMENTS_DEVICE

__all__ = ["UNKNOWN", "TableEncoder", "TableLayout"]

UNKNOWN = ("other", "error")  # what a category the reference never shows becomes


@dataclass(frozen=True)
class TableLayout:
    """The columns of encoded records: ``n_numeric`` standardized numbers, then one integer
    code per categorical column (``levels[l]`` codes each, the last one for categories the
    reference never shows); ``ranges``: each numeric column's range over the reference, in
    standardized units (Gower's normalizer).

    Examples:
        >>> import torch
        >>> from privmon.attacks import TableLayout
        >>> layout = TableLayout(n_numeric=1, levels=(3,), ranges=(4.0,))
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
        >>> layout.euclidean(x)  # the number, then the code one-hot, scaled by 1/sqrt(2)
        tensor([[0.0000, 0.7071, 0.0000, 0.0000],
                [1.0000, 0.0000, 0.0000, 0.7071]], dtype=torch.float64)
        >>> layout.gower_min(x[:1], x[1:])  # (|0 - 1| / 4 + 1) / 2 columns
        tensor([0.6250], dtype=torch.float64)
    """

    n_numeric: int
    levels: tuple[int, ...]
    ranges: tuple[float, ...]

    @property
    def width(self) -> int:
        """Values per encoded record: the numbers and one code per categorical column."""
        return self.n_numeric + len(self.levels)

    def one_hot(self, x: torch.Tensor) -> torch.Tensor:
        """The codes of records ``x`` as one-hot blocks, (n, sum(levels))."""
        out = x.new_zeros(x.shape[0], sum(self.levels))
        if self.levels:
            sizes = torch.tensor(self.levels, device=x.device)
            out.scatter_(1, x[:, self.n_numeric :].long() + (sizes.cumsum(0) - sizes), 1.0)
        return out

    def euclidean(self, x: torch.Tensor) -> torch.Tensor:
        """Records in a space where the squared Euclidean distance adds 1 per differing
        category to the squared standardized differences of the numbers: the numbers, then
        the one-hot codes scaled by 1/√2 (what GAN-Leaks, MC and LOGAN-D1 read)."""
        if not self.levels:
            return x
        return torch.cat([x[:, : self.n_numeric], self.one_hot(x) / math.sqrt(2.0)], dim=1)

    def gower_min(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each record of ``x``'s Gower distance to its closest record of ``y``: the mean over
        columns of min(|a − b| / range, 1) for numbers and [a ≠ b] for categories, in [0, 1]
        (sdmetrics' DCR distance); in blocks of rows, one (rows, len(y)) buffer at a time."""
        q = self.n_numeric
        ranges = torch.tensor(self.ranges, dtype=x.dtype, device=x.device)
        xn, yn = x[:, :q] / ranges, y[:, :q] / ranges
        xh, yh_t = self.one_hot(x), self.one_hot(y).T.contiguous()
        n = y.shape[0]
        budget = BLOCK_ELEMENTS_CPU if x.device.type == "cpu" else BLOCK_ELEMENTS_DEVICE
        rows = max(1, budget // max(n, 1))
        out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        for s in range(0, x.shape[0], rows):
            d = len(self.levels) - xh[s : s + rows] @ yh_t  # categories that differ
            for j in range(q):
                d += (xn[s : s + rows, j, None] - yn[None, :, j]).abs_().clamp_(max=1.0)
            out[s : s + rows] = d.amin(dim=1)
        return out / self.width


class TableEncoder:
    """Encodes DataFrames for the attacks, fitted on the reference (population) records only.

    Numeric columns are standardized by the reference's mean and standard deviation;
    categorical columns become integer codes of the reference's categories, each read by the
    attacks as a category (one-hot, or the Aitchison–Aitken kernel of :class:`MixedKDE
    <privmon.estimators.MixedKDE>`), never as a number. A category the reference never shows
    is encoded as one extra level, "other", of its column (``unknown="other"``, said once per
    column with its count, never its value) or refused (``unknown="error"``). A missing value
    in a categorical column is a category of its own; in a numeric column of the reference it
    is refused (the mean and deviation would be undefined), elsewhere it encodes as NaN, which
    the attacks drop and count as for any non-finite record. Encoding a table checks its
    columns against the reference's (the same names; their order may differ).

    Args:
        reference: a non-empty DataFrame of reference records, from the population the members
            were drawn from, disjoint from the members and the held-out records.
        categorical: the columns to treat as categories; default every column whose dtype is
            not numeric (object, string, category, bool). Every other column must be numeric.
        unknown: ``"other"`` (default) or ``"error"``: what a category the reference lacks
            becomes.
        name: what messages call the table the encoder is fitted on (default ``"reference"``;
            the attacks that fit one on their synthetic set say ``"synthetic"``).

    Attributes:
        columns, numeric, categorical: the reference's column names, in the encoded order.
        name: what messages call the table the encoder was fitted on.
        layout: the :class:`TableLayout` of the encoded records.

    Examples:
        >>> import pandas as pd
        >>> from privmon.attacks import TableEncoder
        >>> reference = pd.DataFrame(
        ...     {"wage": [300.0, 500.0, 700.0, 900.0], "region": ["south", "west", "west", "south"]}
        ... )
        >>> encoder = TableEncoder(reference)
        >>> encoder.numeric, encoder.categorical, encoder.layout.levels  # 2 regions + "other"
        (['wage'], ['region'], (3,))
        >>> encoder.encode(pd.DataFrame({"region": ["west", "east"], "wage": [700.0, 300.0]}))
        tensor([[ 0.3873,  1.0000],
                [-1.1619,  2.0000]], dtype=torch.float64)
    """

    def __init__(
        self,
        reference: Any,
        *,
        categorical: Sequence[str] | None = None,
        unknown: str = "other",
        name: str = "reference",
    ) -> None:
        pd = _pandas()
        self.name = fit = name
        if not is_table(reference):
            raise TypeError(f"{fit} must be a pandas DataFrame, got {type(reference).__name__}")
        if len(reference) == 0 or reference.shape[1] == 0:
            raise ValueError(
                f"{fit} is empty ({reference.shape[0]} rows, {reference.shape[1]} columns): "
                f"the encoder is fitted on {fit} records"
            )
        if unknown not in UNKNOWN:
            raise ValueError(f"unknown must be one of {UNKNOWN}, got {unknown!r}")
        self.unknown = unknown
        names = [str(c) for c in reference.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"{fit} has duplicate column names")
        self.columns = names
        chosen = self._categorical_columns(reference, categorical, name=fit)
        self.categorical = [c for c in names if c in chosen]
        self.numeric = [c for c in names if c not in chosen]
        frame = reference.set_axis(names, axis=1)
        for c in self.numeric:
            if not pd.api.types.is_numeric_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c]):
                raise ValueError(
                    f"{fit} column {c!r} is neither numeric nor listed in categorical "
                    f"(dtype {frame[c].dtype}): list it in categorical=, or convert it to numbers"
                )
        values = frame[self.numeric].to_numpy(dtype=np.float64) if self.numeric else None
        if values is not None and not np.isfinite(values).all():
            bad = [
                c
                for c, ok in zip(self.numeric, np.isfinite(values).all(axis=0), strict=True)
                if not ok
            ]
            raise ValueError(
                f"{fit} numeric columns {bad} hold missing or infinite values: drop or "
                f"impute those records (the encoder standardizes by the {fit}'s mean and "
                "standard deviation)"
            )
        if values is not None:
            self._mean = values.mean(axis=0)
            sd = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros(len(self.numeric))
            constant = [c for c, s in zip(self.numeric, sd, strict=True) if not s > 0]
            if constant:
                raise ValueError(
                    f"{fit} numeric columns {constant} are constant: they tell no record "
                    "from another; drop them"
                )
            self._sd = sd
            ranges = (values.max(axis=0) - values.min(axis=0)) / sd
        else:
            self._mean = self._sd = np.zeros(0)
            ranges = np.zeros(0)
        self._integer = {c: pd.api.types.is_integer_dtype(frame[c]) for c in self.numeric}
        self._categories = {}
        for c in self.categorical:
            # one category is fine: "other" is its second code (a release may lack the rest)
            seen = pd.unique(frame[c].astype(object).where(frame[c].notna(), _MISSING))
            self._categories[c] = pd.Index(seen)
        self.layout = TableLayout(
            n_numeric=len(self.numeric),
            levels=tuple(len(self._categories[c]) + 1 for c in self.categorical),
            ranges=tuple(float(r) for r in ranges),
        )
        self._said: set[str] = set()

    @staticmethod
    def _categorical_columns(
        reference: Any, categorical: Sequence[str] | None, *, name: str
    ) -> set[str]:
        pd = _pandas()
        names = [str(c) for c in reference.columns]
        timed = [
            n
            for n, c in zip(names, reference.columns, strict=True)
            if pd.api.types.is_datetime64_any_dtype(reference[c])
            or pd.api.types.is_timedelta64_dtype(reference[c])
        ]
        if timed and (categorical is None or not set(timed) <= {str(c) for c in categorical}):
            raise ValueError(
                f"reference columns {timed} hold dates or durations: convert them to numbers "
                "(e.g. days since an origin), or list them in categorical="
            )
        if categorical is None:
            return {
                n
                for n, c in zip(names, reference.columns, strict=True)
                if not pd.api.types.is_numeric_dtype(reference[c])
                or pd.api.types.is_bool_dtype(reference[c])
            }
        if isinstance(categorical, str):
            raise TypeError("categorical must be a sequence of column names, not one string")
        listed = [str(c) for c in categorical]
        missing = [c for c in listed if c not in names]
        if missing:
            raise ValueError(f"categorical names columns {missing} that {name} does not have")
        return set(listed)

    def encode(self, table: Any, *, name: str = "table") -> torch.Tensor:
        """``table``'s records as a float64 (n, n_numeric + n_categorical) CPU tensor: the
        standardized numbers, then the category codes (:class:`TableLayout`); ``name`` names
        the table in errors. Its columns must be the reference's (any order)."""
        pd = _pandas()
        if not is_table(table):
            raise TypeError(f"{name} must be a pandas DataFrame, got {type(table).__name__}")
        names = [str(c) for c in table.columns]
        missing = [c for c in self.columns if c not in names]
        extra = [c for c in names if c not in self.columns]
        if missing or extra or len(set(names)) != len(names):
            twice = ", duplicated names" if len(set(names)) != len(names) else ""
            raise ValueError(
                f"{name}'s columns differ from the {self.name}'s: missing {missing}, not in the "
                f"{self.name} {extra}{twice}"
            )
        frame = table.set_axis(names, axis=1)
        out = np.empty((len(frame), self.layout.width), dtype=np.float64)
        for j, c in enumerate(self.numeric):
            try:
                col = pd.to_numeric(frame[c], errors="raise").to_numpy(dtype=np.float64)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{name}'s column {c!r} is numeric in the {self.name} but holds values that "
                    "are not numbers"
                ) from None
            out[:, j] = (col - self._mean[j]) / self._sd[j]
        for j, c in enumerate(self.categorical, start=len(self.numeric)):
            values = frame[c].astype(object).where(frame[c].notna(), _MISSING)
            codes = self._categories[c].get_indexer(values)
            unseen = codes < 0
            if unseen.any():
                self._unseen(c, int(unseen.sum()), name=name)
                codes = np.where(unseen, len(self._categories[c]), codes)
            out[:, j] = codes
        return torch.from_numpy(out)

    def decode(self, x: Any) -> Any:
        """Encoded records (numbers, then codes; a tensor or an array) back to a DataFrame of the
        reference's columns and order: numbers unstandardized (rounded where the reference's
        column holds integers), codes to their categories; the "other" level and the missing
        category become missing values.

        Examples:
            >>> import pandas as pd
            >>> from privmon.attacks import TableEncoder
            >>> reference = pd.DataFrame({"age": [20, 40, 60], "smoker": ["no", "yes", "no"]})
            >>> encoder = TableEncoder(reference)
            >>> encoder.decode(encoder.encode(reference.iloc[:2]))
               age smoker
            0   20     no
            1   40    yes
        """
        pd = _pandas()
        values = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if values.ndim != 2 or values.shape[1] != self.layout.width:
            raise ValueError(
                f"x must have shape (n, {self.layout.width}) (the encoded width), got "
                f"{tuple(values.shape)}"
            )
        columns: dict[str, Any] = {}
        for j, c in enumerate(self.numeric):
            column = values[:, j] * self._sd[j] + self._mean[j]
            whole = self._integer[c] and np.isfinite(column).all()
            columns[c] = np.rint(column).astype(np.int64) if whole else column
        for j, c in enumerate(self.categorical, start=len(self.numeric)):
            labels = np.array([*self._categories[c], None], dtype=object)  # "other": missing
            codes = np.clip(np.rint(values[:, j]).astype(np.int64), 0, len(labels) - 1)
            column = labels[codes]
            column[np.array([v is _MISSING for v in column], dtype=bool)] = None
            columns[c] = column
        return pd.DataFrame({c: columns[c] for c in self.columns})

    def _unseen(self, column: str, count: int, *, name: str) -> None:
        if self.unknown == "error":
            raise ValueError(
                f"{name}'s column {column!r} holds {count} value(s) that are not among the "
                f"{self.name}'s categories (unknown='error'; unknown='other' encodes them as one "
                "extra category)"
            )
        if column not in self._said:
            self._said.add(column)
            warnings.warn(
                f"column {column!r}: {count} value(s) of {name} are not among the {self.name}'s "
                "categories; they are encoded as one extra category, 'other' (said once per "
                "column)",
                UserWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(numeric={self.numeric!r}, categorical={self.categorical!r})"


class _Missing:
    """The category of a missing value (NaN, None, pd.NA) in a categorical column."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "tables need pandas: pip install 'privmon[synthetic]' (or pip install pandas)"
        ) from None
    return pandas
