"""The clients: one server or a server set, sync (standard library only) or async
(aiohttp), sharing one core of rules (``core``)."""
