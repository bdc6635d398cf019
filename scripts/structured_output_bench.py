"""Structured replies (response_format / json_schema) on the default model, speculative
(the default draft) against plain decoding under the same schema.

Requests are what an agent asks for as JSON: fields extracted from text, a label, a short
plan, a tool's arguments, any JSON object. Both engines mask the target with the same
grammar, so replies must be identical. Side by side (alternating order, a warm-up pass,
medians), bf16, batch 1.

    .venv/bin/python scripts/structured_output_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

from dlite_ray.bench.paired import paired_runs, speedup_lines
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.structured_output import ANY_JSON_OBJECT


def _obj(**properties) -> str:
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
REQUESTS = [
    ("Extract the person: 'Maria Lopez, 34, moved to Madrid last year.'", _obj(name=STRING, age=INTEGER, city=STRING)),
    ("Extract the person: 'Kenji Sato (51) runs a bakery in Osaka.'", _obj(name=STRING, age=INTEGER, city=STRING)),
    ("Classify this log line: 'WARN disk /dev/sda1 is 91% full'",
     _obj(level={"enum": ["debug", "info", "warning", "error"]}, reason=STRING)),
    ("Classify this log line: 'ERROR connection refused: db:5432'",
     _obj(level={"enum": ["debug", "info", "warning", "error"]}, reason=STRING)),
    ("Give three shell commands that find large files.",
     _obj(steps={"type": "array", "items": STRING, "minItems": 3, "maxItems": 3})),
    ("Call get_weather for Tokyo in celsius.", _obj(city=STRING, unit={"enum": ["celsius", "fahrenheit"]})),
    ("Describe the book 'Dune' as JSON with its title, author and year.", ANY_JSON_OBJECT),
    ("Describe a Python function that adds two numbers: its name, arguments and return type.", ANY_JSON_OBJECT),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    engines = {"dlite": DLiteEngine.from_pretrained(dtype="bfloat16"),
               "plain": DLiteEngine.from_pretrained(draft=None, dtype="bfloat16")}

    def generate(engine, request):
        question, schema = request
        return engine.generate([{"role": "user", "content": question}], max_new_tokens=args.max_new_tokens,
                               json_schema=schema)[0]

    seconds, results = paired_runs(engines, REQUESTS, args.repeats, generate)
    texts = {name: [r.text for r in rs] for name, rs in results.items()}
    complete = sum(r.finish_reason == "stop" for r in results["dlite"])
    tokens = [len(r.token_ids) for r in results["dlite"]]
    print(f"identical replies: {texts['dlite'] == texts['plain']}; complete JSON: {complete}/{len(REQUESTS)}; "
          f"median reply {statistics.median(tokens)} tokens")
    for text in texts["dlite"]:
        print("  ", text)
    taus = [r.stats.mean_accept_length for r in results["dlite"]]
    print(f"dlite mean accept length per request: median {statistics.median(taus):.2f}")
    print("\n".join(speedup_lines(seconds, "dlite", "plain")))


if __name__ == "__main__":
    main()
