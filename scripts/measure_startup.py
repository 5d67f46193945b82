"""Start-up of a served model through ``serve run``: time to ready, first completion, peak memory.

    python scripts/measure_startup.py --tp 1 2                  # a ~2.1 GB random Llama in 4 files, tp=1 then tp=2
    python scripts/measure_startup.py --config configs/smollm2-cpu.yaml --launcher tr-serve --keep-cache  # `make run`

``--config`` serves that Serve config instead (on a free port; ``--tp`` is then ignored), and
``--launcher tr-serve`` starts it as ``make run`` does (``tr-serve run``) rather than ``serve run``.

1. Writes a random-weight Llama checkpoint (bfloat16, 16 layers of hidden 2048, vocabulary 49152
   with the embedded model's tokenizer: 2.15 GB in 4 safetensors files) under ``--dir``, unless
   ``--model`` names another model.
2. For each ``--tp``: writes a Serve config (tree ``auto``; tp > 1 in a placement group of
   ``1 + tp`` bundles sharing the machine's CPUs) and starts ``serve run`` on it in a session of its
   own, with a fresh ``TR_SERVE_CACHE`` (nothing cached: no kernel plan, latency table or prior)
   unless ``--keep-cache``.
3. From the start, every 0.5 s: ``/health``, ``/v1/models`` (do they agree?), and ``VmHWM`` (peak
   resident set) of every process of the run's session (``serve run``, Ray's GCS, raylet and
   workers: the replica, the ingress, the tensor-parallel ranks). A completion is sent as soon as
   the HTTP proxy answers (what happens to a request sent before ready), then one when ``/health``
   says 200 (the first completion after ready).
4. Keeps sampling for ``--after-ready`` seconds while the deferred start-up work runs (the kernel
   plan's measurement and packing; ``/v1/tr/stats`` reports what is pending), then stops the run
   (SIGINT to its process group) and reports per run: seconds to ready and to the first
   completion, the largest process's peak at ready and at the end, and tp>1 / tp=1 ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = 49152  # the embedded model's tokenizer: ids of real text stay inside the vocabulary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(folder: Path) -> dict:
    """The random checkpoint, with the embedded model's tokenizer beside it."""
    from scripts import measure_tp_loading
    from tr_serve.model_loader import load_model

    measure_tp_loading.CONFIG.update(vocab_size=VOCAB)
    folder.mkdir(parents=True, exist_ok=True)
    info = measure_tp_loading.write_checkpoint(folder, 16, 4)
    load_model("smollm2-135m-instruct").tokenizer.save_pretrained(folder)
    return info


def serve_config(model: str, tp: int, port: int) -> dict:
    args = {"model": model, "model_id": "m",
            "engine_kwargs": {"tree": "auto", "k": 8, "max_num_seqs": 4, "max_model_len": 2048, "device": "cpu",
                              "dtype": "float32"},
            "max_ongoing_requests": 8, "num_replicas": 1, "ingress": {"ray_actor_options": {"num_cpus": 0}}}
    if tp == 1:
        args["ray_actor_options"] = {"num_cpus": 2}
    else:
        worker = round(1.5 / tp, 3)  # the replica half a CPU, the ranks the rest of two
        args.update(tensor_parallel_size=tp, cpu_threads=1, ray_actor_options={"num_cpus": 0.5},
                    placement_group_bundles=[{"CPU": 0.5}] + [{"CPU": worker}] * tp,
                    placement_group_strategy="STRICT_PACK", init_timeout_s=1200)
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "tr_serve", "route_prefix": "/", "import_path": "tr_serve.serve.builder:build_app",
                              "args": args}]}


