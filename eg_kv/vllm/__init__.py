"""vLLM's own KV connector backed by eg-kv: ``EgKvConnector`` (a ``KVConnectorBase_V1``).

Load it in vLLM by module path::

    KVTransferConfig(kv_connector="EgKvConnector",
                     kv_connector_module_path="eg_kv.vllm.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"url": "http://127.0.0.1:9130"})

Importing this package needs no vLLM: :mod:`eg_kv.vllm.addresses` (the block addresses)
and :mod:`eg_kv.vllm.settings` (the connector's settings) are plain Python; only
:mod:`eg_kv.vllm.connector` imports vLLM and torch.
"""

from __future__ import annotations

from .addresses import FORMAT_VERSION, BlockFormat, block_addresses, token_chain

__all__ = ["FORMAT_VERSION", "BlockFormat", "block_addresses", "token_chain"]
