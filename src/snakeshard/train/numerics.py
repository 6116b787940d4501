"""What torch's CPU kernels need so that a resumed training run computes what the uninterrupted one did."""

from __future__ import annotations


def settle_vector_math() -> None:
    """Run one of torch's MKL VML-backed elementwise functions (``exp``) once, on this thread alone, before any
    step of the training job can run one on several threads.

    Measured on an Intel Xeon with AVX-512, torch 2.13.0+cpu (bench/RESULTS.md section 28): when a process's first
    VML-backed call (AdamW's ``sqrt``) ran on 2 intra-op threads at once, one thread's half of the tensor came
    back accurate to only ~3e-4 relative (VML's low-accuracy path) in about 1 process in 4 (19 of 80), so a
    resumed run drifted from the uninterrupted one. After one call on one thread, 0 of 60 did; a first ``add``
    (no VML) did not help (6 of 30). Eight elements stay under torch's parallel grain: no thread is involved.
    """
    import torch

    torch.ones(8).exp()
