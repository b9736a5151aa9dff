"""Every method kvcompress implements, by registry name."""

from __future__ import annotations

import dataclasses

from kvcompress.methods.base import MethodConfig
from kvcompress.methods.buzz import BuzzConfig
from kvcompress.methods.cascade import CascadeConfig
from kvcompress.methods.full import FullConfig
from kvcompress.methods.h2o import H2OConfig
from kvcompress.methods.h2o_oneshot import OneShotH2OConfig
from kvcompress.methods.knorm import KnormConfig
from kvcompress.methods.less import LessConfig
from kvcompress.methods.nacl import NaClConfig
from kvcompress.methods.pod import PoDConfig
from kvcompress.methods.random import RandomConfig
from kvcompress.methods.scissorhands import ScissorhandsConfig
from kvcompress.methods.scissorhands_oneshot import OneShotScissorhandsConfig
from kvcompress.methods.snapkv import SnapKVConfig
from kvcompress.methods.streaming import StreamingConfig
from kvcompress.methods.streaming_oneshot import OneShotStreamingConfig
from kvcompress.methods.tova import TOVAConfig
from kvcompress.methods.tova_oneshot import OneShotTOVAConfig
from kvcompress.methods.window import WindowConfig

METHODS: dict[str, type[MethodConfig]] = {
    config.name: config
    for config in (
        FullConfig,
        WindowConfig,
        StreamingConfig,
        CascadeConfig,
        H2OConfig,
        TOVAConfig,
        ScissorhandsConfig,
        SnapKVConfig,
        RandomConfig,
        KnormConfig,
        NaClConfig,
        OneShotH2OConfig,
        OneShotTOVAConfig,
        OneShotScissorhandsConfig,
        OneShotStreamingConfig,
        BuzzConfig,
        LessConfig,
        PoDConfig,
    )
}


def make_config(method: str | MethodConfig, **params: object) -> MethodConfig:
    """Build a method config from its registry name and parameters (or return a given config)."""
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
        for field in dataclasses.fields(METHODS[method])
    }


__all__ = ["METHODS", "MethodConfig", "make_config", "method_defaults"]
