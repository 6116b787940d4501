"""Probe (not a benchmark, not a test): torch's first MKL VML-backed call on 2 threads, in fresh processes.

Each try is a new Python process that loads a training checkpoint (snakeshard's ``latest.pt``: model and AdamW
state), rebuilds the optimizer from it, and takes ``sqrt`` of the first parameter's ``exp_avg_sq`` (what AdamW's
update does first) with 2 intra-op threads; it compares the result with NumPy's float64 sqrt rounded to float32.
A try "differs" when an element is off by more than 1e-6 relative (a correctly rounded or 1-ulp sqrt never is).

    python bench/vml_first_call.py results/train/feats_train/checkpoints/latest.pt 40 [none|exp|add]

``exp`` / ``add``: before the sqrt, each try calls ``torch.ones(8).exp()`` (a VML-backed op) or ``.add(1)`` (not)
on one thread: what snakeshard.train.numerics.settle_vector_math does (exp). Findings: bench/RESULTS.md section 28.
"""

from __future__ import annotations

import collections
import subprocess
import sys

TRY = r"""
import sys
import numpy as np
import torch
torch.set_num_threads(2)
checkpoint, warm = sys.argv[1], sys.argv[2]
ck = torch.load(checkpoint, map_location="cpu", weights_only=False)
params = [torch.nn.Parameter(t.clone()) for t in ck["model"].values()]
optimizer = torch.optim.AdamW(params)
optimizer.load_state_dict(ck["optimizer"])
if warm == "exp":
    torch.ones(8).exp()
elif warm == "add":
    torch.ones(8).add(1)
x = optimizer.state[params[0]]["exp_avg_sq"].flatten()
got = x.sqrt()
want = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
off = ((got - want).abs() / want.clamp_min(1e-30)) > 1e-6
where = off.nonzero().flatten()
print(f"differs in {len(where)} of {len(x)} elements ({int(where[0])}..{int(where[-1])}), up to "
      f"{float(((got - want).abs() / want.clamp_min(1e-30)).max()):.1e} relative" if len(where) else "same")
"""


def main() -> None:
    checkpoint, tries = sys.argv[1], int(sys.argv[2])
    warm = sys.argv[3] if len(sys.argv) > 3 else "none"
    seen = collections.Counter()
    for _ in range(tries):
        out = subprocess.run([sys.executable, "-c", TRY, checkpoint, warm], capture_output=True, text=True, check=True)
        seen[out.stdout.strip()] += 1
    for result, count in seen.most_common():
        print(f"{count:4d}  {result}")
    print(f"warm-up {warm}: {tries - seen['same']} of {tries} tries differ")


if __name__ == "__main__":
    main()
