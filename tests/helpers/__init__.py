"""Helpers the test folders share: plain functions and classes, never fixtures.

Fixtures live in ``conftest.py`` files (``tests/conftest.py`` for every folder,
``tests/<folder>/conftest.py`` for one folder's own); test modules import helpers from
here (``from helpers.common import wait_for``), never from another test module or from a
``conftest.py``. pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml).
"""
