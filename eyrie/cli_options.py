"""A command's options made from a pydantic model's fields: `--field-name`, the field's type,
description, default and bounds; what was given reaches the command as one dict, which it
validates with the model once (so the options declare no second list of defaults)."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Optional

import typer
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo


def model_options(model: type[BaseModel], into: str):
    """Replace the command's parameter `into` by one option per field of `model`; the command
    gets `into` as {field: value} of the options given."""
    def decorate(func):
        signature = inspect.signature(func, eval_str=True)
        params = []
        for param in signature.parameters.values():
            params += _parameters(model) if param.name == into else [param]

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in model.model_fields}
            return func(*args, **kwargs, **{into: {k: v for k, v in given.items() if v is not None}})

        wrapper.__signature__ = signature.replace(parameters=params)
        return wrapper
    return decorate


def _parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_option(field),
                              annotation=Optional[_base_type(field.annotation)])
            for name, field in model.model_fields.items()]


def _option(field: FieldInfo):
    """typer's option: None unless given (the model's default applies), the bounds click checks."""
    bounds: dict = {}
    for rule in field.metadata:
        if isinstance(rule, (Ge, Gt)):  # gt as a closed min: the model refuses the bound itself, one line
            bounds["min"] = getattr(rule, "ge", getattr(rule, "gt", None))
        elif isinstance(rule, Le):
            bounds["max"] = rule.le
    default = "" if field.default is None else f" (default {field.default})"
    return typer.Option(None, help=(field.description or "").rstrip(".") + f"{default}.", **bounds)


def _base_type(annotation):
    """int | None -> int: typer takes the optional itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return annotation
