"""eg-kv: a shared, content-addressed KV-cache block store for LLM inference fleets."""

__version__ = "0.1.0"
