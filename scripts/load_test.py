"""Load test of the Ray Serve application: TR on vs TR off under concurrent streaming chat clients.

Starts the real application (``configs/smollm2-cpu.yaml``'s args, the embedded model on CPU) on a
local Ray instance in this process, drives ``--clients`` concurrent streaming chat clients for
``--duration`` seconds over the first turns of the packaged Spec-Bench dev questions (``tr_serve/data``) (cycled,
greedy), once with Token Recycling on (``--tree``, ``--budget``) and once with it off (tree
``none``), restarting Serve in between. Prints a Markdown table and writes a JSON of every request.

    .venv/bin/python scripts/load_test.py                        # 16 clients x 60 s per mode
    .venv/bin/python scripts/load_test.py --clients 4 --duration 10 --max-tokens 16
    .venv/bin/python scripts/load_test.py --measure-startup      # `serve run` -> first answer, seconds

Each client sends one request after another until the deadline; requests still running then get
``--grace`` seconds to finish, after which they are cancelled and counted as *lost*. Generated
tokens/s = completion tokens of the successful requests / (end of the last request - start).
MAT = tokens emitted by verification steps / verification steps, over all successful requests
(from the ``tr`` field of the last chunk; 1.0 means nothing was accepted, as with the tree off).
Everything binds to 127.0.0.1; Ray is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))
from serve_testutil import SERVE_ENV, free_port, subprocess_env  # noqa: E402

os.environ.update(SERVE_ENV)  # before anything imports ray

import httpx  # noqa: E402
import yaml  # noqa: E402

from tr_serve.data import SPEC_BENCH_DEV  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "smollm2-cpu.yaml"
DEFAULT_DATA = SPEC_BENCH_DEV  # packaged Spec-Bench dev questions (tr_serve/data)
APP_NAME = "tr_serve_load_test"


# ---- inputs -------------------------------------------------------------------------------------
def load_prompts(path: Path) -> list[str]:
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                turns = json.loads(line)["turns"]
                if turns and turns[0].strip():
                    prompts.append(turns[0])
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


def load_config(path: Path) -> tuple[dict, dict]:
    """(the YAML, the args of its one application)."""
    raw = yaml.safe_load(path.read_text())
    return raw, dict(raw["applications"][0]["args"])


def app_args(base: dict, tree: str, budget: str, max_num_seqs: int) -> dict:
    args = dict(base)
    args["engine_kwargs"] = {**args.get("engine_kwargs", {}), "tree": tree, "budget": budget,
                             "max_num_seqs": max_num_seqs}
    # Serve's admission follows max_num_seqs (TRServeConfig's defaults: 2x ongoing, 8x queued)
    args.pop("max_ongoing_requests", None)
    args.pop("max_queued_requests", None)
    args.pop("api_keys", None)
    return args


# ---- one streaming request ------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      rec: dict, t0: float) -> None:
    """Fills ``rec`` (status ok / error); a cancelled request keeps status None (lost)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    rec["start_s"] = round(start - t0, 4)
    finish = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.update(status="error", error=f"HTTP {r.status_code}: {text[:200]}",
                           retry_after=r.headers.get("Retry-After"))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.update(status="error", error=f"in-band: {chunk['error'].get('message')}")
                    return
                if chunk.get("usage"):
                    rec["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices") or ():
                    got_text = bool((choice.get("delta") or {}).get("content"))
                    if rec.get("ttft_s") is None and (got_text or choice.get("finish_reason")):
                        rec["ttft_s"] = round(time.monotonic() - start, 4)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        tr = chunk.get("tr") or {}
                        rec["mat"] = tr.get("mat")
                        rec["verification_steps"] = tr.get("verification_steps")
                        rec["verified_tokens"] = sum(tr.get("accepted_per_step") or ())
    except httpx.HTTPError as e:
        rec.update(status="error", error=f"{type(e).__name__}: {e}")
        return
    finally:
        rec["end_s"] = round(time.monotonic() - t0, 4)
    if finish is None:
        rec.update(status="error", error="the stream ended without a finish_reason")
    else:
        rec.update(status="ok", finish_reason=finish)


