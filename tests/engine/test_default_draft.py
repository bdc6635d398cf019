"""The shipped default draft: loaded with no flags, exact against plain decoding, and the
CLI's --json contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlite_ray.constants import DEFAULT_LOOKUP_TOKENS
from dlite_ray.engine.engine import DLiteEngine, default_draft_dir
from dlite_ray.runtime.draft_vocab import load_draft_vocab

pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": "Write a Python function that returns the largest of three numbers."}],
           [{"role": "system", "content": "You can call tools: get_weather(city: str)."},
            {"role": "user", "content": "What is the weather in Paris?"}]]


def test_the_default_draft_is_shipped_and_small():
    path = default_draft_dir()
    assert path is not None, "dlite_ray/default_draft is missing"
    assert (path / "model.safetensors").stat().st_size <= 40 * 2**20
    subset = load_draft_vocab(path, 49152)  # it drafts from the target's frequent tokens
    assert subset is not None and 0 < subset.numel() < 49152


def test_default_engine_speculates_and_matches_plain_decoding():
    engine = DLiteEngine.from_pretrained()
    assert engine.draft is not None
    assert engine.lookup_tokens == DEFAULT_LOOKUP_TOKENS  # copying from the context is on too
    drafted = engine.draft.draft.sequential_head.drafted_ids.tolist()
    assert all(t in drafted for t in engine.eos_ids)  # it can propose the end of a reply
    plain = DLiteEngine(engine.target, engine.tokenizer, None)
    spec = engine.generate(PROMPTS, max_new_tokens=48)
    ref = plain.generate(PROMPTS, max_new_tokens=48)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ref]  # float32: exact
    assert max(r.stats.mean_accept_length for r in spec) > 1.0  # drafts were accepted


def test_cli_generate_json_contract():
    out = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "generate", "--prompt", "Say hello.",
                          "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert set(body) >= {"text", "token_ids", "stats"}
    assert set(body["stats"]) >= {"accept_lengths", "mean_accept_length", "prefill_time", "decode_wall_time",
                                  "draft_time", "verify_time", "decode_tokens_per_second"}
    assert 1 <= len(body["token_ids"]) <= 12


def test_cli_streams_a_reply_up_to_its_stop_string():
    def generate(*flags):
        out = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "generate", "--prompt", "Name three colours.",
                              "--max-new-tokens", "24", *flags],
                             capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    full = json.loads(generate("--json"))["text"]
    stop = full.split()[len(full.split()) // 2]  # a word from the middle
    assert generate("--stop", stop) == full[:full.index(stop)] + "\n"


def test_cli_reports_bad_input_clearly():
    out = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "generate", "--prompt", "x",
                          "--max-new-tokens", "0", "--draft", "none"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2 and "max_new_tokens must be > 0" in out.stderr


def test_cli_answers_in_a_json_schema_and_refuses_a_bad_one(tmp_path):
    schema = tmp_path / "colour.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "hex": {
        "type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["name", "hex"]}))
    out = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "generate", "--prompt", "Name a colour.",
                          "--max-new-tokens", "48", "--json-schema", f"@{schema}", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    reply = json.loads(json.loads(out.stdout)["text"])
    assert set(reply) == {"name", "hex"} and len(reply["hex"]) == 7
    out = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "generate", "--prompt", "x", "--draft", "none",
                          "--json-schema", '{"type": "colour"}'], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 2 and "json_schema is not usable" in out.stderr
