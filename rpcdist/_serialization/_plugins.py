"""The plugin point: other rpcdist modules (RRefs, tensors) teach the codec their types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import ConfigError, RpcdistError, SerializationError
from ._extensions import (
    DECODERS,
    ENCODERS,
    FIRST_PLUGIN,
    MARKS,
    PLUGINS,
    DecodeState,
    EncodeState,
    forget_found,
    unknown_code,
)

__all__ = ["register_extension", "unregister_extension"]


def register_extension(
    cls: type,
    code: int,
    encoder: Callable[[Any, Any], Any],
    decoder: Callable[[Any, Any], Any],
) -> None:
    """Teach the codec a type owned by another rpcdist module.

    ``encoder(obj, context)`` returns any encodable structure (arrays in it go
    out-of-band); ``decoder(structure, context)`` rebuilds the value. Instances
    of subclasses of ``cls`` use the same extension unless they have their own.

    Args:
        cls: The type to handle.
        code: Extension code, 32..63 (0..31 are the codec's own).
        encoder: ``(value, context) -> structure``.
        decoder: ``(structure, context) -> value``.

    Raises:
        ConfigError: ``code`` is out of range or taken by another class, or
            ``cls`` already has another code.
    """
    if not isinstance(cls, type):
        raise ConfigError(f"register_extension expects a class, got {cls!r}")
    if type(code) is not int or not FIRST_PLUGIN <= code < len(DECODERS):
        raise ConfigError(f"extension code must be an int in 32..63, got {code!r}")
    for other, (other_code, _) in PLUGINS.items():
        if other_code == code and other is not cls:
            raise ConfigError(f"extension code {code} is already used by {other.__qualname__}")
        if other is cls and other_code != code:
            raise ConfigError(f"{cls.__qualname__} already has extension code {other_code}")
    mark = MARKS[code]
    label = f"{cls.__qualname__} (extension code {code})"

    def handle(state: EncodeState, obj: object) -> list[Any]:
        payload = encoder(obj, state.context)
        state.remember(obj, payload)
        return [mark, payload]

    def rebuild(state: DecodeState, items: list[Any]) -> object:
        if len(items) != 2:
            raise SerializationError(f"malformed payload for {label}")
        try:
            return decoder(items[1], state.context)
        except RpcdistError:
            raise
        except Exception as exc:
            raise SerializationError(f"cannot decode {label}: {exc}") from exc

    forget_found()
    PLUGINS[cls] = (code, handle)
    ENCODERS[cls] = handle
    DECODERS[code] = rebuild


def unregister_extension(cls: type) -> None:
    """Forget the extension registered for ``cls`` (for tests and reloads)."""
    entry = PLUGINS.pop(cls, None)
    if entry is None:
        return
    forget_found()
    ENCODERS.pop(cls, None)
    DECODERS[entry[0]] = unknown_code
