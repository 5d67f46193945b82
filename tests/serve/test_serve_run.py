"""``make run`` as a user runs it: ``tr-serve run configs/smollm2-cpu.yaml`` up, one chat answer,
every listening socket of the local Ray on loopback or behind Ray's token, then SIGTERM to its
whole process group (what ``kill -- -PGID`` and Ctrl-C in a terminal do; Kubernetes sends it to
the process) with two streams in flight: both end with ``data: [DONE]`` (after their text, or
after an in-band error event once the drain timeout has passed), new requests get a fast 503
meanwhile, and the process exits 0. Idle, the same signal ends it within ``IDLE_EXIT_S``. Either
way no process of its Ray is left.

The config is copied with a free port so the test never collides with something on 8000; the Ray
token goes to a temporary file, not ``~/.ray``; Ray offers 2 CPUs, whatever the machine has."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import psutil
import yaml

from serve_testutil import free_port, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
DRAIN_TIMEOUT_S = 20
EXIT_TIMEOUT_S = DRAIN_TIMEOUT_S + 120  # drain, then Serve and Ray shutdown on a loaded 2-core box
IDLE_EXIT_S = 15  # SIGTERM to the process group with nothing in flight: exited within this
REAP_S = 10  # after tr-serve run exited, how long its Ray's processes may take to be gone
RAY_CPUS = 2
MODEL = "smollm2-135m-instruct"
LOOPBACK = ("127.", "::ffff:127.", "::1")


def test_make_run_target_is_tr_serve_run():
    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "tr-serve run configs/smollm2-cpu.yaml" in recipe
    assert "RAY_AUTH_MODE=disabled" not in recipe


def _start(tmp_path: Path) -> tuple[subprocess.Popen, str, Path, object, float]:
    """``tr-serve run`` on a copy of the config with a free port, in a process group of its own
    (as a shell's job is), up to its first ``/health`` 200: (process, base URL, token file, log,
    start time)."""
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "smollm2-cpu.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    token_file = tmp_path / "ray" / "auth_token"
    env = subprocess_env(RAY_AUTH_TOKEN_PATH=str(token_file))
    for name in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)  # what a user's shell has: tr-serve run sets them itself
    log = (tmp_path / "tr-serve-run.log").open("w+b")
    t0 = time.monotonic()
    # a child inherits an ignored SIGINT (earlier in-process Ray tests may leave it ignored)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "tr-serve"), "run", str(path), "--no-dashboard",
                             "--drain-timeout", str(DRAIN_TIMEOUT_S), "--num-cpus", str(RAY_CPUS)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # /health is 200 once the model replica answers the ingress's probe
            assert proc.poll() is None, f"tr-serve run exited early ({proc.returncode}):\n{_tail(log)}"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"no answer on {base}:\n{_tail(log)}"
            time.sleep(0.5)
    except BaseException:
        _stop(proc, set(), log)
        raise
    return proc, base, token_file, log, t0


def _ray_sessions(root_pid: int) -> set[int]:
    """The sessions of ``tr-serve run``'s descendants other than its own (its Ray's), and checks
    that its Ray's GCS and raylet are in one: a signal to tr-serve run's group does not reach them."""
    descendants = psutil.Process(root_pid).children(recursive=True)
    names = {p.pid: p.name() for p in descendants}
    assert any("gcs_server" in n for n in names.values()) and any("raylet" in n for n in names.values()), names
    sessions = {os.getsid(p.pid) for p in descendants} - {os.getsid(root_pid)}
    in_group = [n for pid, n in names.items() if os.getpgid(pid) == os.getpgid(root_pid)]
    assert not any("gcs_server" in n or "raylet" in n for n in in_group), in_group
    return sessions


def _left_in(sessions: set[int]) -> list[psutil.Process]:
    """Live (not zombie) processes of these sessions."""
    left = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) in sessions:
                left.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return left


def _assert_nothing_left(sessions: set[int]) -> None:
    deadline = time.monotonic() + REAP_S
    while (left := _left_in(sessions)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not left, [(p.pid, p.name()) for p in left]


def _stop(proc: subprocess.Popen, sessions: set[int], log) -> None:
    """Whatever is left of the process group and of Ray's sessions is killed (a failed test leaks nothing)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in _left_in(sessions):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    log.close()


