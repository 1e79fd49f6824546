"""Chunked log-probs change memory and time, not training (`train.logits_chunk_tokens`): the same periodic run, 3
iterations, with the output layer run 16 response tokens at a time and with the whole logits, gives token-identical
rollouts and parameters equal to float32 rounding (the chunks' matrix products sum in another order), far closer than
training moved them; and the chunked run did take every policy log-prob from chunks."""

from __future__ import annotations

import models.trainer
from tests.integration.runs import final_params, trained

ITERS = 3


def _run(tmp_path, name, chunk):
    return trained(tmp_path, name, {"run.iterations": ITERS, "train.logits_chunk_tokens": chunk})


def test_a_chunked_run_equals_a_whole_logits_one(tmp_path, monkeypatch):
    calls = {"chunked": 0, "whole": 0}
    real_chunked, real_whole = models.trainer.chunked_logprobs, models.trainer.packed_logits

    def chunked(*args, **kwargs):
        calls["chunked"] += 1
        return real_chunked(*args, **kwargs)

    def whole(*args, **kwargs):
        calls["whole"] += 1
        return real_whole(*args, **kwargs)

    monkeypatch.setattr(models.trainer, "chunked_logprobs", chunked)
    monkeypatch.setattr(models.trainer, "packed_logits", whole)
    whole_params, whole_samples = _run(tmp_path, "whole", None)
    assert calls["chunked"] == 0 and calls["whole"] >= ITERS
    calls["whole"] = 0
    chunked_params, chunked_samples = _run(tmp_path, "chunked", 16)
    assert calls["whole"] == 0 and calls["chunked"] >= ITERS, calls
    assert whole_samples.keys() == chunked_samples.keys() and len(whole_samples) == ITERS * 8 * 4
    assert all(a.response_ids == chunked_samples[k].response_ids for k, a in whole_samples.items())
    initial = final_params(str(tmp_path / "lake"), "whole", 0)
    moved = max(float((whole_params[k] - initial[k]).abs().max()) for k in whole_params)
    apart = max(float((whole_params[k] - chunked_params[k]).abs().max()) for k in whole_params)
    assert moved > 1e-3 and apart < 1e-5, (moved, apart)  # training moved the weights; chunking did not
