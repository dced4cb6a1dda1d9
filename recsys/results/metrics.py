"""Evaluation metrics: AUC, logloss, normalized entropy (pure numpy)."""

from __future__ import annotations

import numpy as np

from data.synthetic import auc

__all__ = ["auc", "logloss", "normalized_entropy", "evaluate_scores"]


def logloss(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, np.float64), 1e-12, 1 - 1e-12)
    y = np.asarray(labels, np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def normalized_entropy(probs: np.ndarray, labels: np.ndarray) -> float:
    """Logloss divided by the entropy of the base rate (1.0 = no better than predicting the CTR)."""
    ctr = float(np.mean(labels))
    if ctr in (0.0, 1.0):
        raise ValueError(f"normalized entropy needs both classes; base rate is {ctr}")
    base = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    return logloss(probs, labels) / base


def evaluate_scores(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    probs = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    return {
        "auc": auc(probs, labels),
        "logloss": logloss(probs, labels),
        "ne": normalized_entropy(probs, labels),
    }
