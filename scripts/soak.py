"""Soak test of the Ray Serve application: N streaming chat clients for T seconds, random client
disconnects, and a fault (the model replica or the fleet matrix actor killed mid-run); then a check
that greedy outputs before and after are identical.

Starts the application of ``--config`` (``configs/smollm2-cpu.yaml``: the embedded model on CPU,
fleet hot start switched on here so the fleet actor exists) on a local Ray in this process: HTTP
on 127.0.0.1, Ray on loopback with token authentication, shut down at the end.

    .venv/bin/python scripts/soak.py --clients 24 --duration 60 --fault replica --fault-at 20
    .venv/bin/python scripts/soak.py --clients 8 --duration 20 --fault fleet --fault-at 5 --skip-checks

Before the soak it runs the abuse checks (``--skip-checks`` leaves them out): 40 concurrent streamed
requests over the queue limit (every refusal an OpenAI error body with Retry-After), three 5 MB
bodies while a stream runs (refusal time, the stream's largest gap between chunks), a tool_choice
nested 900 levels deep and lone surrogates (4xx OpenAI bodies, nothing logged as an internal error).

Every soak request ends as exactly one of:

- completed: a 200 stream with a finish_reason, then ``data: [DONE]``;
- errored: an error the client can act on: an HTTP error with an OpenAI body (429/503 carry
  Retry-After, which the client honours, capped by ``--max-backoff``), or an in-band error event
  followed by ``data: [DONE]``;
- disconnected: the client left on purpose after a few chunks (``--disconnect-rate``);
- hung: no byte for ``--hang-timeout`` seconds, or still open ``--grace`` seconds after the end;
- lost: anything else (a stream cut without ``[DONE]``, an error body that is not OpenAI's, a
  connection error).

Prints a summary (and writes every request to ``--json``); exits 1 when a request hung or was lost,
the greedy outputs differ, a check failed, or the engine kept requests after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# before anything imports ray: Ray's single-node mode (loopback only), token auth with a
# throw-away token, no usage reporting
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                   "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"})
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)

import httpx  # noqa: E402
import yaml  # noqa: E402

APP = "tr_serve_soak"
FLEET_NAMESPACE = "soak"
GREEDY_PROMPTS = ["Name three colors.", "What is a B-tree? Answer in two sentences.",
                  "Write a haiku about the sea.", "List the first five prime numbers."]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def is_openai_error(text: str) -> dict | None:
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err):
        return err
    return None


# ---- one streaming request ------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int,
                      disconnect_after: int | None, t0: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start = time.monotonic()
    rec: dict = {"start_s": round(start - t0, 3), "outcome": None}
    events = 0
    finish = None
    error = None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                err = is_openai_error(text)
                if err is None:
                    rec.update(outcome="lost", detail=f"HTTP {r.status_code}, not an OpenAI body: {text[:120]!r}")
                else:
                    retry = r.headers.get("retry-after")
                    rec.update(outcome="errored", code=err["code"], retry_after=retry)
                    if r.status_code in (429, 503) and retry is None:
                        rec.update(outcome="lost", detail=f"HTTP {r.status_code} without Retry-After")
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                events += 1
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                for choice in chunk.get("choices") or ():
                    if rec.get("ttft_s") is None and (choice.get("delta") or {}).get("content"):
                        rec["ttft_s"] = round(time.monotonic() - start, 4)
                    finish = choice.get("finish_reason") or finish
                if disconnect_after is not None and events >= disconnect_after:
                    rec.update(outcome="disconnected", events=events)
                    return rec  # leaving the block closes the connection mid-stream
            if not done:
                rec.update(outcome="lost", detail=f"stream ended without [DONE] after {events} events")
            elif error is not None:
                rec.update(outcome="errored", code=f"in-band {error.get('code')}")
            elif finish is None:
                rec.update(outcome="lost", detail="[DONE] without a finish_reason")
            else:
                rec.update(outcome="completed", finish_reason=finish)
    except httpx.ReadTimeout:
        rec.update(outcome="hung", detail=f"no byte for the read timeout after {events} events")
    except httpx.HTTPError as e:
        rec.update(outcome="lost", detail=f"{type(e).__name__}: {e}"[:200])
    finally:
        rec["end_s"] = round(time.monotonic() - t0, 3)
    return rec


async def soak(base: str, model: str, prompts: list[str], opts, on_fault) -> tuple[list[dict], float | None]:
    """The clients, and the fault at ``fault_at``; returns (records, the fault's time from start)."""
    records: list[dict] = []
    t0 = time.monotonic()
    end = t0 + opts.duration
    counter = iter(range(10**12))
    fault_time: list[float] = []
    timeout = httpx.Timeout(connect=10, read=opts.hang_timeout, write=30, pool=opts.hang_timeout)

    async def client_loop(cid: int) -> None:
        rng = random.Random(opts.seed * 1000 + cid)
        async with httpx.AsyncClient(timeout=timeout) as client:
            while time.monotonic() < end:
                prompt = prompts[next(counter) % len(prompts)]
                disconnect = rng.randint(1, 8) if rng.random() < opts.disconnect_rate else None
                rec = {"client": cid, "start_s": round(time.monotonic() - t0, 3), "outcome": "hung",
                       "detail": "still open after the grace period"}
                records.append(rec)
                rec.update(await one_request(client, base, model, prompt, opts.max_tokens, disconnect, t0))
                if rec["outcome"] == "errored" and rec.get("retry_after"):
                    await asyncio.sleep(min(float(rec["retry_after"]), opts.max_backoff))

    async def fault() -> None:
        if opts.fault == "none":
            return
        await asyncio.sleep(opts.fault_at)
        fault_time.append(time.monotonic() - t0)
        what = await asyncio.to_thread(on_fault)
        print(f"[{fault_time[0]:.1f} s] fault: {what}", flush=True)

    tasks = [asyncio.ensure_future(client_loop(i)) for i in range(opts.clients)]
    fault_task = asyncio.ensure_future(fault())
    await asyncio.wait(tasks, timeout=opts.duration + opts.grace)
    for t in tasks:
        t.cancel()  # records still "hung"
    await asyncio.gather(*tasks, return_exceptions=True)
    await fault_task
    return records, (fault_time[0] if fault_time else None)


def summarize(records: list[dict], fault_s: float | None) -> dict:
    outcomes = {k: sum(r["outcome"] == k for r in records)
                for k in ("completed", "errored", "disconnected", "hung", "lost")}
    codes: dict[str, int] = {}
    for r in records:
        if r["outcome"] == "errored":
            key = f"{r.get('status', '')} {r.get('code')}".strip()
            codes[key] = codes.get(key, 0) + 1
    ttft = [r["ttft_s"] for r in records if r.get("ttft_s") is not None and r["outcome"] == "completed"]
    error_latency = [r["end_s"] - r["start_s"] for r in records
                     if r["outcome"] == "errored" and r.get("status") != 200]
    out = {"started": len(records), **outcomes, "errors_by_code": codes,
           "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
           "ttft_p99_ms": percentile(ttft, 99),
           "error_response_p99_s": None if not error_latency else round(percentile(error_latency, 99), 3),
           "lost_or_hung_examples": [r.get("detail") for r in records if r["outcome"] in ("lost", "hung")][:5]}
    for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"):
        out[k] = None if out[k] is None else round(out[k] * 1000, 1)
    if fault_s is not None:
        refused = [r for r in records if r["outcome"] == "errored" and r["start_s"] >= fault_s]
        served = [r for r in records if r["outcome"] == "completed" and r["start_s"] >= fault_s]
        out["fault_at_s"] = round(fault_s, 1)
        out["first_completed_after_fault_s"] = round(min(r["start_s"] for r in served) - fault_s, 1) if served \
            else None
        out["errors_after_fault"] = len(refused)
        http = [r["end_s"] - r["start_s"] for r in refused if r.get("status") != 200]
        out["error_response_after_fault_p50_s"] = None if not http else round(percentile(http, 50), 3)
        out["error_response_after_fault_p99_s"] = None if not http else round(percentile(http, 99), 3)
        after = [r["ttft_s"] for r in served if r.get("ttft_s") is not None]
        out["ttft_p50_after_fault_ms"] = None if not after else round(percentile(after, 50) * 1000, 1)
    return out


# ---- abuse checks ------------------------------------------------------------------------------------
async def burst(base: str, model: str, n: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 32,
            "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client):
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            return r.status_code, r.headers.get("content-type", ""), r.headers.get("retry-after"), \
                (await r.aread()).decode(errors="replace")

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client:
        results = await asyncio.gather(*[one(client) for _ in range(n)])
    refused = [r for r in results if r[0] != 200]
    good = [r for r in refused if r[1].startswith("application/json") and is_openai_error(r[3]) and r[2]]
    done = [r for r in results if r[0] == 200 and r[3].rstrip().endswith("data: [DONE]")]
    return {"requests": n, "served": len(results) - len(refused), "served_with_done": len(done),
            "refused": len(refused), "refused_openai_with_retry_after": len(good),
            "ok": len(good) == len(refused) and len(done) == len(results) - len(refused)}


def big_bodies_during_a_stream(base: str, model: str) -> dict:
    import threading

    times: list[float] = []
    status: list = []

    def stream():
        body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 160,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
            status.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    times.append(time.monotonic())

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    while len(times) < 3 and t.is_alive():
        time.sleep(0.05)
    big = json.dumps({"model": model, "messages": [{"role": "user", "content": "abc " * 1310720}]}).encode()

    async def three():
        async def one(client):
            t0 = time.monotonic()
            r = await client.post(base + "/v1/chat/completions", content=big,
                                  headers={"Content-Type": "application/json"})
            return r.status_code, bool(is_openai_error(r.text)), time.monotonic() - t0

        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client) for _ in range(3)])

    w0 = time.monotonic()
    results = asyncio.run(three())
    w1 = time.monotonic()
    t.join(300)
    gaps = [(a, b - a) for a, b in zip(times, times[1:])]
    during = [g for a, g in gaps if a <= w1 and a + g >= w0]
    return {"body_bytes": len(big), "statuses": [r[0] for r in results], "openai_bodies": all(r[1] for r in results),
            "refused_in_s_max": round(max(r[2] for r in results), 3),
            "stream_gap_during_s_max": round(max(during), 3) if during else None,
            "stream_gap_whole_run_s_max": round(max(g for _, g in gaps), 3) if gaps else None,
            "ok": all(r[0] == 413 and r[1] and r[2] < 1.0 for r in results) and (max(during) if during else 0) < 2.0}


