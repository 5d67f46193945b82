"""``tr-serve run CONFIG``: ``serve run CONFIG`` with a graceful drain and Ray's token auth kept on.

    tr-serve run configs/smollm2-cpu.yaml                  # what `make run` runs
    tr-serve run configs/smollm2-cpu.yaml --drain-timeout 60
    python -m tr_serve.serve.run configs/smollm2-cpu.yaml  # the same

It deploys the Serve config as ``serve run`` does, then waits. On SIGINT (Ctrl-C) or SIGTERM (what
Kubernetes and process managers send) it first drains every tr_serve application: the ingress
refuses new generation requests with 503 and gives the ones in flight ``drain_timeout_s`` (the
app's config, or ``--drain-timeout``) to finish; a request still running then ends with an in-band
error event and ``data: [DONE]``. Only then does it shut Serve and Ray down. A second signal skips
what is left of the drain. (Ray's own ``serve run`` kills the HTTP proxy as soon as it shuts down,
which cuts every open stream; on SIGTERM it does not shut Serve down at all.)

Without ``--address`` (or ``RAY_ADDRESS``) it starts a single-node local Ray that listens on
loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-node mode, whose node address
is 127.0.0.1; otherwise Ray binds its GCS, raylet, workers and metrics endpoints to every
interface) and whose token authentication is on, so another user of the same machine cannot use
the cluster either. The token comes from ``RAY_AUTH_TOKEN``, or the file ``RAY_AUTH_TOKEN_PATH`` /
``~/.ray/auth_token``, generated on first run with owner-only permissions (0600; a token file
readable by others is tightened to 0600). Ray's CLI (``ray status``, ``serve status``) finds the
same file. With ``--address`` the cluster's own settings apply.

It fails closed: when Serve's HTTP host (``http_options.host``; Serve's config default is 0.0.0.0)
is not a loopback address, it refuses to start, in one line, unless every application has an API
key (``api_keys`` or ``tenants`` in its args, or ``TR_SERVE_API_KEYS`` where ``tr-serve run`` runs,
which the local Ray's replicas inherit) or says ``allow_unauthenticated: true`` in its args.

The local Ray runs in a session of its own: ``tr-serve run`` starts a second copy of itself in a new
session (so a new process group) that starts Ray and drains, and the first copy only forwards it
SIGINT and SIGTERM and returns its exit status. A signal to the whole process group (``kill --
-PGID``, Ctrl-C in a terminal) then reaches that forwarder alone, not Ray's GCS and raylet: were they
to get it they would exit at once, the drain would have no cluster to drain (streams cut, then a
minute of "Failed to connect to GCS" before the exit). If the forwarder dies, even by SIGKILL, the
second copy gets SIGKILL (Linux' parent-death signal) and Ray's processes go with it, as they go
with the process that started them. (systemd's ``KillMode=control-group`` signals every process of
the unit's cgroup whatever its session: use ``KillMode=mixed``, which sends SIGTERM to the main
process only.)
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

TOKEN_ENV = "RAY_AUTH_TOKEN"
# Ray's single-node mode (its default on macOS and Windows): the node's address is 127.0.0.1, so the
# GCS, raylet, workers, agents and metrics endpoints listen on loopback only
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DESCRIPTION = ("Deploy a Serve config as `serve run` does, on a local Ray with token authentication (or --address); "
               "on SIGINT/SIGTERM drain the tr_serve applications (in-flight requests get drain_timeout_s), then "
               "shut Serve and Ray down.")
DRAIN_EXTRA_S = 10.0  # past the drain timeout, how long to wait for the ingress to end its streams
OWN_SESSION_FLAG = "--in-own-session"  # (hidden) this copy runs in the session the forwarder made for it
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def log(msg: str) -> None:
    print(f"tr-serve run: {msg}", file=sys.stderr, flush=True)


# ---- Ray token -------------------------------------------------------------------------------
def token_path() -> Path:
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token").expanduser()


def ensure_token() -> str:
    """Where the cluster token comes from; generates it (0600) on first use."""
    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV}"
    path = token_path()
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            os.chmod(path, 0o600)
            log(f"the Ray token file {path} was readable by others (mode {mode:o}): now 0600")
        if not path.read_text().strip():
            raise SystemExit(f"tr-serve run: the Ray token file {path} is empty; remove it to generate a new one")
        return str(path)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # Ray's own format: 256 bits, hex
    log(f"generated a Ray cluster token in {path} (mode 0600)")
    return str(path)


# ---- fail closed ---------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only: ``localhost`` or a loopback IP (127.0.0.0/8, ::1).
    Nothing is resolved; any other name, the wildcard addresses and an empty host are not."""
    host = (host or "").strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("localhost", "localhost.") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _has_key(args: dict) -> bool:
    keys = list(args.get("api_keys") or [])
    tenants = args.get("tenants") or {}
    if isinstance(tenants, dict):
        keys += [k for ks in tenants.values() for k in (ks or [])]
    return any(isinstance(k, str) and k.strip() for k in keys)


