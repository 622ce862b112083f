"""The plugin point: other rpcdist modules (RRefs, tensors) teach the codec their types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import ConfigError, RpcdistError, SerializationError
from ._extensions import (
    DECODERS,
    ENCODERS,
    FINDERS,
    FIRST_PLUGIN,
    MARKS,
    PLUGINS,
    DecodeState,
    EncodeState,
    forget_found,
    unknown_code,
)

__all__ = ["register_extension", "register_family", "register_variant", "unregister_extension"]


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
    _check_code(code, cls)
    for other, (other_code, _) in PLUGINS.items():
        if other is cls and other_code != code:
            raise ConfigError(f"{cls.__qualname__} already has extension code {other_code}")
    handle, rebuild = _handlers(
        code, f"{cls.__qualname__} (extension code {code})", encoder, decoder
    )
    forget_found()
    PLUGINS[cls] = (code, handle)
    ENCODERS[cls] = handle
    DECODERS[code] = rebuild


#: Extensions not registered for a class (families, variants): code -> owner.
_FAMILIES: dict[int, object] = {}
#: The encoding handlers of variants, by code.
_VARIANTS: dict[int, Any] = {}


def register_variant(
    code: int,
    encoder: Callable[[Any, Any], Any],
    decoder: Callable[[Any, Any], Any],
    label: str,
    owner: object,
) -> Any:
    """An extension that another encoder hands values to (torch's sparse
    tensors, from the tensor encoder), rather than one found by type:
    registers ``code``'s decoder and returns the encoding handler
    (``handler(state, value)``). Idempotent for the same ``owner``.

    Raises:
        ConfigError: ``code`` is out of range or taken.
    """
    if _FAMILIES.get(code) is owner and code in _VARIANTS:
        return _VARIANTS[code]
    _check_code(code, owner)
    handle, rebuild = _handlers(code, f"{label} (extension code {code})", encoder, decoder)
    _FAMILIES[code] = owner
    _VARIANTS[code] = handle
    DECODERS[code] = rebuild
    return handle


def register_family(
    accepts: Callable[[object], bool],
    code: int,
    encoder: Callable[[Any, Any], Any],
    decoder: Callable[[Any, Any], Any],
    label: str,
) -> None:
    """:func:`register_extension` for the values ``accepts(value)`` recognises,
    of many classes with no common base to register (torch's 75 return types).
    Idempotent for the same ``accepts``.

    Raises:
        ConfigError: ``code`` is out of range or taken.
    """
    if _FAMILIES.get(code) is accepts:
        return
    handle = register_variant(code, encoder, decoder, label, accepts)

    def find(obj: object) -> Any:
        return handle if accepts(obj) else None

    FINDERS.append(find)


def _check_code(code: int, owner: object) -> None:
    if type(code) is not int or not FIRST_PLUGIN <= code < len(DECODERS):
        raise ConfigError(f"extension code must be an int in 32..63, got {code!r}")
    for other, (other_code, _) in PLUGINS.items():
        if other_code == code and other is not owner:
            raise ConfigError(f"extension code {code} is already used by {other.__qualname__}")
    if code in _FAMILIES and _FAMILIES[code] is not owner:
        raise ConfigError(f"extension code {code} is already used by a family of classes")


def _handlers(
    code: int, label: str, encoder: Callable[[Any, Any], Any], decoder: Callable[[Any, Any], Any]
) -> tuple[Any, Any]:
    """The codec's encode handler and decoder for a plugin's ``encoder``/``decoder``."""
    mark = MARKS[code]

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

    return handle, rebuild


def unregister_extension(cls: type) -> None:
    """Forget the extension registered for ``cls`` (for tests and reloads)."""
    entry = PLUGINS.pop(cls, None)
    if entry is None:
        return
    forget_found()
    ENCODERS.pop(cls, None)
    DECODERS[entry[0]] = unknown_code