def hostile(base: str, model: str, logs: Path) -> dict:
    deep = root = {}
    for _ in range(900):
        deep["a"] = {}
        deep = deep["a"]
    files = list((logs / "serve").glob("*.log")) + list(logs.glob("worker-*.err"))
    sizes = {p: p.stat().st_size for p in files}
    cases = {
        "tool_choice 900 deep": json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}],
                                            "tool_choice": root}).encode(),
        "lone surrogate in model": b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
        "lone surrogate in content": b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}'
                                     % model.encode(),
        "lone surrogate, streamed": b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": '
                                    b'"\\ud800"}]}' % model.encode(),
        "tool_choice without tools": json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}],
                                                 "tool_choice": "required"}).encode(),
    }
    out = {}
    for name, body in cases.items():
        r = httpx.post(base + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=60)
        err = is_openai_error(r.text)
        out[name] = f"{r.status_code} {err['code'] if err else 'NOT AN OPENAI BODY'}"
    time.sleep(1.0)
    logged = ""
    for p in list((logs / "serve").glob("*.log")) + list(logs.glob("worker-*.err")):
        with open(p, "rb") as f:
            f.seek(sizes.get(p, 0))
            logged += f.read().decode(errors="replace")
    marks = ("Traceback", "unhandled error", "request to the model server failed", "internal error",
             "PicklingError", "UnicodeEncodeError")
    bad = [line for line in logged.splitlines() if any(m in line for m in marks)]
    statuses_ok = all(v.startswith("4") and "NOT" not in v for v in out.values())
    out["internal_errors_logged"] = len(bad)
    out["ok"] = statuses_ok and not bad
    return out


