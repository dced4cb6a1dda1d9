"""The step guard of ``scripts/bench_throughput.py``: today's step parts beside the last recorded ones.

A drop in the tier's ratio to torchrec's fused engine has two kinds of cause: the tier's step got
slower (the code), or the fused engine got faster (the host: another CPU, other kernels). The ratio
alone cannot tell them apart. The guard prints, beside the figures recorded last in
``docs/benchmarks.md`` (its "step guard" table):

- the host: the CPU's model and whether it has AVX-512 (fbgemm's host kernels have code for it);
- the embedding kernels alone (``scripts/bench_kernels.py``, one thread): fbgemm's TBE with the
  row-wise Adagrad update fused, and the tier's own step over the batch's unique rows;
- the fused engine inside the project's loop, and the tier's goal configuration (1 trainer,
  2 shards, defaults): samples/s and ``step_ms``'s parts.

Each part that moved by more than a fifth (and 0.5 ms, or 5% of samples/s) is named in one line, and a
closing line says where the move lies: in the tier's own parts, in the fused engine, or on another
host. ``--record-guard`` writes today's figures as the new recorded ones.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- step guard: begin (scripts/bench_throughput.py --record-guard writes it; every invocation reads it) -->"
END = "<!-- step guard: end -->"
PARTS = ("rows_in", "data", "compute", "rows_out", "after")
# (name in the table, what it is); the samples/s rows are compared as rates, the others as ms
FIGURES = (
    ("host", "the CPU"),
    ("kernel.fused", "kernels alone: fbgemm TBE, row-wise Adagrad fused (ms/step, 1 thread)"),
    ("kernel.tier", "kernels alone: the tier's step over the unique rows (ms/step, 1 thread)"),
    ("local.samples_per_s", "fused engine in the project's loop: samples/s"),
    *((f"local.{p}", f"fused engine in the project's loop: {p} (ms/step)") for p in PARTS),
    ("tier.samples_per_s", "tier, 1 trainer, 2 shards, defaults: samples/s"),
    *((f"tier.{p}", f"tier, 1 trainer, 2 shards, defaults: {p} (ms/step)") for p in PARTS),
)


def host() -> str:
    """The CPU's model name, and ``avx512`` where it has AVX-512F (from /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    avx = flags is not None and "avx512f" in flags.group(1).split()
    return f"{model.group(1).strip() if model else 'unknown'}{' (avx512)' if avx else ''}"


def kernel_ms(steps: int = 100) -> dict[str, float]:
    """``scripts/bench_kernels.py --threads 1`` in a process of its own: -> {"fused": ms, "tier": ms}
    (the tier's default kernels, fbgemm's TBE forward and dense backward)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--steps", str(steps), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"scripts/bench_kernels.py failed: {out.stderr.strip().splitlines()[-1:]}")
    got: dict[str, float] = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] == "1":
            if cells[0].startswith("fbgemm TBE"):
                got["fused"] = float(cells[2])
            elif "--kernels fbgemm" in cells[0]:
                got["tier"] = float(cells[2])
    return got


def figures(local: dict, tier: dict, kernels: dict[str, float]) -> dict[str, str]:
    """Today's figures: ``local`` and ``tier`` are the runs' ``summary.json``."""
    now = {"host": host()}
    for k, v in kernels.items():
        now[f"kernel.{k}"] = f"{v:.2f}"
    for name, s in (("local", local), ("tier", tier)):
        now[f"{name}.samples_per_s"] = (
            f"{s['throughput_after_warmup_samples_per_s'] or s['throughput_samples_per_s']:.0f}"
        )
        for p in PARTS:
            now[f"{name}.{p}"] = f"{s['step_ms'].get(p, 0.0):.2f}"
    return now


def recorded(doc: Path = DOC) -> tuple[dict[str, str], str]:
    """The recorded figures and their line of provenance (date, commit) from ``doc``'s guard table;
    ({}, "") where it has none. A malformed row is one error line naming the file and line."""
    text = doc.read_text() if doc.exists() else ""
    if BEGIN not in text:
        return {}, ""
    start = text.index(BEGIN)
    first = text[:start].count("\n") + 1
    got, when = {}, ""
    for i, line in enumerate(text[start:].splitlines()[1:], start=first + 1):
        if line.strip() == END:
            break
        if line.startswith("Recorded"):
            when = line.strip()
            continue
        if not line.startswith("| ") or line.startswith("| figure") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise ValueError(f"{doc}:{i}: a step guard row has 3 cells (figure | what | value), got {len(cells)}")
        got[cells[0].strip("`")] = cells[2]
    return got, when


def compare(was: dict[str, str], now: dict[str, str]) -> list[str]:
    """One line for each figure that moved past the guard's margins, then the verdict line."""
    lines, moved = [], set()
    for key, _ in FIGURES[1:]:
        if key not in was or key not in now:
            continue
        a, b = float(was[key].replace(",", "")), float(now[key].replace(",", ""))
        rate = key.endswith("samples_per_s")
        change = (b - a) / a if a else 0.0
        if (rate and abs(change) > 0.05) or (not rate and abs(change) > 0.2 and abs(b - a) > 0.5):
            moved.add(key)
            unit = "samples/s" if rate else "ms"
            lines.append(f"guard: {key} {b:,.2f} {unit} against {a:,.2f} recorded ({change:+.0%})")
    other_host = was.get("host") not in (None, "", "unknown", now.get("host"))
    tier_parts = sorted(k for k in moved if k.startswith("tier.") and not k.endswith("samples_per_s"))
    fused = sorted(k for k in moved if k in ("kernel.fused", "local.compute", "local.samples_per_s"))
    why = []
    if other_host:
        why.append(f"another host ({now.get('host')} against {was.get('host')})")
    if fused:
        why.append("the fused engine moved (" + ", ".join(fused) + ")")
    if tier_parts:
        why.append("the tier's own step moved (" + ", ".join(tier_parts) + ")")
    lines.append("guard: " + ("; ".join(why) if why else "every part within the margins of the recorded figures"))
    return lines


def table(figs: dict[str, str], commit: str) -> str:
    """The guard block for ``docs/benchmarks.md``."""
    rows = [BEGIN, f"Recorded {datetime.date.today().isoformat()} at {commit}.", ""]
    rows += ["| figure | what | value |", "| --- | --- | --- |"]
    rows += [f"| `{k}` | {what} | {figs[k]} |" for k, what in FIGURES if k in figs]
    return "\n".join(rows + [END])


def record(figs: dict[str, str], doc: Path = DOC) -> None:
    """Today's figures as the recorded ones (the block replaced in place)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc}: no step guard block ({BEGIN!r} ... {END!r}) to replace")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + table(figs, commit or "unknown") + rest.split(END, 1)[1])