async def drive(base: str, model: str, prompts: list[str], clients: int, duration: float, max_tokens: int,
                grace: float) -> tuple[list[dict], float]:
    """Runs the clients; returns (records, wall seconds from start to the last request's end)."""
    records: list[dict] = []
    counter = iter(range(10**12))
    url = base + "/v1/chat/completions"
    t0 = time.monotonic()
    deadline = t0 + duration

    async def client_loop(client: httpx.AsyncClient, cid: int) -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            rec = {"client": cid, "prompt_index": i % len(prompts), "status": None}
            records.append(rec)
            await one_request(client, url, model, prompts[i % len(prompts)], max_tokens, rec, t0)
            if rec["status"] == "error":  # do not spin on a refusing server
                await asyncio.sleep(min(float(rec.get("retry_after") or 0.5), max(0.0, deadline - time.monotonic())))

    timeout = httpx.Timeout(connect=10, read=duration + grace, write=10, pool=10)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(client_loop(client, c)) for c in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=duration + grace)
        for t in pending:  # still running past the grace period: cancelled, counted as lost
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ends = [r["end_s"] for r in records if r["status"] == "ok"]
    return records, (max(ends) if ends else time.monotonic() - t0)


# ---- summary ----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(mode: str, records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    errors = [r for r in records if r["status"] == "error"]
    lost = [r for r in records if r["status"] is None]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tokens = sum(r.get("completion_tokens", 0) for r in ok)
    steps = sum(r.get("verification_steps") or 0 for r in ok)
    verified = sum(r.get("verified_tokens") or 0 for r in ok)
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    return {
        "mode": mode, "requests_ok": len(ok), "errors": len(errors), "lost": len(lost),
        "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1000, 1),
        "generated_tokens": tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "mat": round(verified / steps, 3) if steps else None,
        "error_samples": sorted({r["error"] for r in errors})[:5],
    }


def markdown_table(rows: list[dict]) -> str:
    def f(v):
        return "-" if v is None else str(v)

    lines = ["| mode | requests ok | errors | lost | p50 TTFT (ms) | p99 TTFT (ms) | generated tok/s | mean MAT |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['requests_ok']} | {r['errors']} | {r['lost']} | {f(r['ttft_p50_ms'])} | "
                     f"{f(r['ttft_p99_ms'])} | {f(r['tokens_per_s'])} | {f(r['mat'])} |")
    return "\n".join(lines)


