"""The interop suite imports SGLang's own modules (``pip install --no-deps sglang``, see ``make setup``);
``sglang_cpu`` puts the few CPU stubs in place first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
