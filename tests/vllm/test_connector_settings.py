"""The connector's and the tier's options: both split them with one rule (url is
base_url; their own keys; the client's keywords), and name the component in errors."""

from __future__ import annotations

import pytest

from eg_kv.errors import ConfigError
from eg_kv.vllm.settings import settings_from
from eg_kv.vllm.tier_settings import tier_settings_from

pytestmark = pytest.mark.timeout(30)
URL = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("build", "who"),
    [(settings_from, "EgKvConnector"), (tier_settings_from, "EgKvTier")],
)
def test_unknown_and_doubled_keys_are_refused_by_name(build, who):
    with pytest.raises(ConfigError, match=rf"^{who}.*unknown key 'urll'; known: .*base_url"):
        build({"urll": URL}, env={})
    with pytest.raises(ConfigError, match=rf"^{who}.*'base_url' is given twice"):
        build({"url": URL, "base_url": URL}, env={})


@pytest.mark.parametrize(
    ("build", "who"),
    [(settings_from, "EgKvConnector"), (tier_settings_from, "EgKvTier")],
)
def test_a_token_in_the_config_vllm_logs_is_refused_without_naming_it(build, who):
    """vLLM logs ``kv_connector_extra_config`` in its start-up ``non-default args`` line:
    a token there (once accepted) was printed verbatim. Environment only."""
    with pytest.raises(ConfigError, match=rf"^{who}.*EPISTEMIC_GRAPH_KVCACHE_TOKEN") as err:
        build({"url": URL, "token": "s3cret-t0ken"}, env={})
    assert "s3cret" not in str(err.value)
    env = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "s3cret-t0ken"}
    assert build({"url": URL}, env=env).client.token == "s3cret-t0ken"


def test_url_is_base_url_and_own_keys_stay_out_of_the_client():
    connector = settings_from({"url": URL, "io_threads": 2, "timeout_s": 3}, env={})
    assert (connector.client.base_url, connector.io_threads, connector.client.timeout_s) == (
        URL,
        2,
        3,
    )
    tier = tier_settings_from({"url": URL, "max_lookup_batches": 2}, env={})
    assert (tier.client.base_url, tier.max_lookup_batches) == (URL, 2)