def auth_refusal(host: str, app_args: dict[str, dict], environ=None) -> str | None:
    """Why ``tr-serve run`` must not start (one line), or None: Serve's HTTP proxy would listen on
    ``host``, not loopback, while an application (name -> args) has no API key (``api_keys`` or
    ``tenants`` in its args, or ``TR_SERVE_API_KEYS`` in ``environ``) and does not say
    ``allow_unauthenticated: true``."""
    from tr_serve.serve.config import API_KEYS_ENV

    if is_loopback(host):
        return None
    environ = os.environ if environ is None else environ
    if any(k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")):
        return None
    open_apps = [name for name, args in app_args.items()
                 if not _has_key(args or {}) and (args or {}).get("allow_unauthenticated") is not True]
    if not open_apps:
        return None
    return (f"refusing to start: HTTP host {host or '(empty)'} is not loopback and no API key is configured for "
            f"{', '.join(open_apps)}: set {API_KEYS_ENV} or api_keys, or allow_unauthenticated: true in the "
            "app's args to serve it open")


# ---- drain -----------------------------------------------------------------------------------
def tr_serve_apps(app_names: Sequence[str]) -> list[str]:
    """The applications of the config whose ingress is tr_serve's."""
    from ray import serve

    from tr_serve.serve.builder import INGRESS_NAME

    status = serve.status()
    return [name for name in app_names
            if name in status.applications and INGRESS_NAME in status.applications[name].deployments]


def drain(app_args: dict[str, dict], timeout_s: float | None, stop_waiting: threading.Event) -> None:
    """Broadcast ``drain`` to every tr_serve ingress replica of the apps (name -> args), then wait
    until none has a request in flight (or the drain timeout plus ``DRAIN_EXTRA_S`` passed, or
    ``stop_waiting`` is set)."""
    from ray import serve

    from tr_serve.serve.builder import INGRESS_NAME

    try:
        apps = tr_serve_apps(list(app_args))
    except Exception as e:
        log(f"no drain: cannot read Serve's status ({type(e).__name__}: {e})")
        return
    handles = {}
    for app in apps:
        handle = serve.get_deployment_handle(INGRESS_NAME, app)
        try:
            replies = handle.broadcast("drain", timeout_s).results(timeout_s=10, return_exceptions=True)
        except Exception as e:  # no running ingress replica: nothing in flight there
            log(f"{app}: no drain ({type(e).__name__})")
            continue
        in_flight = sum(r["in_flight"] for r in replies if isinstance(r, dict))
        log(f"{app}: draining {len(replies)} ingress replica(s), {in_flight} request(s) in flight")
        handles[app] = handle
    if not handles:
        return
    grace = timeout_s if timeout_s is not None else max(drain_timeout_s(app_args[a]) for a in handles)
    deadline = time.monotonic() + grace + DRAIN_EXTRA_S
    t0 = time.monotonic()
    while not stop_waiting.is_set():
        left = 0
        for app, handle in handles.items():
            try:
                replies = handle.broadcast("drain_status").results(timeout_s=5, return_exceptions=True)
            except Exception:
                continue
            left += sum(r["in_flight"] for r in replies if isinstance(r, dict))
        if left == 0:
            log(f"drained in {time.monotonic() - t0:.1f} s")
            return
        if time.monotonic() > deadline:
            log(f"{left} request(s) still in flight after {time.monotonic() - t0:.1f} s: shutting down anyway")
            return
        stop_waiting.wait(0.25)
    log("second signal: skipping the rest of the drain")


def drain_timeout_s(args: dict) -> float:
    """An app's ``drain_timeout_s`` as its args say (the default for args that do not validate)."""
    from tr_serve.serve.config import TRServeConfig

    try:
        return TRServeConfig.from_args(args).drain_timeout_s
    except Exception:
        return TRServeConfig().drain_timeout_s


# ---- own session -----------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux), so that nothing of the
    session outlives a forwarder that was killed; exits at once if the parent is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(70)  # EX_SOFTWARE: without it a killed forwarder would leave Ray running
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(70)


def _child_argv(args) -> list[str]:
    """The command line of the copy that runs in its own session: this one's arguments."""
    argv = [sys.executable, "-m", "tr_serve.serve.run", args.config, OWN_SESSION_FLAG]
    if args.address:
        argv += ["--address", args.address]
    if args.drain_timeout is not None:
        argv += ["--drain-timeout", repr(args.drain_timeout)]
    if args.num_cpus is not None:
        argv += ["--num-cpus", str(args.num_cpus)]
    if args.no_dashboard:
        argv.append("--no-dashboard")
    return argv


def run_in_own_session(args) -> int:
    """Run ``tr-serve run`` again in a new session (see the module docstring) and forward SIGINT and
    SIGTERM to it until it exits; its exit status (128 + N for a signal N, as a shell reports it)."""
    preexec = (lambda parent=os.getpid(): _die_with_parent(parent)) if sys.platform.startswith("linux") else None
    child = subprocess.Popen(_child_argv(args), start_new_session=True, preexec_fn=preexec)

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    rc = child.wait()  # retried after each forwarded signal (PEP 475)
    return 128 - rc if rc < 0 else rc


# ---- main ------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("run", help="serve a Ray Serve config (as `serve run`), draining on SIGINT/SIGTERM",
                       description=DESCRIPTION)
    _arguments(p)
    p.set_defaults(func=lambda args: run(args))


