"""A server's /metrics as the tests read it: Prometheus text parsed by prometheus-client."""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict, float]]]


def scrape(url: str) -> Samples:
    """Prometheus text from `url`: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` with `labels` (its other labels any)."""
    matching = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matching) == 1, f"{name}{labels}: {samples.get(name)}"
    return matching[0]


def value_or_zero(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` with `labels`, or 0 where the series is not there yet."""
    matching = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matching) <= 1, f"{name}{labels}: {samples.get(name)}"
    return matching[0] if matching else 0.0


def grown(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much a counter grew from one scrape to a later one, which must have it (a series the
    earlier scrape did not have yet grew from 0)."""
    return value(after, name, **labels) - value_or_zero(before, name, **labels)


def scrape_when(url: str, done: Callable[[Samples], bool], timeout_s: float = 30.0) -> Samples:
    """The first scrape of `url` that is `done` (the last one after `timeout_s`): a server's
    supervisor records what its engine and fronts report on a thread of its own, a moment after the
    clients have their answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
