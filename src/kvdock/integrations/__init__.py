"""Engine integrations: thin adapters between inference engines and kvdock.

- :mod:`kvdock.integrations.hf` — HuggingFace transformers (``DynamicCache`` ↔ ``KV_2LTD``,
  registration, prefix-cached ``generate``).
- :mod:`kvdock.integrations.rope` — re-rotating stored keys to new positions (RoPE).

Integrations use only the public SDK (:mod:`kvdock.sdk`); importing this package imports no engine.
"""
