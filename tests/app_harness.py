"""Launch app.py in a subprocess on a tiny random target (the embedded tokenizer, hidden 64)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_target_folder(folder: Path) -> Path:
    """A 2-layer random Llama with the embedded model's tokenizer and chat template, saved once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    from specviz.core.load import embedded_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_folder())
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048,
                                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningApp:
    def __init__(self, target: Path, port: int | None = None, timeout: float = 480, **env_extra: str):
        """Start app.py and wait for its page. Budgets are not tuned (``SPECVIZ_TUNE=off``: every method at its
        untuned defaults) unless ``env_extra`` says otherwise; ``timeout`` bounds the wait, not the speed.
        The app runs on one thread, as the tests do (``conftest``): the thread count is part of the tuner's
        machine key, so apps and in-process tests on the same target folder share one tuning per test run."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "GRADIO_SERVER_PORT": str(self.port), "GRADIO_ANALYTICS_ENABLED": "False",
               "SPECVIZ_TARGET": str(target), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPECVIZ_TUNE": "off",
               **env_extra}
        self.log = open(target.parent / f"app-{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "app.py")], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.starting_pages: list[str] = []  # what the address answered before the app served
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited early: {Path(self.log.name).read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except urllib.error.HTTPError as reply:  # the starting page (503) while the app loads
                self.starting_pages.append(reply.read().decode())
                time.sleep(0.5)
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("app did not start in time")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
