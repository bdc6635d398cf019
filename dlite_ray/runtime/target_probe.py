"""Which target a draft was trained for, checked when it is loaded.

A draft reads the target's hidden states and shares its token embedding, so a draft loaded
onto another target of the same shape (another fine-tune, another family with the same width
and vocabulary) runs without error and proposes tokens the target almost never accepts: tau
~1, slower than plain decoding, and nothing says why. Shapes are checked elsewhere
(`draft_model._check_compatible`); this records a few rows of the target's token embedding in
the draft's config when the draft is saved (`dlite_config.target_probe`) and compares them
with the target's when it is loaded. The rows survive the target's dtype and GGUF's 8-bit
quantisation (errors of ~1% of a row's magnitude) and differ wholly between unrelated models.
A config without a probe (the public release's) is loaded unchecked, with a log line.
"""

from __future__ import annotations

import logging

import torch

from dlite_ray.runtime.draft_config import DraftConfigError

log = logging.getLogger(__name__)

PROBE_ROWS, PROBE_DIMS = 8, 16
TOLERANCE = 0.1  # largest allowed difference, as a fraction of the recorded rows' largest magnitude


class TargetMismatch(DraftConfigError):
    """A draft loaded onto a target other than the one it was trained for."""


def probe_of(embedding: torch.Tensor) -> dict:
    """The probe of a token embedding [V, D]: PROBE_ROWS rows spread over the vocabulary,
    their first PROBE_DIMS values."""
    ids = torch.linspace(0, embedding.shape[0] - 1, PROBE_ROWS).round().long()
    values = embedding.detach()[ids, :PROBE_DIMS].float().cpu()
    return {"token_ids": ids.tolist(), "values": [[round(v, 6) for v in row] for row in values.tolist()]}


def check_probe(recorded: dict | None, embedding: torch.Tensor, draft: str) -> None:
    """Raise TargetMismatch when `embedding` is not the one `recorded` was taken from."""
    if recorded is None:
        log.info("draft %s records no target probe (a public checkpoint): its target is not checked", draft)
        return
    try:
        ids = torch.tensor(recorded["token_ids"], dtype=torch.long)
        want = torch.tensor(recorded["values"], dtype=torch.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise TargetMismatch(f"draft {draft}: dlite_config.target_probe is malformed ({exc})") from exc
    if int(ids.max()) >= embedding.shape[0] or want.shape[1] > embedding.shape[1]:
        raise TargetMismatch(f"draft {draft} was trained for another target: its probe reads token "
                             f"{int(ids.max())} and {want.shape[1]} dims of a {tuple(embedding.shape)} embedding")
    got = embedding.detach()[ids, :want.shape[1]].float().cpu()
    diff = float((got - want).abs().max())
    allowed = TOLERANCE * float(want.abs().max())
    if diff > allowed:
        raise TargetMismatch(
            f"draft {draft} was trained for another target: this target's token embedding differs from the "
            f"one recorded in the draft's config (largest difference {diff:.3g}, allowed {allowed:.3g}); "
            "load the target the draft was trained for, or train a draft for this one (`dlite-ray train`)")
