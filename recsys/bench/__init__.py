"""``python -m recsys bench-recovery``: what each recovery strategy costs, and restores against shard size."""


def markdown(rows: list[dict], columns: list[str]) -> str:
    """``rows`` as a markdown table of ``columns``, in that order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in columns) + " |")
    return "\n".join(lines)
