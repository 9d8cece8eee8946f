"""The disk tier under the slab (``eg-kv serve --disk DIR``): evicted blocks stay on disk,
come back on a hit, and survive a restart. docs/disk.md says how; its modules, from the
bottom: :mod:`layout` (the file's bytes), :mod:`files` (the directory, its lock, aligned
I/O), :mod:`index` (where each record lies), :mod:`store` and :mod:`scan` (the keeper's
writes and the rebuild at start), :mod:`keeper` (the process that spills and answers),
:mod:`wire` (its socket), :mod:`reader` and :mod:`tier` (a worker's side).
"""
