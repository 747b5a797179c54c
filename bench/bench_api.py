"""The benches' REST client: JSON calls to ``/v1alpha1/inference`` with the stack's admin token,
where any answer but 200 ends the bench (``SystemExit`` naming the call, its status and the
start of its body). Imported by the benches beside it (``bench/`` is on their ``sys.path``)."""

from __future__ import annotations

from typing import Any

import httpx

from common.settings import Settings


class Api:
    def __init__(self, settings: Settings, *, timeout: float = 120, excerpt: int = 500) -> None:
        self.http = httpx.Client(base_url=f"{settings.api_url}/v1alpha1/inference", timeout=timeout,
                                 headers={"Authorization": f"Bearer {settings.admin_token}"})
        self.excerpt = excerpt  # how much of a refused call's body the exit message shows

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code != 200:
            raise SystemExit(f"{method} {path}: {r.status_code} {r.text[:self.excerpt]}")
        return r.json()
