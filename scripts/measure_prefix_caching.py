"""Multi-turn chat over HTTP with prefix caching on and off, in one run: time to first token,
cached prompt tokens, tokens/s, and whether every answer is the same.

Two copies of the embedded model's app (``configs/smollm2-cpu.yaml``'s arguments; one with
``enable_prefix_caching: false``) run side by side on a local Ray instance, one CPU each. Several
conversations share one long system prompt; each turn re-sends the conversation's history and is
streamed (greedy, ``stream_options.include_usage``), sent to both apps back to back, the turns of
the conversations interleaved. A later turn's history holds the answers of the app without
caching, so both apps see the same prompts.

    python scripts/measure_prefix_caching.py [--conversations 4] [--turns 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

SYSTEM = (
    "You are the support assistant of Northwind Outfitters, a shop for hiking, camping and climbing gear. "
    "Answer in at most three sentences. Be concrete: name the product category, the size or weight that "
    "matters, and one thing to check before buying. If the customer asks about an order, a refund or a "
    "delivery, say that an agent will follow up by email within one business day and do not promise dates. "
    "Never recommend a brand we do not sell; we sell tents, sleeping bags, sleeping pads, stoves, water "
    "filters, backpacks from 20 to 80 litres, trekking poles, headlamps, harnesses, helmets, ropes, quickdraws "
    "and belay devices. Prices are in euros and include tax. Our return window is 60 days for unused items. "
    "Safety first: for climbing gear, remind the customer to retire soft goods after ten years or after a "
    "severe fall, and to follow the manufacturer's instructions. Keep a friendly, plain tone without lists."
)
OPENERS = ["I am planning a three-day hike in the Alps in September. Which sleeping bag should I take?",
           "What should I look for in a first climbing harness?",
           "Which stove works best above 3000 metres?",
           "How big a backpack do I need for a weekend trip?",
           "Is a water filter enough for streams in Scotland?",
           "Which headlamp is bright enough for night trail running?"]
FOLLOW_UPS = ["Thanks. And what about the weight, does it matter much?",
              "Could you say that again in one sentence for my friend?",
              "What is the one thing I should not forget?"]


def _app_args(prefix_caching: bool, config: Path) -> dict:
    import yaml

    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    args["engine_kwargs"]["enable_prefix_caching"] = prefix_caching
    args["ray_actor_options"] = {"num_cpus": 1}
    return args


def _turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy request: its text, time to first token and usage."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": "".join(text), "ttft_s": first, "seconds": time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--config", type=Path, default=Path(__file__).resolve().parent.parent / "configs/smollm2-cpu.yaml")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import openai
    import ray
    from ray import serve

    from tr_serve.serve.builder import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8123})
        model = _app_args(True, args.config)["model_id"]
        for name, caching in (("on", True), ("off", False)):
            serve.run(build_app(_app_args(caching, args.config)), name=name, route_prefix=f"/{name}", blocking=False)
        clients = {name: openai.OpenAI(base_url=f"http://127.0.0.1:8123/{name}/v1", api_key="none", max_retries=0,
                                       timeout=600) for name in ("on", "off")}
        for name, client in clients.items():  # up, and warm: one request that no conversation shares
            for _ in range(600):
                try:
                    client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Hello"}])
                    break
                except openai.APIError:
                    time.sleep(1)
        histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": OPENERS[c % len(OPENERS)]}]
                     for c in range(args.conversations)]
        results: dict[str, list[dict]] = {"on": [], "off": []}
        differ = 0
        for turn in range(args.turns):
            for c, history in enumerate(histories):
                got = {}
                for name in ("off", "on") if (turn + c) % 2 else ("on", "off"):  # who goes first alternates
                    got[name] = _turn(clients[name], model, history, args.max_tokens)
                    results[name].append({**got[name], "turn": turn, "conversation": c})
                differ += got["on"]["text"] != got["off"]["text"]
                history += [{"role": "assistant", "content": got["off"]["text"]},
                            {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
        report = {"conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
                  "answers_that_differ": differ}
        for name, rows in results.items():
            later = [r for r in rows if r["turn"] > 0]
            report[name] = {
                "mean_ttft_first_turns_s": statistics.mean(r["ttft_s"] for r in rows if r["turn"] == 0),
                "mean_ttft_later_turns_s": statistics.mean(r["ttft_s"] for r in later),
                "cached_share_later_turns": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
                "hit_rate_all": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
                "tokens_per_s": sum(r["completion_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
            }
        report["later_turns_ttft_on_over_off"] = (report["on"]["mean_ttft_later_turns_s"]
                                                  / report["off"]["mean_ttft_later_turns_s"])
        print(json.dumps(report, indent=2))
        if args.json:
            args.json.write_text(json.dumps({"report": report, "requests": results}, indent=2))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
