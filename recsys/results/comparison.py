"""``python -m recsys compare RUN_A RUN_B ...``: runs side by side.

Writes ``compare.md`` (one row per run: steps, wall time, throughput, final AUC and logloss and
their change against the first run, PLS, failures, lost updates, rows read stale (training through
a fallback), time in recovery, seconds every
trainer waited for failures and steps trained through them (``--train-through``), whether the
embeddings equal the first run's) and ``compare.png`` (training loss and eval AUC of every run on
one pair of axes, each run's failures marked in its colour).
"""

from __future__ import annotations

from pathlib import Path

COLUMNS = [
    "run",
    "recovery",
    "steps",
    "wall_s",
    "samples_per_s",
    "final_auc",
    "auc_change",
    "final_logloss",
    "pls",
    "failures",
    "lost_updates",
    "rows_read_stale",
    "recovery_s",
    "waited_s",
    "trained_through",
    "same_embeddings",
]


def rows(runs) -> list[dict]:
    ref = runs[0].summary
    out = []
    for r in runs:
        s = r.summary
        if s is None:
            out.append({c: "" for c in COLUMNS} | {"run": r.name, "recovery": "(unfinished)"})
            continue
        out.append(
            {
                "run": r.name,
                "recovery": s.recovery,
                "steps": s.steps,
                "wall_s": round(s.wall_seconds, 2),
                "samples_per_s": round(s.throughput),
                "final_auc": round(s.final_auc, 5),
                "auc_change": round(s.final_auc - ref.final_auc, 5) if ref is not None else "",
                "final_logloss": round(s.final_logloss, 5),
                "pls": round(s.pls, 5),
                "failures": len(s.failures),
                "lost_updates": s.lost_updates,
                "rows_read_stale": int(s.raw.get("rows_read_stale", 0)),
                "recovery_s": round(sum(f.detected_after_s + f.recovery_s for f in s.failures), 3),
                "waited_s": round(sum(f.waited_s for f in s.failures), 3),
                "trained_through": sum(f.trained_through_steps for f in s.failures),
                "same_embeddings": ref is not None
                and s.embedding_digest is not None
                and s.embedding_digest == ref.embedding_digest,
            }
        )
    return out


def write_comparison(runs, out: Path) -> None:
    from recsys.bench import markdown

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = rows(runs)
    names = ", ".join(str(r.path) for r in runs)
    md = f"Runs compared (changes against the first): {names}\n\n{markdown(table, COLUMNS)}\n"
    (out / "compare.md").write_text(md)
    plot(runs, out / "compare.png")
    print(md)


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for i, r in enumerate(runs):
        color = f"C{i}"
        metrics = r.metrics
        loss = [m for m in metrics if "loss" in m]
        ax_loss.plot([m["step"] for m in loss], [m["loss"] for m in loss], lw=1, color=color, label=r.name)
        ev = [m for m in metrics if "auc" in m]
        ax_auc.plot([m["step"] for m in ev], [m["auc"] for m in ev], "o-", ms=3, color=color, label=r.name)
        for j, f in enumerate(f for f in r.failures if f.step is not None):
            for ax in (ax_loss, ax_auc):
                label = f"{r.name}: failures" if j == 0 and ax is ax_loss else None
                ax.axvline(f.step, color=color, ls=":", lw=1.2, label=label)
    ax_loss.set_ylabel("train logloss")
    ax_auc.set_ylabel("eval AUC")
    ax_auc.set_xlabel("step")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("runs compared (dotted: failures)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