# ---- the application ---------------------------------------------------------------------------------
def wait_ready(base: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(base + "/health", timeout=10).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the application was not healthy within {timeout_s:.0f} s")


def greedy_outputs(base: str, model: str, max_tokens: int) -> list[str]:
    out = []
    for p in GREEDY_PROMPTS:
        for _ in range(60):  # a 503 right after a recovery is retried
            r = httpx.post(base + "/v1/chat/completions", timeout=300,
                           json={"model": model, "messages": [{"role": "user", "content": p}],
                                 "max_tokens": max_tokens, "temperature": 0})
            if r.status_code == 200:
                out.append(r.json()["choices"][0]["message"]["content"])
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"no greedy answer: {r.status_code} {r.text[:200]}")
    return out


def engine_idle(base: str, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = httpx.get(base + "/v1/tr/stats", timeout=30).json()["data"]
        if data and all("error" not in d and d["num_running"] == 0 and d["num_waiting"] == 0 for d in data):
            return True
        time.sleep(0.5)
    return False


def load_prompts() -> list[str]:
    from tr_serve.data import SPEC_BENCH_DEV

    prompts = []
    with open(SPEC_BENCH_DEV) as f:
        for line in f:
            if line.strip():
                turns = json.loads(line)["turns"]
                if turns and turns[0].strip():
                    prompts.append(turns[0])
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=24, help="concurrent streaming clients (24)")
    p.add_argument("--duration", type=float, default=60, help="seconds in which requests start (60)")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens per soak request (48)")
    p.add_argument("--disconnect-rate", type=float, default=0.1,
                   help="share of requests the client drops after 1-8 chunks (0.1)")
    p.add_argument("--fault", choices=("none", "replica", "fleet"), default="replica",
                   help="kill the model replica (Serve restarts it) or the fleet actor (Ray restarts it)")
    p.add_argument("--fault-at", type=float, default=20, help="seconds into the soak (20)")
    p.add_argument("--hang-timeout", type=float, default=60, help="a request with no byte for this long hung (60)")
    p.add_argument("--grace", type=float, default=120, help="seconds after the end for open requests (120)")
    p.add_argument("--max-backoff", type=float, default=2.0, help="cap on the Retry-After a client honours (2)")
    p.add_argument("--greedy-tokens", type=int, default=48, help="max_tokens of the greedy before/after check")
    p.add_argument("--skip-checks", action="store_true", help="no abuse checks before the soak")
    p.add_argument("--no-fleet", action="store_true", help="fleet hot start off (no fleet actor)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (2)")
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2-cpu.yaml"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary and every request here")
    opts = p.parse_args(argv)
    if opts.fault == "fleet" and opts.no_fleet:
        p.error("--fault fleet needs the fleet (drop --no-fleet)")

    import ray
    from ray import serve

    from tr_serve.serve.builder import build_app

    raw = yaml.safe_load(Path(opts.config).read_text())
    args = dict(raw["applications"][0]["args"])
    args.pop("api_keys", None)
    snapshot_dir = tempfile.mkdtemp(prefix="tr_serve_soak_")
    if not opts.no_fleet:
        args["fleet"] = {**(args.get("fleet") or {}), "enabled": True, "namespace": FLEET_NAMESPACE,
                         "snapshot_dir": snapshot_dir}
    model = args.get("model_id") or args["model"]
    ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    report: dict = {"config": opts.config, "clients": opts.clients, "duration_s": opts.duration,
                    "fault": opts.fault, "fault_at_s": opts.fault_at}
    ok = True
    try:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), blocking=False, name=APP, route_prefix="/")
        print(f"starting {model} on {base} ...", flush=True)
        print(f"healthy after {wait_ready(base, 600):.1f} s", flush=True)
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())

        if not opts.skip_checks:
            checks = {"burst_40_streams": asyncio.run(burst(base, model, 40)),
                      "three_5mb_bodies_during_a_stream": big_bodies_during_a_stream(base, model),
                      "hostile_bodies": hostile(base, model, logs)}
            report["checks"] = checks
            for name, c in checks.items():
                print(f"check {name}: {json.dumps(c)}", flush=True)
                ok &= bool(c["ok"])
            engine_idle(base)

        before = greedy_outputs(base, model, opts.greedy_tokens)

        def on_fault() -> str:
            from ray.serve._private.constants import SERVE_NAMESPACE

            if opts.fault == "replica":
                names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer")]
                ray.kill(ray.get_actor(names[0], namespace=SERVE_NAMESPACE), no_restart=True)
                return f"killed the model replica {names[0]} (Serve starts a new one)"
            from tr_serve.fleet.actor import get_actor

            ray.kill(get_actor(args["model"], FLEET_NAMESPACE), no_restart=False)
            return "killed the fleet matrix actor (Ray restarts it from its snapshot)"

        print(f"soak: {opts.clients} clients x {opts.duration:g} s, fault {opts.fault} at {opts.fault_at:g} s",
              flush=True)
        records, fault_s = asyncio.run(soak(base, model, load_prompts(), opts, on_fault))
        summary = summarize(records, fault_s)
        print(f"recovered: healthy after {wait_ready(base, 600):.1f} s more", flush=True)
        idle = engine_idle(base)
        after = greedy_outputs(base, model, opts.greedy_tokens)
        summary["engine_idle_after"] = idle
        summary["greedy_identical"] = before == after
        if before != after:
            summary["greedy_diff"] = [{"prompt": q, "before": b, "after": a}
                                      for q, b, a in zip(GREEDY_PROMPTS, before, after) if a != b]
        report["soak"] = summary
        report["records"] = records
        print(json.dumps({k: v for k, v in summary.items()}, indent=2), flush=True)
        ok &= summary["hung"] == 0 and summary["lost"] == 0 and before == after and idle
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        if opts.json:
            Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.json).write_text(json.dumps(report, indent=1))
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
