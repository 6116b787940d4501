"""What torch's CPU kernels need so that a resumed training run computes what the uninterrupted one did."""

from __future__ import annotations


def settle_vector_math() -> None:
    """Run one of torch's vector-math elementwise functions (``exp``; MKL's VML on this CPU build, as far as the
    measurements below tell) once, on this thread alone, before any step of a training job (or ``infer_step`` of
    an inference job) can run one on several threads.

    Measured on an Intel Xeon with AVX-512, torch 2.13.0+cpu (bench/RESULTS.md section 28): when a process's first
    such call (AdamW's ``sqrt``) ran on 2 intra-op threads at once, one thread's half of the tensor came back
    accurate to only ~3e-4 relative in 24 of 110 fresh processes, so a resumed run drifted from the uninterrupted
    one. After one ``sqrt`` or ``exp`` on one thread: 0 of 100; after an ``add`` (no VML): 6 of 30. Eight
    elements stay under torch's parallel grain, so this call runs on the calling thread alone.
    """
    import torch

    torch.ones(8).exp()
