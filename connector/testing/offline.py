"""An offline script as a user writes one: ``vllm.LLM`` with KVLedgerConnector, a generate
call, then the script ends, with nothing closed by hand. Run as a program (vLLM may spawn
processes, so the work sits under ``if __name__ == "__main__"``)::

    python -m kvledger.connector.testing.offline MODEL LOG_DIR [--multiprocessing 0|1] [--end normal|raise] [--wait-stdin]

``--multiprocessing``: vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING`` (1, vLLM's default: the engine
core in a process of its own; 0: in this one). ``--end raise``: the script ends by an uncaught
exception instead of returning. Prints the generated token ids as JSON on a line starting with ``OUTPUTS``.
``--wait-stdin``: then reads its input to the end before it ends, so that whoever runs it says
when (the served tests: when the machine is theirs alone, tests/engine/_turns.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("log_dir")
    parser.add_argument("--multiprocessing", choices=("0", "1"), default="1")
    parser.add_argument("--end", choices=("normal", "raise"), default="normal")
    parser.add_argument("--wait-stdin", action="store_true")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = args.multiprocessing
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        num_gpu_blocks_override=8,
        max_model_len=224,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLedgerConnector",
            kv_connector_module_path="kvledger.connector.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "chunk_size": 32,
                "host_pool_bytes": 64 << 20,
                "log_dir": args.log_dir,
            },
        ),
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 48, 57, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = [
        [list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)]
        for _ in range(2)
    ]  # fmt: skip
    print("OUTPUTS", json.dumps(outs), flush=True)
    if args.wait_stdin:
        sys.stdin.read()
    if args.end == "raise":
        raise RuntimeError("the script fails after generating (an uncaught exception)")


if __name__ == "__main__":
    main()
