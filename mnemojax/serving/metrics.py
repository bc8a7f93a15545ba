"""The server's Prometheus metrics (`GET /metrics`), named like vLLM's with a `mnemojax_` prefix.

Latency histograms are observed when a request finishes, from the engine's own timestamps. A beam search counts
as its choices, each a request finished at the search's end; the engine requests of its steps are not counted.
Gauges (running and waiting requests, KV pages) and the preemption and step-failure counters are read at scrape
time from the engine thread's published snapshot (`AsyncLLM.stats()`), so a scrape never touches the engine.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mnemojax.scheduling.outputs import CompletionOutput, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TBT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from the engine thread's snapshot at scrape time."""

    def __init__(self, stats):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for name, doc, value in (
                ("mnemojax_num_requests_running", "Requests admitted to the engine (holding KV pages).", s.running),
                ("mnemojax_num_requests_waiting", "Requests queued for admission, preempted ones included.",
                 s.waiting),
                ("mnemojax_kv_pages_used", "KV-cache pages held by requests, over all KVP ranks.", s.kv_pages_used),
                ("mnemojax_kv_pages_total", "KV-cache pages requests may hold, over all KVP ranks.",
                 s.kv_pages_total)):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("mnemojax_num_preemptions", "Requests preempted by recompute (out of KV pages, "
                                  "or after a failed step).", value=s.preemptions)
        yield CounterMetricFamily("mnemojax_num_step_failures", "Engine steps that failed and were recovered from "
                                  "(their running requests computed again).", value=s.step_failures)
        yield CounterMetricFamily("mnemojax_prefix_cache_queries", "Tokens of admitted requests that looked up the "
                                  "prefix cache.", value=s.prefix_cache_queries)
        yield CounterMetricFamily("mnemojax_prefix_cache_hits", "Tokens found in the prefix cache (not computed).",
                                  value=s.prefix_cache_hits)
        if s.step_time_prediction_error is not None:  # only with online calibration (target_batch_time_ms)
            yield GaugeMetricFamily(
                "mnemojax_step_time_prediction_error", "Median |predicted / measured - 1| of the runtime predictor "
                "over the last 64 measured steps, each predicted before it was fitted.",
                value=s.step_time_prediction_error)


class ServerMetrics:
    def __init__(self, stats, served_model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        labels = ["model_name"]
        self._label = {"model_name": served_model_name}
        self.ttft = Histogram("mnemojax_time_to_first_token_seconds", "Time to first token (engine arrival to the "
                              "first generated token).", labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.tbt = Histogram("mnemojax_time_per_output_token_seconds", "Time between consecutive generated tokens.",
                             labels, buckets=TBT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("mnemojax_e2e_request_latency_seconds", "Engine arrival to the last token.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("mnemojax_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("mnemojax_generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=self.registry)
        self.finished = Counter("mnemojax_request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.http_errors = Counter("mnemojax_http_errors", "Error responses by HTTP status.", labels + ["status"],
                                   registry=self.registry)
        self.beam_steps: set[str] = set()
        """The engine requests of beam searches' steps in flight (a beam's tokens as the prompt, one token out):
        not counted as requests; each search's choices are, at its end (`observe_search`)."""

    def observe_finished(self, out: RequestOutput) -> None:
        if out.request_id in self.beam_steps:
            return
        m, c = out.metrics, out.outputs[0]
        if m.ttft is not None:
            self.ttft.labels(**self._label).observe(m.ttft)
        for gap in m.tbt:
            self.tbt.labels(**self._label).observe(gap)
        self._finished(len(out.prompt_token_ids), c, None if m.finished_time is None
                       else m.finished_time - m.arrival_time)

    def observe_search(self, prompt_tokens: int, outputs: list[CompletionOutput], seconds: float) -> None:
        """A beam search's end: each of its choices (`outputs`) a finished request of `prompt_tokens` prompt tokens
        and its own generated ones, `seconds` long end to end (the search's; no TTFT or TBT: the tokens of a
        choice are known only at the end)."""
        for c in outputs:
            self._finished(prompt_tokens, c, seconds)

    def _finished(self, prompt_tokens: int, c: CompletionOutput, e2e: float | None) -> None:
        if e2e is not None:
            self.e2e.labels(**self._label).observe(e2e)
        self.prompt_tokens.labels(**self._label).inc(prompt_tokens)
        self.generation_tokens.labels(**self._label).inc(len(c.token_ids))
        self.finished.labels(**self._label, finished_reason=str(c.finish_reason)).inc()

    def observe_error(self, status: int) -> None:
        self.http_errors.labels(**self._label, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
