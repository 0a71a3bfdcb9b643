"""The cpu path never imports numba.cuda (it would lock the process out of choosing the simulator)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import numpy as np
import vtnumba.kernels as k
rng = np.random.default_rng(1)
a, b = rng.standard_normal((5, 3), dtype=np.float32), rng.standard_normal((3, 4), dtype=np.float32)
k.matmul(a, b); k.linear(a, b.T.copy()); k.linear_rows_to(a, b.T.copy(), None, [np.empty((3, 4), np.float32) for _ in range(2)], 3)
y, w = rng.standard_normal((5, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
k.fused_add_rms_norm(y, y.copy(), w, 1e-5); k.fused_add_layer_norm(y, None, w, w, 1e-5)
k.peer_reduce_norm([y, y.copy()], None, None, w, None, 1e-5, np.empty_like(y), np.empty_like(y))
k.gather_rows(y, [np.empty((10, 8), np.float32)], 5)
print("numba.cuda" in sys.modules)
"""


def test_cpu_path_does_not_import_numba_cuda():
    env = dict(os.environ, VTNUMBA_TARGET="cpu", NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False"
