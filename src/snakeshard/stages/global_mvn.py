"""Global mean-variance normalization with a collect-stats stage's statistics (ESPnet2's GlobalMVN).

Apart from the collect-stats stage that writes the statistics: the fbank stage and training stages read them.
"""

from __future__ import annotations

from pathlib import Path


class GlobalMVN:
    """Global mean-variance normalization from a ``feats_stats.npz``, as ESPnet2's GlobalMVN computes it:
    ``mean = sum / count``, ``std = sqrt(max(sum_square / count - mean**2, eps))`` (eps 1e-20).

    ``GlobalMVN(path)(feats)`` -> ``(feats - mean) / std`` in float64, returned in ``feats``' dtype.
    ``path`` is the npz, or a stats stage's merged dataset dir (then ``feats_stats.npz`` in it).
    """

    def __init__(self, path, *, norm_means: bool = True, norm_vars: bool = True, eps: float = 1.0e-20):
        import numpy as np

        path = Path(path)
        if path.is_dir():
            path = path / "feats_stats.npz"
        with np.load(path) as stats:
            count = stats["count"]
            self.mean = stats["sum"] / count
            self.std = np.sqrt(np.maximum(stats["sum_square"] / count - self.mean * self.mean, eps))
        self.norm_means, self.norm_vars = norm_means, norm_vars

    def __call__(self, feats):
        import numpy as np

        out = np.asarray(feats, dtype=np.float64)
        if self.norm_means:
            out = out - self.mean
        if self.norm_vars:
            out = out / self.std
        return out.astype(np.asarray(feats).dtype, copy=False)
