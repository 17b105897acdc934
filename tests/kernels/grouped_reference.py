"""The float64 reference of the experts' grouped matmul (model/grouped_matmul.py's contract)."""
import numpy as np


def grouped_reference(x, weights, group_sizes) -> np.ndarray:
    """Rows of x sorted by group, group g's rows times weights[g], in float64; zero past the
    groups' total."""
    out = np.zeros((x.shape[0], weights.shape[2]))
    start = 0
    for group, size in enumerate(group_sizes):
        rows = x[start:start + size].astype(np.float64)
        out[start:start + size] = rows @ weights[group].astype(np.float64)
        start += size
    return out