def session_processes(root: int) -> list[int]:
    """``root`` and every process under it."""
    import psutil

    try:
        parent = psutil.Process(root)
        return [root] + [c.pid for c in parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def vm_hwm_kb(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return int(fields["VmHWM"].split()[0]), (fields["Name"].strip() + " " + cmd)[:120]
    except (OSError, KeyError, ValueError):
        return None


class Sampler(threading.Thread):
    """The peak ``VmHWM`` of every process ever seen under ``root``, every ``period`` seconds."""

    def __init__(self, root: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.peaks: dict[int, tuple[int, str]] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run(self):
        while not self.stop.is_set():
            for pid in session_processes(self.root):
                got = vm_hwm_kb(pid)
                if got is not None:
                    with self.lock:
                        old = self.peaks.get(pid)
                        self.peaks[pid] = (max(got[0], old[0] if old else 0), got[1])
            self.stop.wait(self.period)

    def largest(self) -> tuple[int, str]:
        with self.lock:
            return max(self.peaks.values(), default=(0, ""))

    def top(self, n: int = 6) -> list[dict]:
        with self.lock:
            ranked = sorted(self.peaks.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"pid": pid, "vm_hwm_mib": round(kb / 1024), "process": name} for pid, (kb, name) in ranked]


def get(url: str, timeout: float = 5.0):
    import httpx

    try:
        return httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None


def models_listed(base: str) -> bool:
    r = get(base + "/v1/models")
    try:
        return bool(r is not None and r.status_code == 200 and r.json().get("data"))
    except ValueError:  # Serve's proxy before the ingress: plain text
        return False


def complete(base: str, timeout: float) -> dict:
    import httpx

    t0 = time.monotonic()
    try:
        r = httpx.post(base + "/v1/completions", timeout=timeout,
                       json={"model": "m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
        body = r.json()
        return {"status": r.status_code, "seconds": round(time.monotonic() - t0, 2),
                "code": body.get("error", {}).get("code") if r.status_code != 200 else None,
                "retry_after": r.headers.get("retry-after"),
                "tokens": body.get("usage", {}).get("completion_tokens") if r.status_code == 200 else None}
    except (httpx.HTTPError, ValueError) as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}", "seconds": round(time.monotonic() - t0, 2)}


def run_one(model: str, tp: int, args, cache: Path) -> dict:
    import yaml

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix=f"tr_startup_tp{tp}_"))
    config = workdir / "serve.yaml"
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text())
        data.setdefault("http_options", {}).update(host="127.0.0.1", port=port)
        for app in data["applications"]:  # the requests name the first app's model
            app.setdefault("args", {})["model_id"] = "m"
    else:
        data = serve_config(model, tp, port)
    config.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TR_SERVE_CACHE=str(cache),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RAY_ADDRESS", None)
    launcher = Path(sys.executable).with_name("serve" if args.launcher == "serve" else "tr-serve")
    log = open(workdir / "serve.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(launcher), "run", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=workdir)
    sampler = Sampler(proc.pid)
    sampler.start()
    out: dict = {"tp": tp, "model": model, "log": str(workdir / "serve.log")}
    early: dict = {}
    disagreements, polls = [], 0
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {proc.returncode}; see {workdir / 'serve.log'}")
            elapsed = time.monotonic() - t0
            if elapsed > args.timeout:
                out["ready_s"] = None
                break
            health = get(base + "/health")
            ingress_up = health is not None and health.headers.get("content-type", "").startswith("application/json")
            if health is not None and not ingress_up and "proxy_only" not in out:  # Serve's proxy, no app yet
                out["proxy_only"] = {"t_s": round(elapsed, 1), "status": health.status_code,
                                     "body": health.text[:120]}
            if ingress_up and "sent_at_s" not in early:  # the ingress answers: a request now
                early["sent_at_s"] = round(elapsed, 1)
                early["health_then"] = health.status_code
                thread = threading.Thread(target=lambda: early.update(complete(base, args.timeout)), daemon=True)
                thread.start()
            if health is not None:
                listed = models_listed(base)
                polls += 1
                if listed != (health.status_code == 200):  # or the replica became ready between the two
                    again = get(base + "/health")
                    if again is None or models_listed(base) != (again.status_code == 200):
                        disagreements.append({"t_s": round(elapsed, 1), "health": health.status_code,
                                              "listed": listed})
                    continue
                if health.status_code == 200:
                    out["ready_s"] = round(elapsed, 1)
                    out["peak_at_ready"] = sampler.top()
                    break
            time.sleep(0.5)
        if out.get("ready_s") is not None:
            first = complete(base, args.timeout)
            out["first_completion"] = {**first, "done_at_s": round(time.monotonic() - t0, 1)}
            deadline = time.monotonic() + args.after_ready
            while time.monotonic() < deadline:  # the deferred start-up work
                stats = get(base + "/v1/tr/stats", timeout=30)
                data = stats.json().get("data", []) if stats is not None and stats.status_code == 200 else []
                pending = [d.get("startup_work", {}) for d in data]
                out["startup_work"] = pending
                if pending and all(not p.get("pending") for p in pending):
                    break
                time.sleep(5)
            out["startup_work_checked_at_s"] = round(time.monotonic() - t0, 1)
            out["completion_after_work"] = complete(base, args.timeout)
        if "thread" in locals():
            thread.join(timeout=args.timeout)
        out["request_before_ready"] = early
        out["models_vs_health"] = {"polls": polls, "disagreements": disagreements}
    finally:
        out["peak_at_end"] = sampler.top()
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sampler.stop.set()
        log.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="serve this model instead of writing a random checkpoint")
    ap.add_argument("--dir", default="/tmp/tr_startup_llama", help="where the random checkpoint is (written if absent)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--config", help="serve this Serve config (its first app's model) instead")
    ap.add_argument("--launcher", choices=("serve", "tr-serve"), default="serve",
                    help="`serve run` (default) or `tr-serve run` (what `make run` runs)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take to become ready")
    ap.add_argument("--after-ready", type=float, default=300,
                    help="seconds to keep sampling while the deferred start-up work runs")
    ap.add_argument("--keep-cache", action="store_true", help="use the user cache instead of a fresh one per run")
    ap.add_argument("--json", default="bench_out/startup.json")
    args = ap.parse_args(argv)
    model = args.model
    report: dict = {"runs": []}
    if args.config:
        args.tp = [1]
        model = args.config
    elif model is None:
        folder = Path(args.dir)
        if not (folder / "model.safetensors.index.json").exists():
            t0 = time.monotonic()
            info = write_model(folder)
            print(f"wrote {info['bytes'] / 1e9:.2f} GB in {info['files']} files to {folder} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        files = sorted(folder.glob("*.safetensors"))
        report["checkpoint"] = {"dir": str(folder), "bytes": sum(f.stat().st_size for f in files), "files": len(files)}
        model = str(folder)
    for tp in args.tp:
        cache = Path(tempfile.mkdtemp(prefix="tr_startup_cache_")) if not args.keep_cache else None
        try:
            from tr_serve.model_loader import cache_root

            run = run_one(model, tp, args, cache or cache_root())
        finally:
            if cache is not None:
                shutil.rmtree(cache, ignore_errors=True)
        report["runs"].append(run)
        largest_ready = max((p["vm_hwm_mib"] for p in run.get("peak_at_ready", [])), default=None)
        largest_end = max((p["vm_hwm_mib"] for p in run["peak_at_end"]), default=None)
        print(f"tp={tp}: ready {run.get('ready_s')} s, first completion {run.get('first_completion')}, largest "
              f"process peak {largest_ready} MiB at ready, {largest_end} MiB at the end; request before ready: "
              f"{run.get('request_before_ready')}; /v1/models vs /health: {run['models_vs_health']}", flush=True)
    by_tp = {r["tp"]: r for r in report["runs"]}
    if 1 in by_tp:
        for tp, r in by_tp.items():
            if tp == 1:
                continue
            for when in ("peak_at_ready", "peak_at_end"):
                a = max((p["vm_hwm_mib"] for p in r.get(when, [])), default=0)
                b = max((p["vm_hwm_mib"] for p in by_tp[1].get(when, [])), default=0)
                if a and b:
                    report[f"ratio_tp{tp}_tp1_{when}"] = round(a / b, 3)
    report["method"] = ("VmHWM from /proc/PID/status of every process under `serve run` (its session: Ray's GCS, "
                        "raylet, workers, the replica, the ingress, tensor-parallel ranks), sampled every 0.5 s; "
                        "ready = first /health 200 after `serve run` started")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k.startswith("ratio")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
