"""The base of every section of a run config (and of the settings a stage takes): strict, and
only values the store and Redis can hold."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf would be stored as null

    @field_validator("*")
    @classmethod
    def _fits_64_bits(cls, value):
        """Integers beyond 64 bits cannot be stored (JSON in the store, Redis)."""
        if any(isinstance(x, int) and abs(x) >= 2**63 for x in (value if isinstance(value, list) else [value])):
            raise ValueError("must be below 2**63")
        return value

    def given(self) -> dict:
        """The settings asked for, by name (not the defaults)."""
        return {name: getattr(self, name) for name in type(self).model_fields if name in self.model_fields_set}
