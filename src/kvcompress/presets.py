"""Parameter presets: one argument that sets a method's parameters to another library's defaults.

``preset="kvpress"`` gives the methods kvcompress shares with NVIDIA's kvpress (0.5.5) the settings of the kvpress
press they correspond to, so ``cache_for(model, "snapkv", preset="kvpress", budget=512)`` keeps the tokens
``SnapKVPress`` keeps. kvpress compresses the context once, after its prefill, and appends while decoding, so only
one-shot settings have a counterpart:

==================  ==========================================  =====================================================
kvpress press       kvcompress method                           what the preset sets
==================  ==========================================  =====================================================
StreamingLLMPress   ``streaming_oneshot``                       ``position_mode="original"`` (no re-indexing), 4 sinks
SnapKVPress         ``snapkv``                                  ``window=64, kernel=5, pooling="avg"``
TOVAPress           ``tova_oneshot``                            nothing (the defaults are kvpress's)
KnormPress          ``knorm``                                   ``one_shot=True, recent=0`` (norm only, prompt once)
KeyDiffPress        ``keydiff``                                 nothing (the defaults are kvpress's)
ExpectedAttention…  ``expected_attention``                      nothing (the defaults are kvpress's)
CompactorPress      ``compactor``                               nothing (the defaults are kvpress's; a fixed sketch)
KVzipPress          ``kvzip``                                   nothing (``allocation="global"``: kvpress's default)
==================  ==========================================  =====================================================

kvpress's wrappers are parameters here: ``PyramidKVPress`` is ``snapkv`` with the preset and
``allocation="pyramid"`` (``beta=20``), ``AdaKVPress(press)`` is the press's method with ``allocation="adakv"``
(``alpha_safeguard=0.2``), ``KVzipPress(layerwise=True)`` is ``kvzip`` with ``allocation="layer"``.

kvpress's ``compression_ratio=c`` is the share *removed*: pass ``ratio=1 - c`` (kvcompress keeps
``max(1, floor(ratio * n))`` of ``n`` prompt tokens, kvpress ``int(n * (1 - c))``) or a token ``budget``.
Parameters given beside the preset override it.
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "kvpress": {
        "streaming_oneshot": {"position_mode": "original", "sinks": 4},
        "snapkv": {"window": 64, "kernel": 5, "pooling": "avg"},
        "tova_oneshot": {},
        "knorm": {"one_shot": True, "recent": 0},
        "keydiff": {},
        "expected_attention": {},
        "compactor": {},
        "kvzip": {},
    },
}


def preset_params(preset: str, method: str) -> dict[str, object]:
    """The parameters ``preset`` gives ``method``; ``ValueError`` naming what is allowed otherwise."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(sorted(PRESETS))}; got {preset!r}")
    methods = PRESETS[preset]
    if method not in methods:
        raise ValueError(
            f"preset {preset!r} has no settings for method {method!r}; it covers {', '.join(methods)} "
            "(the methods with a counterpart there)"
        )
    return dict(methods[method])