def test_tr_serve_run_idle_exits_soon_after_sigterm_to_its_process_group(tmp_path):
    """Idle, SIGTERM to the whole process group (systemd's and a shell's way): exit 0 within
    IDLE_EXIT_S, no lost GCS on the way, and none of its Ray's processes left."""
    proc, base, _, log, _ = _start(tmp_path)
    sessions: set[int] = set()
    try:
        sessions = _ray_sessions(proc.pid)
        sigterm_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        took = time.monotonic() - sigterm_at
        print(f"\ntr-serve run, idle, exited {took:.1f} s after SIGTERM to its process group")
        assert rc == 0, f"tr-serve run exited with {rc}:\n{_tail(log)}"
        assert took < IDLE_EXIT_S, _tail(log)
        assert "Failed to connect to GCS" not in _tail(log, 10**6), _tail(log)
        _assert_nothing_left(sessions)
    finally:
        _stop(proc, sessions, log)


def test_tr_serve_run_loopback_token_auth_and_graceful_sigterm(tmp_path):
    proc, base, token_file, log, t0 = _start(tmp_path)
    sessions: set[int] = set()
    try:
        sessions = _ray_sessions(proc.pid)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content
        print(f"\ntr-serve run -> first answered chat request: {time.monotonic() - t0:.1f} s")

        # the token file: generated on first run, owner-only
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        _check_listeners(proc.pid, token)

        streams = {"short": 40, "long": 1500}
        events: dict[str, list[str]] = {k: [] for k in streams}
        errors: dict[str, BaseException] = {}
        started = threading.Barrier(len(streams) + 1, timeout=180)

        def stream(tag: str, max_tokens: int) -> None:
            # the long stream samples at a high temperature: near-random text that no draft predicts, so
            # it cannot finish inside the drain timeout (greedy text loops, and TR drafts a loop 16 at a time)
            temperature = 2.0 if tag == "long" else 0
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story about a ship."}],
                    "max_tokens": max_tokens, "temperature": temperature, "seed": 7, "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events[tag].append(line[len("data: "):])
                            if len(events[tag]) == 3:
                                started.wait()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[tag] = e
                started.abort()

        threads = [threading.Thread(target=stream, args=item) for item in streams.items()]
        for t in threads:
            t.start()
        started.wait()  # both streams have text
        sigterm_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group: tr-serve run's Ray is not in it
        time.sleep(1.0)
        t = time.monotonic()
        refused = httpx.post(base + "/v1/chat/completions", timeout=30,
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 503 and time.monotonic() - t < 5, refused.text
        assert refused.json()["error"]["code"] == "shutting_down" and "retry-after" in refused.headers
        for t in threads:
            t.join(timeout=DRAIN_TIMEOUT_S + 60)
        assert not errors, errors
        for tag, evs in events.items():
            assert evs and evs[-1] == "[DONE]", (tag, evs[-3:])
            chunks = [json.loads(e) for e in evs[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            assert text, tag
            last = chunks[-1]
            finished = bool(last.get("choices")) and last["choices"][0]["finish_reason"] == "length"
            cut = "error" in last and last["error"]["code"] == "shutting_down"
            assert finished or cut, (tag, last)
            print(f"{tag} stream: {len(chunks)} chunks, then {'finish_reason length' if finished else 'shutting_down'}"
                  f" and [DONE]")
        assert "error" in json.loads(events["long"][-2]), "1500 tokens cannot finish within the drain timeout"
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        print(f"tr-serve run exited {time.monotonic() - sigterm_at:.1f} s after SIGTERM")
        assert rc == 0, f"tr-serve run exited with {rc}:\n{_tail(log)}"
        assert "drained in" in _tail(log), _tail(log)
        _assert_nothing_left(sessions)
    finally:
        _stop(proc, sessions, log)


def _cluster_pids(root_pid: int) -> set[int]:
    """The launcher and every process it started (Ray's processes included)."""
    return {root_pid} | {p.pid for p in psutil.Process(root_pid).children(recursive=True)}


def _check_listeners(root_pid: int, token: str) -> None:
    """Every TCP listener of the local cluster is on loopback, or refuses a call without the token
    (Serve's inter-deployment gRPC server binds [::] whatever Ray's node address is)."""
    pids = _cluster_pids(root_pid)
    listeners = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listeners) >= 5, listeners  # GCS, raylet, workers, proxy, ...
    outside = [c for c in listeners if not c.laddr.ip.startswith(LOOPBACK)]
    for c in outside:
        name = psutil.Process(c.pid).name()
        assert "ServeReplica" in name, f"{name} listens on {c.laddr.ip}:{c.laddr.port}"
        method = "/ray.serve.ASGIService/HandleRequest"
        with grpc.insecure_channel(f"127.0.0.1:{c.laddr.port}") as channel:
            for metadata, expect_refused in ((None, True), ((("authorization", f"Bearer {token}"),), False)):
                try:
                    channel.unary_unary(method)(b"", timeout=10, metadata=metadata)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                assert (code == grpc.StatusCode.UNAUTHENTICATED) == expect_refused, (name, c.laddr, code)


def _tail(log, n: int = 6000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]
