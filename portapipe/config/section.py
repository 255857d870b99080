"""What every configuration section is: a pydantic model that refuses unknown keys, inf and nan,
and a value of the wrong kind (:mod:`.kinds`) in one line."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from .kinds import kind_problem


class Section(BaseModel):
    # inf / nan in a numeric key are refused: `lr: .inf` would train to NaN silently.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _kinds(cls, v: Any, info: Any) -> Any:
        field = cls.model_fields.get(info.field_name)
        problem = None if field is None else kind_problem(field.annotation, v)
        if problem:
            raise ValueError(problem)
        return v

