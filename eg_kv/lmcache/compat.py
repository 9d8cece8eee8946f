"""The LMCache names the in-engine plugin uses, from where the installed LMCache keeps them.

LMCache 0.5.7 moved its in-process engine under ``lmcache.inprocess.*``: ``RemoteMetadata``
(the chunk header) left ``lmcache.v1.protocol`` for ``lmcache.inprocess.v1.protocol``. An
import that fails inside a plugin is not an error a user sees: LMCache logs it, leaves the
backend out and vLLM recomputes every prefix. So every LMCache name :mod:`.remote` and
:mod:`.adapter` need is imported here once, the 0.5.7 place first and 0.5.6's second;
``tests/lmcache`` run against both releases (``scripts/setup-lmcache057``).
"""

from __future__ import annotations

# These did not move between 0.5.6 and 0.5.7rc2.
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

try:  # LMCache 0.5.7 and later
    from lmcache.inprocess.v1.protocol import RemoteMetadata
except ImportError:  # LMCache 0.5.6
    from lmcache.v1.protocol import RemoteMetadata

__all__ = [
    "CacheEngineKey",
    "ConnectorAdapter",
    "ConnectorContext",
    "MemoryObj",
    "RemoteConnector",
    "RemoteMetadata",
    "extract_plugin_type",
]
