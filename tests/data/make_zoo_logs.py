"""Regenerate the logs docs/bug-zoo.md checks: ``python tests/data/make_zoo_logs.py`` (needs
vLLM's scheduler: ``make setup-vllm``).

Each is a bug-zoo shape's faulty run (connector/testing/zoo.py): vLLM's real scheduler on CPU,
the faulty connector wrapped in ``KVLedgerRecorder``, the KV-content oracle checked after every
step. The bytes differ between runs (run ids, wall clocks); the events, and so what
``kvledger check`` says of them, do not (tests/test_zoo.py checks that a run now is judged the
same as the log kept here).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

NAMES = ("vllm_51637", "vllm_50297", "vllm_55113", "vllm_54193")


def main() -> None:
    from kvledger.connector.testing.zoo import SHAPES, run_shape

    out = HERE / "zoo"
    out.mkdir(exist_ok=True)
    for name in NAMES:
        with tempfile.TemporaryDirectory() as tmp:
            report = run_shape(SHAPES[name], log_dir=tmp)
            assert report.log_path is not None
            shutil.copyfile(report.log_path, out / f"{name}.kvlog")
        print(f"{name}: {out / f'{name}.kvlog'} ({report.error or 'no vLLM error'})")


if __name__ == "__main__":
    main()
