"""Seeded distributions for every size and time in a workload spec.

Every size (tokens, turns, steps) and time (think time, tool latency) in a spec is a distribution, so a spec
can state "tool outputs are lognormal with median 292" or "use the empirical quantiles of the real trace"
with one syntax. A bare number is a constant. All sampling goes through a ``numpy.random.Generator`` handed
in by the caller, so a spec plus a seed always yields the same values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

_BASE = ConfigDict(extra="forbid", frozen=True)


class _Dist(BaseModel):
    model_config = _BASE
    min: float | None = Field(default=None, description="clip samples below this value")
    max: float | None = Field(default=None, description="clip samples above this value")

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        """``n`` float samples, clipped to [min, max]."""
        x = np.asarray(self._raw(rng, n), dtype=np.float64)
        if self.min is not None or self.max is not None:
            x = np.clip(x, self.min if self.min is not None else -np.inf, self.max if self.max is not None else np.inf)
        return x

    def sample_int(self, rng: np.random.Generator, n: int = 1, scale: float = 1.0, low: int = 0) -> np.ndarray:
        """Integer samples (for token counts), multiplied by ``scale`` then rounded, never below ``low``."""
        return np.maximum(np.rint(self.sample(rng, n) * scale), low).astype(np.int64)

    def mean(self) -> float:
        """Monte-Carlo mean with a fixed seed; used in docs/stats, never for generation."""
        return float(self.sample(np.random.default_rng(12345), 20000).mean())


class Constant(_Dist):
    kind: Literal["constant"] = "constant"
    # every quantity a spec draws (token counts, turns, think and tool times) is non-negative; a negative
    # constant used to be clipped to 0 silently
    value: float = Field(ge=0)

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value)


class Uniform(_Dist):
    kind: Literal["uniform"]
    low: float
    high: float

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.high < self.low:
            raise ValueError("high must be >= low")
        return self

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.low, self.high, n)


class Normal(_Dist):
    kind: Literal["normal"]
    mean_: float = Field(alias="mean")
    std: float = Field(ge=0)
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.normal(self.mean_, self.std, n)


class LogNormal(_Dist):
    """Log-normal given by its median (``exp(mu)``) and ``sigma`` of the underlying normal."""

    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(np.log(self.median), self.sigma, n)


class Zipf(_Dist):
    """Values 1..n with P(k) proportional to k^-a (a = 0 is uniform): ranks, popularity, small counts."""

    kind: Literal["zipf"]
    a: float = Field(ge=0)
    n: int = Field(default=1000, ge=1)

    def probabilities(self) -> np.ndarray:
        p = np.arange(1, self.n + 1, dtype=np.float64) ** -self.a
        return p / p.sum()

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.arange(1, self.n + 1), size=n, p=self.probabilities()).astype(np.float64)


class Empirical(_Dist):
    """Samples drawn from data: raw ``values`` (resampled), ``quantiles`` (evenly spaced in probability,
    interpolated: a compact way to store a fitted distribution in YAML) or a ``file`` of numbers (one per
    line, or a JSON list; relative paths are relative to the spec file)."""

    kind: Literal["empirical"]
    values: list[float] | None = None
    quantiles: list[float] | None = None
    file: str | None = None
    base_dir: str | None = Field(default=None, exclude=True, description="set by the spec loader")

    @model_validator(mode="after")
    def _check(self) -> "Empirical":
        given = [x is not None for x in (self.values, self.quantiles, self.file)]
        if sum(given) != 1:
            raise ValueError("give exactly one of values, quantiles, file")
        if self.values is not None and not self.values:
            raise ValueError("values must not be empty")
        if self.quantiles is not None:
            if len(self.quantiles) < 2:
                raise ValueError("quantiles needs at least 2 values")
            if any(b < a for a, b in zip(self.quantiles, self.quantiles[1:])):
                raise ValueError("quantiles must be non-decreasing")
        return self

    def _data(self) -> np.ndarray:
        if self.values is not None:
            return np.asarray(self.values, dtype=np.float64)
        path = Path(self.file)  # type: ignore[arg-type]
        if not path.is_absolute() and self.base_dir:
            path = Path(self.base_dir) / path
        text = path.read_text()
        if text.lstrip().startswith("["):
            return np.asarray(json.loads(text), dtype=np.float64)
        return np.asarray([float(x) for x in text.split() if x.strip()], dtype=np.float64)

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.quantiles is not None:
            q = np.asarray(self.quantiles, dtype=np.float64)
            return np.interp(rng.uniform(0, 1, n), np.linspace(0, 1, len(q)), q)
        data = self._data()
        return data[rng.integers(0, len(data), n)]


Distribution = Annotated[
    Union[Constant, Uniform, Normal, LogNormal, Zipf, Empirical], Field(discriminator="kind")
]
DISTRIBUTION_KINDS = ("constant", "uniform", "normal", "lognormal", "zipf", "empirical")


def coerce_distribution(value: Any) -> Any:
    """Spec shorthand: a bare number means ``{kind: constant, value: N}``; a dict without kind too."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"kind": "constant", "value": value}
    if isinstance(value, dict) and "kind" not in value and set(value) <= {"value", "min", "max"}:
        return {"kind": "constant", **value}
    return value
