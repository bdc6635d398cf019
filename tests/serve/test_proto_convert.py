"""Engine chunks and conversation views as dlite.v1 messages (serve/proto_convert.py): the
typed logprob entries and conversation views the ingress passes to gRPC, field by field."""

from __future__ import annotations

from dlite_ray.serve.logprobs import LogprobEntry, TopLogprob
from dlite_ray.serve.proto_convert import proto_chunk, proto_conversation
from dlite_ray.serve.store_contract import ConversationView
from dlite_ray.serve.worker_messages import GenerateChunk


def test_a_chunks_logprob_entries_become_token_logprobs_with_their_alternatives():
    entry = LogprobEntry(token="é", logprob=-0.25, bytes=[195, 169],
                         top_logprobs=[TopLogprob(token="e", logprob=-1.5, bytes=[101])])
    message = proto_chunk(GenerateChunk([7], "é", logprobs=[entry]))
    (got,) = message.logprobs
    assert (got.token, got.logprob, got.bytes) == ("é", -0.25, "é".encode())
    assert [(t.token, t.logprob, t.bytes) for t in got.top_logprobs] == [("e", -1.5, b"e")]
    assert not got.top_logprobs[0].top_logprobs


def test_a_conversation_view_becomes_a_conversation():
    view = ConversationView(id="conv-1", tenant="t", version=3, state="paused", replica="r1", lease_deadline=9.0,
                            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                            claim_deadline=None)
    message = proto_conversation(view)
    assert (message.conversation_id, message.state, message.version) == ("conv-1", "paused", 3)
    assert [(m.role, m.content) for m in message.messages] == [("user", "hi"), ("assistant", "yo")]
