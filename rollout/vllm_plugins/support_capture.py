"""The kept sets of a truncated sampler, from vLLM's V1 model runner: at every sampled position, the token ids top-k,
top-p and min-p left to sample from (``rollout.support``).

vLLM's own record of them (``return_sampling_mask``, ``SamplingMask``) needs Model Runner V2 (``config/vllm.py``
``_verify_sampling_replay_config``: "sampling distribution replay requires Model Runner V2"), which the CPU build
cannot run. The V1 runner's sampler still shows the set: with ``logprobs_mode="processed_logprobs"`` its
``Sampler.sample`` returns, per sampling row, the log-probs of the distribution it sampled from, ``-inf`` on every
token min-p (an argmax-invariant logits processor), top-k and top-p removed and finite on the rest
(``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``). The finite entries are the kept set, exactly: the
engine's own values, ties at a boundary settled as its sampler settled them.

Rows: with chunked prefill off (``rollout.vllm_engine``), every request of a step samples one token, in the order of
``input_batch.req_ids`` (a prefill samples its first token, a decode its next); a step whose sampling rows are not
the batch's requests is refused rather than guessed. ``take_supports`` assembles each request's rows in order, one
set per completion token. Request ids as ``route_capture``: the caller's ids, matched through the engine's suffix
and the server route's prefix (``request_names``).

Two ways to record. Colocated, the engine brackets each truncated ``generate`` with ``begin_supports`` /
``take_supports``: every row in between is one of its requests. A server (``parityrl serve``; the worker extension
in ``server_transfer``) serves whatever arrives, truncated or not, and nobody brackets its batches: it records from
the moment a trainer connects (``serve_supports``), and only the rows of requests whose own sampling parameters
truncate (``truncates``); an untruncated request keeps the whole vocabulary, which would be a full-vocabulary set
per token for nothing. A trainer takes its requests' sets by id after each batch (``take_supports``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from rollout.support import Support
from rollout.vllm_plugins.route_capture import request_names

__all__ = ["SupportRecorder", "begin_supports", "install_support_capture", "serve_supports", "take_supports",
           "truncates"]

ATTR = "_parityrl_supports"


class SupportRecorder:
    """Per request, the kept set of every token sampled since ``reset``: one record per sampling step."""

    def __init__(self) -> None:
        self.active = False  # recording: between ``begin_supports`` and ``take_supports`` (a truncated generate)
        self.select: Callable[[str], bool] | None = None  # a server: which requests' rows to record (None: all)
        self.reset()

    def reset(self) -> None:
        self.index: dict[str, int] = {}  # the engine's request id -> its number in the records
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (request numbers, counts, ids)

    def capture(self, req_ids: Sequence[str], logprobs: torch.Tensor | None) -> None:
        if not self.active:  # a call without truncation (the probe's scoring): nothing to record
            return
        if self.select is not None:
            rows = [i for i, r in enumerate(req_ids) if self.select(r)]
            if not rows:
                return
            if logprobs is not None and logprobs.shape[0] == len(req_ids) and len(rows) < len(req_ids):
                logprobs, req_ids = logprobs[rows], [req_ids[i] for i in rows]
        if logprobs is None:
            raise RuntimeError("sampling supports: the sampler returned no processed log-probs (a request without "
                               "logprobs, or logprobs_mode other than processed_logprobs)")
        if logprobs.shape[0] != len(req_ids):
            raise RuntimeError(f"sampling supports: the sampler returned {logprobs.shape[0]} rows for a step of "
                               f"{len(req_ids)} requests; the capture maps one row to each request (chunked prefill "
                               "and speculative decoding must be off)")
        keep = torch.isfinite(logprobs)
        rows, ids = keep.nonzero(as_tuple=True)  # row-major: each row's ids in vocabulary order
        numbers = torch.tensor([self.index.setdefault(r, len(self.index)) for r in req_ids], dtype=torch.long)
        self.records.append((numbers, keep.sum(1).to("cpu", torch.long), ids.to("cpu", torch.int32)))

    def take(self, requests: Sequence[tuple[str, int]]) -> list[Support]:
        """The kept sets of each (caller's request id, completion length), in order; those requests' records are
        forgotten afterwards. A request with another number of captured steps than its length is an error."""
        if not self.records:
            raise RuntimeError("sampling supports: nothing was captured for this batch")
        req = torch.cat([r[0] for r in self.records])
        counts = torch.cat([r[1] for r in self.records])
        ids = torch.cat([r[2] for r in self.records])
        starts = counts.cumsum(0) - counts
        order = torch.sort(req, stable=True).indices  # stable: each request's steps stay in order
        req_o, counts_o, starts_o = req[order], counts[order], starts[order]
        # every kept id of the reordered rows, gathered at once
        within = torch.arange(int(counts_o.sum())) - torch.repeat_interleave(counts_o.cumsum(0) - counts_o, counts_o)
        ids_o = ids[torch.repeat_interleave(starts_o, counts_o) + within]
        row_ends = torch.bincount(req_o, minlength=len(self.index)).cumsum(0).tolist()
        id_ends = counts_o.cumsum(0)
        names = request_names(self.index)
        out, taken = [], []
        for rid, n in requests:
            number = names.get(rid)
            if number is None:
                raise RuntimeError(f"sampling supports: none captured for request {rid!r}")
            lo, hi = (row_ends[number - 1] if number else 0), row_ends[number]
            if hi - lo != n:
                raise RuntimeError(f"sampling supports: request {rid!r} sampled {n} tokens but {hi - lo} steps were "
                                   "captured")
            a = int(id_ends[lo - 1]) if lo else 0
            offsets = torch.zeros(n + 1, dtype=torch.long)
            offsets[1:] = counts_o[lo:hi].cumsum(0)
            out.append(Support(ids_o[a:a + int(offsets[-1])].clone(), offsets))
            taken.append(number)
        keep = ~torch.isin(req, torch.tensor(taken, dtype=torch.long))
        if bool(keep.any()):
            row_keep = torch.repeat_interleave(keep, counts)
            self.records = [(req[keep], counts[keep], ids[row_keep])]
        else:
            self.records = []
        return out


def _runner(worker):
    return getattr(worker, "worker", worker).model_runner


def install_support_capture(worker) -> None:
    """Wrap the worker's sampler once so that every sampling step's kept sets are recorded (V1 runner only)."""
    runner = _runner(worker)
    if getattr(runner, ATTR, None) is not None:
        return
    sampler = getattr(runner, "sampler", None)
    if sampler is None or not hasattr(runner, "input_batch") or not hasattr(sampler, "sample"):
        raise ValueError(f"sampling supports: vLLM's {type(runner).__module__}.{type(runner).__name__} has no V1 "
                         "sampler to capture from (on Model Runner V2, vLLM's own return_sampling_mask gives them)")
    recorder = SupportRecorder()
    sample = sampler.sample

    def recorded_sample(logits, sampling_metadata, *args, **kwargs):
        sampled, processed = sample(logits, sampling_metadata, *args, **kwargs)
        n = runner.input_batch.num_reqs
        recorder.capture(list(runner.input_batch.req_ids[:n]), processed)
        return sampled, processed

    sampler.sample = recorded_sample
    setattr(runner, ATTR, recorder)


def truncates(params, vocab_size: int) -> bool:
    """Whether vLLM samples a request with these ``SamplingParams`` from a truncated set: top-p below 1, top-k
    between 1 and the vocabulary (``gpu_input_batch.add_request``'s rule), or min-p."""
    return params is not None and (params.top_p < 1 or 0 < params.top_k < vocab_size or params.min_p > 0)


def serve_supports(worker, reset: bool = True) -> None:
    """A server's capture: record the kept sets of every truncated request from now on, whoever sent it; a trainer
    takes its own by request id. ``reset``: forget what earlier trainers left untaken (the first rank of a run
    connecting; the other ranks connect later and must not drop its requests)."""
    install_support_capture(worker)
    runner = _runner(worker)
    recorder = getattr(runner, ATTR)
    vocab = int(runner.input_batch.vocab_size)

    def select(req_id: str) -> bool:
        state = runner.requests.get(req_id)
        return state is not None and truncates(state.sampling_params, vocab)

    if reset or recorder.select is None:
        recorder.reset()
    recorder.select = select
    recorder.active = True


def begin_supports(worker) -> None:
    """A batch of truncated requests starts: record from now on, having forgotten everything before."""
    install_support_capture(worker)
    recorder = getattr(_runner(worker), ATTR)
    recorder.reset()
    recorder.active = True


def take_supports(worker, requests: Sequence[tuple[str, int]]) -> list[Support]:
    """The kept sets of the given (request id, completion length) pairs, in order; recording stops."""
    recorder = getattr(_runner(worker), ATTR, None)
    if recorder is None:
        raise RuntimeError("sampling supports: the capture is not installed (begin_supports)")
    recorder.active = recorder.select is not None  # a server keeps recording for the next batch
    return recorder.take(requests)
