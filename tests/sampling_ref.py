"""The distribution vLLM samples from, stated in numpy for sampling tests."""

import numpy as np


def filtered_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0
                          ) -> np.ndarray:
    """softmax(logits / temperature) without the tokens less likely than min_p times the most
    likely one, then restricted to the top-k by rank, then to the smallest nucleus reaching
    top_p (-inf logits: probability 0)."""
    x = np.asarray(logits, np.float64) / temperature
    if min_p > 0:
        p = np.exp(x - x.max())
        x = np.where(p >= min_p * p.max(), x, -np.inf)
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.size, bool)
    keep[order[:top_k if top_k > 0 else x.size]] = True
    finite = np.isfinite(x)
    p = np.where(keep & finite, np.exp(x - x[finite].max()), 0.0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    nucleus = order[(cum - p[order]) < top_p]
    out = np.zeros(x.size)
    out[nucleus] = p[nucleus]
    return out / out.sum()
