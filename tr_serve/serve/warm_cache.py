"""``tr-serve prepare CONFIG.yaml``: a replica's start-up work done ahead of time, into the user cache.

    tr-serve prepare configs/smollm2-cpu.yaml     # then `tr-serve run` finds everything cached

A replica becomes ready as soon as its weights are loaded (serve/server.py): a kernel plan or a
matrix prior that is not cached yet is built after that, between steps, and a missing latency
table is a provisional one measured in seconds (runner/startup_work.py). This command builds, for
every tr_serve application of a Serve config, the engine its replica would build, with nothing
deferred: the kernel plan measured, the latency table calibrated in full, the matrix prior
computed, each cached under the key the replica looks up (same model, engine settings and torch
threads). Under tensor parallelism it starts a local Ray for the ranks. Run it on the machine (or
image) that serves, since plans and latencies are per CPU.
"""

from __future__ import annotations

import logging
import sys
import time

from tr_serve.cli_args import UsageError

BUILD_APP = "tr_serve.serve.builder:build_app"


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="measure and cache a replica's kernel plan, latency table and matrix prior "
                                       "ahead of time",
                       description="Do the start-up work of every tr_serve application of a Serve config ahead of "
                                   "time (kernel plan, full latency calibration, matrix prior), into the user cache "
                                   "that its replicas read.")
    p.add_argument("config", help="Serve config YAML (e.g. configs/smollm2-cpu.yaml)")
    p.set_defaults(func=execute)


def app_configs(path: str) -> list:
    """The ``TRServeConfig`` of each tr_serve application in the Serve config at ``path``."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from tr_serve.serve.config import ConfigError, TRServeConfig

    try:
        with open(path) as f:
            schema = ServeDeploySchema.model_validate(yaml.safe_load(f))
    except (OSError, yaml.YAMLError, ValidationError) as e:
        raise UsageError(f"cannot read Serve config {path}: {str(e).splitlines()[0]}") from None
    try:
        configs = [TRServeConfig.from_args(dict(app.args or {})) for app in schema.applications
                   if app.import_path == BUILD_APP]
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if not configs:
        raise UsageError(f"{path} has no application with import_path {BUILD_APP}")
    return configs


def prepare(config) -> dict:
    """Build the engine a replica of ``config`` (a ``TRServeConfig``) builds, nothing deferred;
    what it took."""
    import torch

    from tr_serve.engine.engine import Engine
    from tr_serve.model_loader import load_model

    threads = config.resolved_cpu_threads()
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # the plan and the latency table are keyed by the replica's threads
    engine_config = config.engine_config()
    t0 = time.monotonic()
    try:
        if config.tensor_parallel_size > 1:
            from tr_serve.tp.runner import tp_engine

            engine = tp_engine(engine_config.model, engine_config, config.tensor_parallel_size,
                               worker_cpus=config.worker_cpus, step_timeout_s=config.step_timeout_s,
                               init_timeout_s=config.init_timeout_s)
        else:
            engine = Engine(load_model(engine_config.model, engine_config.device, engine_config.dtype), engine_config)
        engine.shutdown()
    finally:
        torch.set_num_threads(previous)
    return {"model": config.served_model_id, "seconds": round(time.monotonic() - t0, 1)}


def execute(args) -> int:
    logging.basicConfig(level=logging.INFO, format="tr-serve prepare: %(message)s")
    for config in app_configs(args.config):
        print(f"tr-serve prepare: {config.served_model_id}: building its engine with nothing deferred", file=sys.stderr,
              flush=True)
        done = prepare(config)
        print(f"tr-serve prepare: {done['model']}: cached in {done['seconds']} s", file=sys.stderr, flush=True)
    return 0
