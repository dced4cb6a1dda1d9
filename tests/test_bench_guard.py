"""The step guard of scripts/bench_throughput.py (recsys/bench/guard.py): the recorded figures read
from docs/benchmarks.md, a move named with where it lies, a record written back."""

import pytest

from recsys.bench import guard

pytestmark = pytest.mark.unit


def summary(rate: float, **parts: float) -> dict:
    step = {"rows_in": 0.0, "data": 0.1, "compute": 10.0, "rows_out": 0.0, "after": 0.1, **parts}
    return {"throughput_after_warmup_samples_per_s": rate, "throughput_samples_per_s": rate, "step_ms": step}


def test_the_repository_doc_holds_a_guard_table_every_figure_of_which_is_known():
    was, when = guard.recorded()
    assert when.startswith("Recorded ")
    keys = {k for k, _ in guard.FIGURES}
    assert was and set(was) <= keys
    assert float(was["tier.compute"]) > 0


def test_a_slower_tier_on_the_same_host_is_named_as_the_tiers_own_step(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\n{guard.BEGIN}\nold\n{guard.END}\n\nafter\n")
    kernels = {"fused": 2.0, "tier": 4.0}
    was = guard.figures(summary(100_000), summary(60_000, rows_out=3.0), kernels)
    guard.record(was, doc)
    text = doc.read_text()
    assert text.startswith("# B\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    back, when = guard.recorded(doc)
    assert back == was and "Recorded " in when
    now = guard.figures(summary(100_000), summary(48_000, rows_out=6.5), kernels)
    lines = guard.compare(back, now)
    assert "guard: tier.rows_out 6.50 ms against 3.00 recorded (+117%)" in lines
    assert any(line.startswith("guard: tier.samples_per_s 48,000.00") for line in lines)
    assert lines[-1] == "guard: the tier's own step moved (tier.rows_out)"


def test_a_faster_fused_engine_on_another_host_is_named_as_such():
    was = guard.figures(summary(70_000, compute=15.0), summary(63_000), {"fused": 8.25, "tier": 3.4})
    was["host"] = "an older CPU"
    now = guard.figures(summary(100_000, compute=9.8), summary(63_500), {"fused": 1.83, "tier": 3.5})
    lines = guard.compare(was, now)
    assert lines[-1].startswith(f"guard: another host ({now['host']} against an older CPU); the fused engine moved")
    assert "kernel.fused" in lines[-1] and "local.compute" in lines[-1] and "the tier's own step" not in lines[-1]
    quiet = guard.compare(now, dict(now))
    assert quiet == ["guard: every part within the margins of the recorded figures"]


def test_a_malformed_guard_row_names_the_file_and_line(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text(f"x\n{guard.BEGIN}\n| `tier.compute` | 10.0 |\n{guard.END}\n")
    with pytest.raises(ValueError, match=r"b\.md:3: a step guard row has 3 cells"):
        guard.recorded(doc)


def test_the_kernels_alone_are_measured_in_a_process_of_their_own():
    got = guard.kernel_ms(steps=3)
    assert set(got) == {"fused", "tier"}
    assert all(0 < v < 1000 for v in got.values())
