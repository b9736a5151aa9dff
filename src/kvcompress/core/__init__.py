"""The core every method builds on: the method contract, the cache layer and cache, the attention function,
selection and validation helpers, and RoPE helpers. Nothing in ``core`` imports a method."""
