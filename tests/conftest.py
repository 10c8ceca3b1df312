"""Settings every test process shares (pytest loads this file before the tests; workers inherit the environment)."""

import getpass
import os
import tempfile

# One inductor cache per CPU capability that torch is told to use. Inductor's on-disk caches do not
# keep every artifact apart by ATEN_CPU_CAPABILITY: a compiled step cached by a run on AVX-512 and
# loaded by a run with ATEN_CPU_CAPABILITY=avx2 computed a wrong verdict here (test_lax's compiled
# step raised "the ranks disagree"), where either run with a cache of its own passes.
_capability = os.environ.get("ATEN_CPU_CAPABILITY")
if _capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_capability}")
