"""CI's LMCache guard (``scripts/bench_lmcache.py --guard``): its verdict on the figures
the benchmark measured. The measuring itself is the real ``lmcache bench l2`` and runs in
``.ci/run``; here its samples are given, so each rule of the verdict is checked alone: a
real drop fails, the noise of one slow run does not, and only a shape below the bar is
measured again."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(30)


def _script():
    path = ROOT / "scripts" / "bench_lmcache.py"
    loader = importlib.machinery.SourceFileLoader("_bench_lmcache_guard", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


bench = _script()
NAMES = ["eg-kv", "baseline"]
FIRST, SECOND = bench.SHAPES  # "16 x 14 MiB", "1,024 x 64 KiB"
OPS = [*bench.OPS, "Lookup-long"]


def samples(**per_run: list[float]) -> dict:
    """Three runs of every cell at 1,000 for the baseline and the same for eg-kv, but for
    the cells named ``<shape index>_<op>`` (e.g. ``s0_Load``): eg-kv at those ratios."""
    out = {}
    for i, shape in enumerate(bench.SHAPES):
        for op in OPS:
            ratios = per_run.get(f"s{i}_{op.replace('-', '_')}", [1.0, 1.0, 1.0])
            out[("eg-kv", shape, op)] = [1000.0 * r for r in ratios]
            out[("baseline", shape, op)] = [1000.0] * len(ratios)
    return out


class Again:
    """The guard's second measurement: the given ratios for the cells asked again."""

    def __init__(self, **per_run: list[float]) -> None:
        self.per_run, self.asked = per_run, []

    def __call__(self, shapes: list[str]) -> dict:
        self.asked.append(shapes)
        every = samples(**self.per_run)
        return {key: figures for key, figures in every.items() if key[1] in shapes}


def test_a_cell_that_dropped_fails_after_its_shape_is_measured_again(capsys):
    again = Again(s1_Load=[0.5, 0.45, 0.55])
    assert bench.guard(samples(s1_Load=[0.5, 0.6, 0.4]), NAMES, 0.7, again) == 1
    assert again.asked == [[SECOND]]  # that shape only
    assert "load (ops/s), 1,024 x 64 KiB: 0.50x the baseline" in capsys.readouterr().out


def test_one_slow_run_pair_does_not_fail_when_the_shape_measured_again_holds():
    # Two slow pairs of three, then three normal ones: the median of the six is 0.97.
    again = Again(s0_Lookup_long=[1.0, 0.95, 1.0])
    figures = samples(s0_Lookup_long=[0.6, 0.65, 1.0])
    assert bench.guard(figures, NAMES, 0.7, again) == 0
    assert again.asked == [[FIRST]]
    assert len(figures[("eg-kv", FIRST, "Lookup-long")]) == 6


def test_cells_are_judged_by_their_runs_ratios_not_the_ratio_of_medians():
    # A CI run's long 16-key lookups: eg-kv 50,489 82,105 47,648 against 70,209 92,222
    # 74,641: the ratio of the medians is 0.68, each run's 0.72 0.89 0.64 (median 0.72).
    shape = FIRST
    figures = samples()
    figures[("eg-kv", shape, "Lookup-long")] = [50489.0, 82105.0, 47648.0]
    figures[("baseline", shape, "Lookup-long")] = [70209.0, 92222.0, 74641.0]
    again = Again()
    assert bench.guard(figures, NAMES, 0.7, again) == 0
    assert again.asked == []


def test_the_three_round_lookups_are_left_to_the_long_runs():
    again = Again()
    assert bench.guard(samples(s0_Lookup=[0.3, 0.3, 0.3]), NAMES, 0.7, again) == 0
    assert again.asked == []


def test_every_judged_cell_is_printed_with_its_verdict(capsys):
    assert bench.guard(samples(s0_Store=[0.9, 0.9, 0.9]), NAMES, 0.7, Again()) == 0
    out = capsys.readouterr().out
    judged = [line for line in out.splitlines() if line.startswith("guard: ")]
    assert len(judged) == 2 * 3  # per shape: load, store and the long lookups
    assert "guard: store (ops/s), 16 x 14 MiB: 0.90x the baseline" in out
    assert all("at least 0.7" in line for line in judged)
