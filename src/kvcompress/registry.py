"""Every method kvcompress implements, by registry name, loaded lazily.

``METHODS`` maps a name to its config class, importing the method's module only when the name is looked up, so
``import kvcompress`` (or building a cache of one method) loads no other method. Adding a method is one module (or
package) under ``kvcompress.methods`` plus one line in ``_LOCATIONS``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping

from kvcompress.core.contract import MethodConfig, method_fields
from kvcompress.presets import preset_params

# name -> "module:ConfigClass", in the order ``kvcompress methods`` lists them
_LOCATIONS: dict[str, str] = {
    "full": "kvcompress.methods.full:FullConfig",
    "window": "kvcompress.methods.window:WindowConfig",
    "streaming": "kvcompress.methods.streaming:StreamingConfig",
    "cascade": "kvcompress.methods.cascade:CascadeConfig",
    "h2o": "kvcompress.methods.h2o:H2OConfig",
    "tova": "kvcompress.methods.tova:TOVAConfig",
    "scissorhands": "kvcompress.methods.scissorhands:ScissorhandsConfig",
    "snapkv": "kvcompress.methods.snapkv:SnapKVConfig",
    "random": "kvcompress.methods.random:RandomConfig",
    "knorm": "kvcompress.methods.knorm:KnormConfig",
    "nacl": "kvcompress.methods.nacl:NaClConfig",
    "h2o_oneshot": "kvcompress.methods.h2o_oneshot:OneShotH2OConfig",
    "tova_oneshot": "kvcompress.methods.tova_oneshot:OneShotTOVAConfig",
    "scissorhands_oneshot": "kvcompress.methods.scissorhands_oneshot:OneShotScissorhandsConfig",
    "streaming_oneshot": "kvcompress.methods.streaming_oneshot:OneShotStreamingConfig",
    "buzz": "kvcompress.methods.buzz:BuzzConfig",
    "less": "kvcompress.methods.less:LessConfig",
    "pod": "kvcompress.methods.pod:PoDConfig",
    "keydiff": "kvcompress.methods.keydiff:KeyDiffConfig",
    "expected_attention": "kvcompress.methods.expected_attention:ExpectedAttentionConfig",
    "kvzip": "kvcompress.methods.kvzip:KVzipConfig",
    "compactor": "kvcompress.methods.compactor:CompactorConfig",
    "periodic": "kvcompress.methods.periodic:PeriodicConfig",
    "duo": "kvcompress.methods.duo:DuoConfig",
}


class _LazyMethods(Mapping[str, type[MethodConfig]]):
    """A read-only mapping name -> config class that imports a method's module on first lookup."""

    def __getitem__(self, name: str) -> type[MethodConfig]:
        module, _, attribute = _LOCATIONS[name].partition(":")
        return getattr(importlib.import_module(module), attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(_LOCATIONS)

    def __len__(self) -> int:
        return len(_LOCATIONS)

    def __contains__(self, name: object) -> bool:
        return name in _LOCATIONS


METHODS: Mapping[str, type[MethodConfig]] = _LazyMethods()


def make_config(method: str | MethodConfig, preset: str | None = None, **params: object) -> MethodConfig:
    """Build a method config from its registry name and parameters (or return a given config).

    ``preset`` (e.g. ``"kvpress"``, see ``kvcompress.presets``) fills in another library's settings first; the
    parameters given override them. A method with a ``preset`` parameter of its own (NaCl's paper/official
    settings) takes the value as that parameter."""
    own_class = type(method) if isinstance(method, MethodConfig) else METHODS.get(method)
    if preset is not None and own_class is not None and "preset" in {f.name for f in dataclasses.fields(own_class)}:
        params, preset = {"preset": preset, **params}, None
    if preset is not None:
        params = {**preset_params(preset, method if isinstance(method, str) else method.name), **params}
    if isinstance(method, MethodConfig):
        if params:
            return dataclasses.replace(method, **params)
        return method
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}; got {method!r}")
    config_class = METHODS[method]
    known = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"its parameters are {', '.join(sorted(known)) or 'none'}"
        )
    return config_class(**params)


def method_defaults(method: str) -> dict[str, object]:
    """The documented default of every parameter of a method (``None`` where the user must choose)."""
    return {
        field.name: field.default if field.default is not dataclasses.MISSING else None
        for field in method_fields(METHODS[method])
    }


__all__ = ["METHODS", "MethodConfig", "make_config", "method_defaults"]