# ---- the application in this process -----------------------------------------------------------------
def wait_ready(base: str, model: str, timeout_s: float) -> None:
    """Until one short chat completion is answered (the model is loaded); it is not recorded."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise RuntimeError(f"the application did not answer within {timeout_s:.0f} s ({last})")


def run_mode(mode: str, args_for_app: dict, opts, prompts: list[str]) -> tuple[dict, list[dict]]:
    from ray import serve

    from tr_serve.serve.builder import build_app

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = args_for_app.get("model_id") or args_for_app["model"]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        t_start = time.monotonic()
        serve.run(build_app(args_for_app), blocking=False, name=APP_NAME, route_prefix="/")
        wait_ready(base, model, opts.startup_timeout)
        print(f"[{mode}] ready on {base} in {time.monotonic() - t_start:.1f} s; "
              f"{opts.clients} clients x {opts.duration:g} s", flush=True)
        records, wall = asyncio.run(drive(base, model, prompts, opts.clients, opts.duration, opts.max_tokens,
                                          opts.grace))
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()  # the next mode starts a fresh Serve instance (and a fresh adjacency matrix)
    summary = summarize(mode, records, wall)
    print(f"[{mode}] ok {summary['requests_ok']}, errors {summary['errors']}, lost {summary['lost']}, "
          f"{summary['tokens_per_s']} tok/s, MAT {summary['mat']}", flush=True)
    return summary, records


def load_test(opts) -> int:
    import ray

    prompts = load_prompts(Path(opts.data))
    _, base_args = load_config(Path(opts.config))
    modes = [(f"TR on ({opts.tree}, budget {opts.budget})", app_args(base_args, opts.tree, opts.budget,
                                                                        opts.max_num_seqs)),
             ("TR off (none)", app_args(base_args, "none", "fixed", opts.max_num_seqs))]
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
              "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "modes": []}
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        for mode, app in modes:
            summary, records = run_mode(mode, app, opts, prompts)
            result["modes"].append({**summary, "app_args": app, "requests": records})
    finally:
        ray.shutdown()
    result["loadavg_end"] = os.getloadavg()
    table = markdown_table(result["modes"])
    print()
    print(table)
    write_json(opts.json or ROOT / "bench_out" / "load_test.json", result)
    return 0 if all(m["requests_ok"] > 0 for m in result["modes"]) else 1


# ---- `serve run` startup ------------------------------------------------------------------------------
def measure_startup(opts) -> int:
    """Seconds from launching ``serve run <config>`` to the first answered chat completion."""
    raw, args = load_config(Path(opts.config))
    model = args.get("model_id") or args["model"]
    port = free_port()
    raw.setdefault("http_options", {})
    raw["http_options"].update(host="127.0.0.1", port=port)
    tmp = Path(tempfile.mkdtemp(prefix="tr_serve_startup_"))
    config = tmp / Path(opts.config).name
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    log = (tmp / "serve-run.log").open("w+b")
    base = f"http://127.0.0.1:{port}"
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0}
    serve_bin = Path(sys.executable).parent / "serve"
    t0 = time.monotonic()
    proc = subprocess.Popen([str(serve_bin), "run", str(config)], cwd=ROOT, env=subprocess_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"config": str(opts.config), "port": port}
    rc = 1
    try:
        while True:
            if proc.poll() is not None:
                print(f"serve run exited early ({proc.returncode}):\n{tail(log)}", file=sys.stderr)
                break
            if time.monotonic() - t0 > opts.startup_timeout:
                print(f"no chat answer within {opts.startup_timeout:.0f} s:\n{tail(log)}", file=sys.stderr)
                break
            try:
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
                if "http_up_s" not in result:
                    result["http_up_s"] = round(time.monotonic() - t0, 2)
                if r.status_code == 200 and r.json()["choices"][0]["message"]["content"]:
                    result["first_answer_s"] = round(time.monotonic() - t0, 2)
                    rc = 0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    finally:
        stop_serve_run(proc, result)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if rc == 0:
        print(f"serve run {opts.config} -> first answered chat completion: {result['first_answer_s']:.1f} s "
              f"(HTTP proxy answering after {result['http_up_s']:.1f} s; port {port})")
        write_json(opts.json or ROOT / "bench_out" / "startup.json", result)
    return rc


def stop_serve_run(proc: subprocess.Popen, result: dict) -> None:
    """SIGINT (Ctrl-C) and wait; SIGKILL the process group only if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            result["exit_code"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            result["exit_code"] = "killed"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in its session
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def tail(log, n: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


def write_json(path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (default 16)")
    p.add_argument("--duration", type=float, default=60, help="seconds per mode in which requests start (60)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (64)")
    p.add_argument("--tree", default="top4", help="tree of the TR-on run (default top4)")
    p.add_argument("--budget", choices=("fixed", "auto"), default="fixed", help="tree budget of the TR-on run")
    p.add_argument("--max-num-seqs", type=int, default=8, help="engine batch size / KV rows (default 8)")
    p.add_argument("--json", default=None,
                   help="output JSON (default bench_out/load_test.json, or bench_out/startup.json)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve YAML whose args are the base (smollm2-cpu)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="spec-bench style JSONL (first turns are the prompts)")
    p.add_argument("--grace", type=float, default=60,
                   help="seconds after the deadline for running requests to finish before they count as lost")
    p.add_argument("--startup-timeout", type=float, default=300, help="seconds to wait for the app to answer")
    p.add_argument("--measure-startup", action="store_true",
                   help="only measure `serve run <config>` start -> first answered chat completion (no load test)")
    opts = p.parse_args(argv)
    if opts.clients < 1 or opts.duration <= 0 or opts.max_tokens < 1 or opts.max_num_seqs < 1:
        p.error("--clients, --duration, --max-tokens and --max-num-seqs must be positive")
    return measure_startup(opts) if opts.measure_startup else load_test(opts)


if __name__ == "__main__":
    sys.exit(main())
