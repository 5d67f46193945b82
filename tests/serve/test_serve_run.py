"""``serve run configs/smollm2-cpu.yaml`` as a user runs it: up, one chat answer, Ctrl-C, clean exit.

The config is copied with a free port so the test never collides with something on 8000."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import yaml

from serve_testutil import free_port, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180
EXIT_TIMEOUT_S = 150  # ~8 s on a quiet machine; generous for a loaded 2-core CI box


def test_serve_run_cpu_config(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "smollm2-cpu.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    serve_bin = Path(sys.executable).parent / "serve"
    log = (tmp_path / "serve-run.log").open("w+b")
    t0 = time.monotonic()
    # a child inherits an ignored SIGINT (earlier in-process Ray tests may leave it ignored), and a
    # Python started with SIGINT ignored never raises KeyboardInterrupt: restore the default for Ctrl-C
    proc = subprocess.Popen([str(serve_bin), "run", str(path)], cwd=ROOT, env=subprocess_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, f"serve run exited early ({proc.returncode}):\n{_tail(log)}"
            try:
                if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"no answer on {base}:\n{_tail(log)}"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
        first_answer_s = time.monotonic() - t0
        assert reply.choices[0].message.content
        print(f"\nserve run -> first answered chat request: {first_answer_s:.1f} s")

        proc.send_signal(signal.SIGINT)  # Ctrl-C: serve run shuts Serve down and exits
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve run did not exit within {EXIT_TIMEOUT_S} s of SIGINT:\n{_tail(log)}")
        assert rc == 0, f"serve run exited with {rc}:\n{_tail(log)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        else:  # whatever it left in its session (Ray's own processes exit with it)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _tail(log, n: int = 6000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]
