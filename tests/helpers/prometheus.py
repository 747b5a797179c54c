"""Reading a Prometheus endpoint in tests: every sample, and a sum over matching labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus endpoint: (name, sorted labels) -> value."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, (url, r.status_code)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels` (0 if none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())
