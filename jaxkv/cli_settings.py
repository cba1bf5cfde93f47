"""Command-line flags generated from the engine settings (`jaxkv.config`): one flag per field,
``--page-size`` for ``page_size``, its help the field's docstring, its default the field's.

So a new setting is one documented field, and `jaxkv serve` (and the benches) take it with
nothing else to write.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection

from jaxkv.config import config_fields


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(hint):
    """int for ``int | None``, and so on (the non-None member of an optional)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_engine_arguments(parser: argparse.ArgumentParser, *,
                         only: Collection[str] | None = None,
                         skip: Collection[str] = ()) -> list[str]:
    """Adds a flag for each setting (those in ``only`` if given, none in ``skip``); returns
    the setting names added, for `engine_settings`."""
    added = []
    group = parser.add_argument_group("engine settings (jaxkv.config)")
    for cls, field, doc in config_fields():
        name = field.name
        if (only is not None and name not in only) or name in skip:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        hint = _scalar_type(typing.get_type_hints(cls)[name])
        help_text = " ".join(doc.split()).replace("%", "%%") or None
        if hint is bool:
            group.add_argument(flag(name), dest=name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif field.metadata.get("cli") in ("devices", "json"):
            group.add_argument(flag(name), dest=name, default=None,
                               metavar="IDS" if field.metadata["cli"] == "devices" else "JSON",
                               help=help_text)
        else:
            group.add_argument(flag(name), dest=name, default=default, type=hint,
                               choices=field.metadata.get("choices"),
                               help=f"{help_text} (default: %(default)s)")
        added.append(name)
    return added


def engine_settings(args: argparse.Namespace, names: Collection[str]) -> dict:
    """The flat settings (``LLM(**settings)``) of the flags ``names``; device flags become
    device lists, each side's tensor-parallel size its device count unless given."""
    settings = {name: getattr(args, name) for name in names}
    for side in ("prefill", "decode"):
        text = settings.get(f"{side}_devices")
        if text is not None:
            settings[f"{side}_devices"] = _devices(side, text)
            key = f"{side}_tensor_parallel_size"
            if settings.get(key) is None:
                settings[key] = len(settings[f"{side}_devices"])
    if (settings.get("prefill_devices") is None) != (settings.get("decode_devices") is None):
        raise ValueError("--prefill-devices and --decode-devices go together: pass both")
    return settings


def _devices(side: str, text: str) -> list:
    import jax

    devices = jax.devices()
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--{side}-devices: expected device indices like 0,1, got "
                         f"{text!r}") from None
    bad = [i for i in ids if not 0 <= i < len(devices)]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(f"--{side}-devices: {text!r} must list distinct indices in "
                         f"[0, {len(devices)})")
    return [devices[i] for i in ids]
