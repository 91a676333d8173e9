"""Per-model statistics as Triton's statistics extension reports them (KServe ModelStatistics), kept
by the supervisor from every front's finished requests, whichever API they came through.

A request's time is cut where the pod hands it on: `compute_input` the front's admission (checks,
tokenization) until the request goes to the engine, `queue` until the first engine step that computed
any of it began, `compute_infer` until its last token reached the front, `compute_output` until its
response was complete. A successful request adds to all four and to `success`; a failed one (refused
at admission, past its deadline, cancelled by its client, the engine gone) only to `fail`, as Triton
counts failures. Each request is one inference and one execution: the engine batches per step, not
per request, so Triton's "inferences per execution" is 1.
"""

from __future__ import annotations

from .. import contract as c

NOT_SERVED_HERE = "NOT_FOUND"  # a request that named another model is no request on this one


def _add(duration: c.Duration, seconds: float | None) -> None:
    duration.count += 1
    duration.ns += max(0, round((seconds or 0.0) * 1e9))


class ModelStatistics:
    """Every model's statistics since the pod started (one model: the served one)."""

    def __init__(self) -> None:
        self._models: dict[str, c.ModelStats] = {}

    def record(self, request: c.RequestRecord) -> None:
        if not request.model or request.error == NOT_SERVED_HERE:  # before the model loaded, or not ours
            return
        stats = self._models.get(request.model)
        if stats is None:
            stats = self._models[request.model] = c.ModelStats(request.model)
        stats.last_inference_ms = max(stats.last_inference_ms, int(request.ended * 1000))
        if request.error is not None:
            _add(stats.fail, request.duration)
            return
        _add(stats.success, request.duration)
        _add(stats.compute_input, request.compute_input)
        _add(stats.queue, request.queue)
        _add(stats.compute_infer, request.compute_infer)
        _add(stats.compute_output, request.compute_output)
        stats.inference_count += 1
        stats.execution_count += 1

    def models(self) -> list[c.ModelStats]:
        return list(self._models.values())
