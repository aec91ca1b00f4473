"""`key=value` overrides, each value typed by the field it sets. No JAX import."""

import dataclasses
import math
import types
import typing
from collections.abc import Mapping

from configs.settings import ModelConfig, RunConfig


class ConfigError(ValueError):
    """Bad experiment name, override or combination: reported as one line, exit status 2."""


def parse_overrides(args: list[str]) -> dict[str, str]:
    if bad := [arg for arg in args if "=" not in arg or arg.startswith("=")]:
        raise ConfigError(f"expected key=value, got {bad[0]!r}")
    return dict(arg.split("=", 1) for arg in args)


def _coerce(key: str, text: str, kind):
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if text.lower() == "none" and type(None) in options:
        return None
    for option in (o for o in options if o is not type(None)):
        if option is bool:
            if text.lower() in ("true", "1", "yes", "false", "0", "no"):
                return text.lower() in ("true", "1", "yes")
        elif option in (int, float, str):
            try:
                value = option(text)
            except ValueError:
                continue
            if option is float and not math.isfinite(value):
                raise ConfigError(f"{key}={text!r}: must be a finite number")
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{key}={text!r}: expected {names}")


# Keys a run took before they were renamed: their error names the new key.
RENAMED = {"policy": "preset"}


def _set(obj, path: list[str], text: str, full_key: str):
    """A copy of dataclass `obj` with the field at `path` set from `text`, typed by the field."""
    name, known = path[0], [f.name for f in dataclasses.fields(obj)]
    if new := RENAMED.get(full_key):
        raise ConfigError(f"unknown key {full_key!r}: it is {new}= now ({new}={text})")
    if name not in known:
        raise ConfigError(f"unknown key {full_key!r}; {type(obj).__name__} has {', '.join(known)}")
    value, kind = getattr(obj, name), typing.get_type_hints(type(obj))[name]
    if typing.get_origin(kind) is Mapping:
        if len(path) != 2:
            raise ConfigError(f"{full_key}: write {name}.<key>=<value>")
        return dataclasses.replace(obj, **{name: {**value, path[1]: text}})
    if dataclasses.is_dataclass(value):
        if len(path) == 1 and text.lower() == "none" and type(None) in typing.get_args(kind):
            return dataclasses.replace(obj, **{name: None})  # an optional group turned off
        if len(path) == 1:
            raise ConfigError(f"{full_key} is a group; set one of its fields, e.g. "
                              f"{full_key}.{dataclasses.fields(value)[0].name}=...")
        return dataclasses.replace(obj, **{name: _set(value, path[1:], text, full_key)})
    if len(path) > 1:
        raise ConfigError(f"unknown key {full_key!r}: {name} has no sub-fields")
    return dataclasses.replace(obj, **{name: _coerce(full_key, text, kind)})


def apply_overrides(model: ModelConfig, run: RunConfig, overrides: Mapping[str, str]):
    """`model.<field>=`, `placement.<tag>=` and run fields, each value typed by its field."""
    for key, text in overrides.items():
        path = key.split(".")
        if path[0] == "model" and len(path) > 1:
            model = _set(model, path[1:], text, key)
        elif path[0] == "placement" and len(path) in (2, 3):  # .<tag>, .<scan>.<tag>
            run = _set(run, ["tag_changes", ".".join(path[1:])], text, key)
        else:
            run = _set(run, path, text, key)
    return model, run
