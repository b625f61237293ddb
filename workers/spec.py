"""Callback specs from a command line or a config file.

A spec is a built-in name (`LRMonitor`), an import path (`pkg.mod:Class`), either
optionally called with Python literals: `EarlyStopper(monitor="MulticlassAccuracy",
dataloader_label="eval", patience=2)`. Arguments are read with `ast.literal_eval`:
numbers, strings, booleans, None, lists, tuples and dicts of those; never evaluated.

A spec is still code: `pkg.mod:Class` imports `pkg.mod` (running whatever it runs on
import) and builds the class. It must name a Callback class — not a function such as
`os:system` — but a config file of specs deserves the trust a script does.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import Any

__all__ = ["SpecError", "parse_spec", "build_callback", "load_config"]


class SpecError(ValueError):
    """A callback spec or config file that cannot be turned into callbacks."""


def parse_spec(spec: str) -> tuple[str, list[Any], dict[str, Any]]:
    """`'Name(a, k=v)'` -> ('Name', [a], {'k': v}); the name may be 'pkg.mod:Class'."""
    spec = spec.strip()
    cut = spec.find("(")
    head, call = (spec, "") if cut < 0 else (spec[:cut].strip(), spec[cut:])
    if not head:
        raise SpecError(f"callback spec {spec!r} has no name")
    if not call:
        return head, [], {}
    try:
        tree = ast.parse("f" + call, mode="eval").body
    except SyntaxError as exc:
        raise SpecError(f"callback spec {spec!r} is not a call with literal arguments: {exc.msg}") from None
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise SpecError(f"callback spec {spec!r} must look like Name(arg, key=value)")
    try:
        args = [ast.literal_eval(node) for node in tree.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords if kw.arg}
    except ValueError:
        raise SpecError(f"callback spec {spec!r}: arguments must be Python literals "
                        "(numbers, strings, True/False/None, lists, tuples, dicts)") from None
    if any(kw.arg is None for kw in tree.keywords):
        raise SpecError(f"callback spec {spec!r}: **kwargs is not allowed")
    return head, args, kwargs


def resolve(name: str) -> type:
    """A built-in callback class by name, or any class by 'pkg.mod:Class'."""
    from offloop.workers.callbacks import BUILTINS

    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SpecError(f"cannot import {module_name!r} for callback {name!r}: {exc}") from None
        try:
            found = getattr(module, attr)
        except AttributeError:
            raise SpecError(f"module {module_name!r} has no {attr!r}") from None
        from offloop.workers.callback import Callback

        if not (isinstance(found, type) and issubclass(found, Callback)):
            raise SpecError(f"{name} is {'the class ' + found.__name__ if isinstance(found, type) else 'a ' + type(found).__name__}, "
                            "not a Callback class: a spec names a subclass of offloop's Callback")
        return found
    if name in BUILTINS:
        import offloop.workers.callbacks as builtins

        try:
            return getattr(builtins, name)
        except ImportError as exc:
            raise SpecError(f"built-in callback {name} cannot be loaded: {exc}") from None
    raise SpecError(f"unknown callback {name!r}: use a built-in ({', '.join(sorted(BUILTINS))}) "
                    "or an import path 'pkg.mod:Class'")


def build_callback(spec: str | dict) -> Any:
    """An instance from a spec string or a config entry {"name": ..., "args": {...}}."""
    if isinstance(spec, dict):
        if "name" not in spec:
            raise SpecError(f"callback entry {spec!r} has no 'name'")
        name, args, kwargs = spec["name"], list(spec.get("positional", [])), dict(spec.get("args", {}))
    else:
        name, args, kwargs = parse_spec(spec)
    cls = resolve(name)
    try:
        return cls(*args, **kwargs)
    except TypeError as exc:
        raise SpecError(f"{name}: {exc}") from None


def callbacks_from(specs: list[str], config_path: str | None) -> tuple[dict[str, Any], list]:
    """The config file's callbacks, then the command line's, built in that order."""
    config = load_config(config_path) if config_path else {}
    specs = list(config.get("callbacks", [])) + list(specs)
    if not specs:
        raise SpecError("no callbacks given: name at least one, or pass --config")
    return config, [build_callback(spec) for spec in specs]


def load_config(path: str | Path) -> dict[str, Any]:
    """A worker config file (JSON, or TOML on Python 3.11+): {"callbacks": [...], ...}."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read config {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            config = tomllib.loads(text)
        else:
            config = json.loads(text)
    except (ValueError, ImportError) as exc:
        raise SpecError(f"config {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("callbacks", []), list):
        raise SpecError(f"config {path} must be an object with a 'callbacks' list")
    return config
