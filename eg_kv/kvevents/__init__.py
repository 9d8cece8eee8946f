"""KV events for routers: the server's event log as vLLM's ZMQ KV-events stream
(:mod:`eg_kv.kvevents.publisher`, in vLLM's format: :mod:`eg_kv.kvevents.wire`).
docs/events.md says how llm-d, Dynamo and a vLLM-style subscriber consume it."""
