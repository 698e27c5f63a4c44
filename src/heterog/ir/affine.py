"""Quantities that grow linearly with the batch, so one capture serves every batch size."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Affine:
    """fixed + per_sample × batch. FLOPs, bytes and times of an op at any batch share."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def scaled(self, factor: float) -> Affine:
        return Affine(self.fixed * factor, self.per_sample * factor)

    @staticmethod
    def fit(batch_a: float, value_a: float, batch_b: float, value_b: float) -> Affine:
        """The line through two measurements (e.g. a capture at batch b and at 2b)."""
        assert batch_a != batch_b
        per_sample = (value_b - value_a) / (batch_b - batch_a)
        return Affine(value_a - per_sample * batch_a, per_sample)

    def to_json(self) -> list[float]:
        return [float(self.fixed), float(self.per_sample)]

    @staticmethod
    def from_json(value: object) -> Affine:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"expected [fixed, per_sample] numbers, found {value!r}")
        return Affine(float(value[0]), float(value[1]))


ZERO = Affine()
