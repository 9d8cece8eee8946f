"""The HTTP server every worker runs: an aiohttp application over the slab (``app``),
its connections, replies, metrics, tenants and run state."""
