"""The methods: simple baselines one module each, multi-part methods one package each.

Each module defines a frozen config (the paper's defaults, validated on construction) and the per-layer policy it
builds. Nothing is imported here: ``kvcompress.registry`` loads a method's module when its name is looked up.
"""