def _arguments(p) -> None:
    p.add_argument("config", help="Serve config YAML (e.g. configs/smollm2-cpu.yaml)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="an existing Ray cluster to deploy to (default: $RAY_ADDRESS, else a new local one)")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="seconds in-flight requests get on SIGINT/SIGTERM (default: each app's drain_timeout_s)")
    p.add_argument("--no-dashboard", action="store_true", help="do not start Ray's dashboard (local Ray only)")
    p.add_argument("--num-cpus", type=int, default=None, metavar="N",
                   help="CPUs the local Ray offers its tasks and actors (default: all of this machine's)")
    p.add_argument(OWN_SESSION_FLAG, action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    local = args.address in (None, "", "local")
    if local and os.name == "posix" and not args.in_own_session:
        return run_in_own_session(args)
    if local:  # before Ray reads its settings (it caches them when first imported)
        os.environ[LOCAL_ONLY_ENV] = "0"
        os.environ["RAY_AUTH_MODE"] = "token"
        token_source = ensure_token()
        if "ray" in sys.modules:
            import ray._private.ray_constants as ray_constants
            from ray._raylet import Config  # type: ignore[attr-defined]  # compiled: no stub

            ray_constants.ENABLE_RAY_CLUSTER = False
            Config.initialize("")  # re-read RAY_AUTH_MODE, as ray's own token set-up does

    import yaml
    from ray.serve.schema import ServeDeploySchema

    with open(args.config) as f:
        config = ServeDeploySchema.model_validate(yaml.safe_load(f))
    app_args = {app.name: dict(app.args or {}) for app in config.applications}
    refusal = auth_refusal(config.http_options.host, app_args)
    if refusal:
        raise SystemExit(f"tr-serve run: {refusal}")

    import ray
    from ray import serve
    from ray.serve._private import api as serve_api  # what `serve run` itself calls
    from ray.serve.config import gRPCOptions

    if local:
        log(f"starting a local Ray on loopback with token authentication (token: {token_source})")
        ray.init(address="local", namespace="serve", dashboard_host="127.0.0.1", num_cpus=args.num_cpus,
                 include_dashboard=False if args.no_dashboard else None)
    else:
        ray.init(address=args.address, namespace="serve")
    log(f"Ray GCS at {ray.get_runtime_context().gcs_address}")

    stop = threading.Event()
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            log(f"got {signal.Signals(signum).name}: draining (a second signal skips the drain)")
        stop.set()
        if len(signals) > 1:
            skip.set()

    skip = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, on_signal)

    try:
        client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                       proxy_location=config.proxy_location,
                                       grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                                       controller_options=config.controller_options)
        client.deploy_apps(config, _blocking=False)
        http = config.http_options
        log(f"submitted {len(config.applications)} application(s); HTTP on http://{http.host}:{http.port}")
        prefixes = {app.name: app.route_prefix or "" for app in config.applications}
        ready, failed = False, set()
        while not stop.is_set():
            if not ready:
                try:
                    statuses = serve.status().applications
                except Exception:
                    statuses = {}
                for name, st in statuses.items():
                    if st.status == "DEPLOY_FAILED" and name not in failed:
                        failed.add(name)
                        log(f"{name}: deployment failed: {st.message}")
                if all(n in statuses and statuses[n].status == "RUNNING" for n in prefixes):
                    ready = True
                    log("ready: " + ", ".join(f"{n} at http://{http.host}:{http.port}{p}" for n, p in prefixes.items()))
            stop.wait(1.0)
        drain(app_args, args.drain_timeout, skip)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    log("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tr-serve run", description=DESCRIPTION)
    _arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
