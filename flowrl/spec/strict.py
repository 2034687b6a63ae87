"""The base of every file schema (pipeline, device inventory, fault scenario)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Frozen, refuses unknown keys, and refuses a value of another type instead of
    converting it: ``lr: yes`` is YAML's true, which lax validation would take as 1.0, and
    ``n='4'`` from Python would become 4. An int still stands for a float. No number is NaN or
    infinite (``weight: .nan`` made every reward NaN and trained nothing, without a word)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, strict=True,
                              allow_inf_nan=False)

    def changed_fields(self) -> set[str]:
        """Fields whose value is not their default (a default written out changes nothing:
        ``PipelineGraph.to_dict`` writes every field)."""
        return {name for name, field in type(self).model_fields.items()
                if not field.is_required() and getattr(self, name) != field.get_default(call_default_factory=True)}
