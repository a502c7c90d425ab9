"""A command's options made from a pydantic model's fields: `--field-name` (or the field's
`flag`), the field's type, description, default and bounds; what was given reaches the command as
one dict, which it validates with the model once (`checked`), so the options declare no second
list of defaults."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Optional

import typer
from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from eyrie.core.errors import EyrieError


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
            given = {name: kwargs.pop(name) for name in _cli_fields(model)}
            return func(*args, **kwargs, **{into: {k: v for k, v in given.items() if v is not None}})

        wrapper.__signature__ = signature.replace(parameters=params)
        return wrapper
    return decorate


def checked(model: type[BaseModel], given: dict):
    """The options given, validated by the model its run.yaml section and the API use (64-bit
    integers, finite numbers, ranges, choices): one line naming each bad option."""
    try:
        return model(**given)
    except ValidationError as exc:
        bad = "; ".join(f"--{flag(model, str(e['loc'][0]))} {str(e.get('input'))[:40]}: {e['msg']}"
                        for e in exc.errors())
        raise EyrieError(f"invalid {bad}.", "correct these options (eyrie COMMAND --help).") from None


def flag(model: type[BaseModel], name: str) -> str:
    """The option's name without its dashes: the field's `flag`, else the field's name."""
    field = model.model_fields.get(name)
    extra = (field.json_schema_extra if field else None) or {}
    return extra.get("flag") or name.replace("_", "-")


def _cli_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {name: field for name, field in model.model_fields.items()
            if ((field.json_schema_extra or {}).get("cli", True))}


def _parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_option(model, name, field),
                              annotation=Optional[_base_type(field.annotation)])
            for name, field in _cli_fields(model).items()]


def _option(model: type[BaseModel], name: str, field: FieldInfo):
    """typer's option: None unless given (the model's default applies), the bounds click checks."""
    bounds: dict = {}
    for rule in field.metadata:
        if isinstance(rule, (Ge, Gt)):  # gt as a closed min: the model refuses the bound itself, one line
            bounds["min"] = getattr(rule, "ge", getattr(rule, "gt", None))
        elif isinstance(rule, Le):
            bounds["max"] = rule.le
    required = field.is_required()
    return typer.Option(... if required else None, f"--{flag(model, name)}",
                        help=(field.description or "").rstrip(".") + f"{_default_text(field, required)}.", **bounds)


def _default_text(field: FieldInfo, required: bool) -> str:
    """' (default X)' for --help; nothing where there is none (a factory's empty list included)."""
    value = None if required else field.get_default(call_default_factory=True)
    if isinstance(value, list):
        value = ",".join(map(str, value)) or None  # given as `a,b,c`
    return "" if value is None else f" (default {value})"


def _base_type(annotation):
    """int | None -> int (typer takes the optional itself); a list (given as `a,b,c`) or a
    Literal is text the model reads."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (list, typing.Literal):
        return str
    return annotation
