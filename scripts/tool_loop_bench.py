"""Tool-loop replies on the default model, speculative (the default draft) against plain.

The request is what an agent sends on its third turn: tools offered, and two earlier
get_weather calls in the history as OpenAI tool_calls messages. The model calls the tool
again; the reply is parsed as the server parses it. Both engines run side by side
(alternating order, a warm-up pass, medians), bf16, batch 1.

    .venv/bin/python scripts/tool_loop_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json

from dlite_ray.bench.paired import paired_runs, speedup_lines
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.openai_requests import parse_chat
from dlite_ray.serve.tool_calls import parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Berlin", "Tokyo", "Oslo", "Lisbon", "Cairo", "Lima", "Seoul", "Quebec City"]


def agent_history() -> list[dict]:
    history = []
    for city, weather in (("Paris", "18 C, sunny"), ("Rome", "24 C, clear")):
        call = {"id": f"call_{city}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        history += [{"role": "user", "content": f"What's the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": weather},
                    {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    requests = [parse_chat({"messages": [*agent_history(), {"role": "user", "content": f"Weather in {c}?"}],
                            "tools": [WEATHER]}, LimitArgs()) for c in CITIES]
    engines = {"dlite": DLiteEngine.from_pretrained(dtype="bfloat16"),
               "plain": DLiteEngine.from_pretrained(draft=None, dtype="bfloat16")}
    seconds, results = paired_runs(engines, requests, args.repeats,
                                   lambda engine, req: engine.generate(req.prompt, max_new_tokens=args.max_new_tokens)[0])
    texts = {name: [r.text for r in rs] for name, rs in results.items()}
    calls = sum(parse_tool_calls(t, requests[0].tools) is not None for t in texts["dlite"])
    print(f"identical replies: {texts['dlite'] == texts['plain']}; replies that are calls: {calls}/{len(CITIES)}")
    print("e.g.", texts["dlite"][:2])
    print("\n".join(speedup_lines(seconds, "dlite", "plain")))


if __name__ == "__main__":
    main()
