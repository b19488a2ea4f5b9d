"""One request's fault stays that request's: per-request isolation inside an engine step.

A step runs one batched forward for every scheduled sequence, then per-request work: logits edits (``min_tokens``,
logits processors such as a grammar, penalties), sampling, appending the token (a grammar accepts it), forking
``n > 1`` choices, stop checks and the outputs (detokenized text once a request ends). Before, an exception in any of
that for one sequence left the step and failed the whole batch. Now :meth:`engine.llm_engine.LLMEngine.step` ends
only that request -- every choice finished with ``finish_reason "error"``, its blocks freed, its id and reason in
``LLMEngine.failed`` for the owner to report -- and the rest of the batch goes on unchanged:

* logits edits run once for the batch (the common case costs nothing extra); when they raise, the rows they touch
  are put back and the edits run again row by row (:func:`edit_rows`), so only the rows whose own edit raises fail;
* a row whose logits are NaN, or all ``-inf`` (nothing may be sampled, e.g. a grammar that allows no token), fails
  with :class:`NonFiniteLogitsError` (:func:`non_finite_rows`; one reduction over the batch's logits);
* sampling and everything after it run per row already; each row's failure is caught there.

The batched forward itself (and the KV export its owner hooks into it) is not per request: an exception there is the
owner's to handle (the worker actors fail what was in flight). :attr:`engine.hooks.EngineHooks.request_fault`
injects faults at each per-request stage, for tests and fault drills.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.errors import DuetError

if TYPE_CHECKING:
    from engine.sequence import Sequence

STAGES = ("logits", "sample", "append", "output", "export")  # where EngineHooks.request_fault is called


class RequestFailedError(DuetError):
    """One request's part of an engine step raised (logits processing, sampling, its grammar, detokenizing) or its
    logits were not finite: that request ended with ``finish_reason "error"``; the rest of its batch went on. Not
    retryable: the same request would meet the same fault on another worker."""

    code = "request_failed"


class NonFiniteLogitsError(RequestFailedError):
    """A request's logits were NaN, or ``-inf`` everywhere (no token may be sampled), when it was to sample."""

    code = "non_finite_logits"


def describe(e: BaseException) -> str:
    """One line for logs, reports and the client's message."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def edit_rows(logits: torch.Tensor, seqs: list[Sequence], edit: Callable[[torch.Tensor, list[Sequence]], None],
              touched: list[int], faults: dict[int, BaseException]) -> None:
    """``edit(logits, seqs)`` in place, once for the batch. ``touched``: the rows it may change. When it raises, those
    rows get their logits back and ``edit`` runs again on each row alone (``logits[r:r+1]``, ``[seqs[r]]``): a row
    whose own edit raises goes to ``faults`` (row -> exception), the others end up as the batched call leaves them."""
    if not touched:
        return
    saved = logits[touched].clone()
    try:
        edit(logits, seqs)
        return
    except Exception:  # noqa: BLE001 - find the rows at fault below
        logits[touched] = saved
    for i, r in enumerate(touched):
        try:
            edit(logits[r:r + 1], [seqs[r]])
        except Exception as e:  # noqa: BLE001 - this row's fault
            logits[r] = saved[i]
            faults[r] = e


def non_finite_rows(logits: torch.Tensor, faults: dict[int, BaseException]) -> None:
    """Rows of ``logits`` ``[S, V]`` that cannot be sampled from (NaN anywhere, or ``-inf`` everywhere) go to
    ``faults`` as :class:`NonFiniteLogitsError`."""
    if logits.numel() == 0:
        return
    top = logits.amax(dim=-1)  # NaN anywhere in a row makes its max NaN
    bad = torch.isnan(top) | torch.isneginf(top)
    if bool(bad.any()):
        for r in bad.nonzero().flatten().tolist():
            if r not in faults:
                what = "NaN" if bool(torch.isnan(top[r])) else "-inf for every token"
                faults[r] = NonFiniteLogitsError(f"its logits were {what}")
