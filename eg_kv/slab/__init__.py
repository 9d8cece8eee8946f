"""The slab: one POSIX shared-memory segment every worker maps.

``layout`` (the byte layout), ``view`` (the read side every mapping shares) and ``local``
(a client's read-only mapping on the server's host) import the standard library and
``xxhash`` only: clients import them. ``store`` and the modules under it (``posix_ipc``)
are the server's. This package's ``__init__`` imports nothing, so a client never loads the store.
"""
