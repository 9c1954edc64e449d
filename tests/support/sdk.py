"""Checks of a body against the official ``openai`` SDK's types: what a strict client would make of it."""

from __future__ import annotations

from pydantic import BaseModel


def no_unknown_fields(model: BaseModel) -> None:
    """Every key of the body is a field of the SDK's model, at every depth: a strict parser reads it too."""
    assert not model.model_extra, model.model_extra
    for value in model.__dict__.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                no_unknown_fields(item)
