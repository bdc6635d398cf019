"""One construction path: EngineConfig checks its knobs once; from_pretrained is from_config;
a GGUF target reads its tokenizer out of the file, whichever way its draft is reached."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from dlite_ray.engine import loading
from dlite_ray.engine.draft_transport import DraftInfo, InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.engine_config import EngineConfig
from dlite_ray.engine.scheduler import SchedulerConfig
from tests.engine.test_requests import CharTokenizer


@pytest.fixture
def tokenizer_calls(monkeypatch):
    """AutoTokenizer.from_pretrained, recorded (tiny checkpoints ship no tokenizer)."""
    calls = []

    def from_pretrained(path, **kw):
        calls.append((path, kw))
        return CharTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return calls


def _settings(engine: DLiteEngine) -> tuple:
    return (engine.config, engine.policy.max_draft_tokens, engine.lookup_tokens, engine.runner.num_blocks,
            engine.runner.block_size, engine.runner.tap_layers, engine.scheduler.lookahead, engine.scheduler.cfg)


def test_from_pretrained_is_from_config(tiny_target_dir, tokenizer_calls):
    knobs = {"max_kv_tokens": 2048, "block_size": 8, "lookup_tokens": 3, "num_draft_tokens": 4,
             "scheduler": SchedulerConfig(max_num_seqs=4), "tap_layers": (0, 1)}
    a = DLiteEngine.from_pretrained(tiny_target_dir, None, **knobs)
    b = DLiteEngine.from_config(EngineConfig(target=tiny_target_dir, draft=None, **knobs))
    assert _settings(a) == _settings(b)
    assert a.config.device == "cpu" and a.runner.tap_layers == (0, 1) and a.draft is None
    assert [path for path, _ in tokenizer_calls] == [tiny_target_dir, tiny_target_dir]


def test_the_low_level_constructor_takes_the_same_knobs(tiny_target):
    a = DLiteEngine(tiny_target, CharTokenizer(), None, max_kv_tokens=512, block_size=4)
    b = DLiteEngine(tiny_target, CharTokenizer(), None, EngineConfig(max_kv_tokens=512, block_size=4))
    assert _settings(a) == _settings(b)


@pytest.mark.parametrize("knobs, message", [
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"device": "gpu"}, "not a torch device"),
    ({"max_kv_tokens": 0}, "must be >= 1"),
])
def test_bad_knobs_are_refused_before_anything_loads(knobs, message, monkeypatch):
    monkeypatch.setattr(loading, "load_target", lambda *a: pytest.fail("loaded a target for a bad config"))
    with pytest.raises(ValueError, match=message):
        DLiteEngine.from_pretrained("nowhere", None, **knobs)


def test_the_device_is_normalised_once():
    assert EngineConfig(device="cuda").device == "cuda:0"
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    assert EngineConfig(draft="none").draft is None


def test_default_draft_only_for_the_embedded_target(tmp_path):
    assert loading.draft_path(EngineConfig(target=tmp_path)) is None  # a custom target: plain decoding
    assert loading.draft_path(EngineConfig(target=tmp_path, draft=tmp_path)) == tmp_path
    assert loading.draft_path(EngineConfig()) == loading.default_draft_dir()


def test_a_gguf_target_reads_its_tokenizer_from_the_file(tiny_target, tiny_draft, tmp_path, monkeypatch,
                                                         tokenizer_calls):
    """Also with the draft behind a transport factory (Serve's disaggregated draft)."""
    gguf = tmp_path / "model" / "tiny.Q4.gguf"
    draft_dir = tmp_path / "draft"
    tiny_draft.save(draft_dir)
    monkeypatch.setattr(loading, "load_target", lambda path, dtype, device: tiny_target)
    made = []

    def make_draft(draft_path, info, target, target_path, config):
        made.append((draft_path, info, target_path, config))
        return InProcessDraftTransport(tiny_draft, info.fingerprint)

    engine = DLiteEngine.from_config(EngineConfig(target=gguf, draft=draft_dir, lookup_tokens=0), make_draft)
    assert tokenizer_calls == [(gguf.parent, {"gguf_file": gguf.name})]
    (draft_path, info, target_path, config), = made
    assert draft_path == draft_dir and target_path == gguf and config is engine.config
    assert dataclasses.replace(info, fingerprint="x") == DraftInfo.of("x", tiny_draft.cfg)
    assert engine.draft.info == info and engine.runner.tap_layers == info.target_layer_ids


def test_auto_dtype_is_bf16_where_the_hardware_does_bf16_math(monkeypatch):
    from dlite_ray.engine import engine_config

    monkeypatch.setattr(engine_config, "has_bf16_math", lambda: True)
    assert engine_config.resolve_dtype("auto", "cpu") == "bfloat16"
    assert EngineConfig().dtype == "bfloat16"
    monkeypatch.setattr(engine_config, "has_bf16_math", lambda: False)
    assert engine_config.resolve_dtype("auto", "cpu") == "float32"
    assert EngineConfig().dtype == "float32"
    assert engine_config.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"  # a named dtype is kept as it is
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_config.resolve_dtype("float8", "cpu")
