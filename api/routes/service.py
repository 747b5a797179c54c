"""The service's own routes, outside `/v1alpha1/inference` and without a token: `GET /healthz`,
and `GET /metrics`, the API's Prometheus metrics (api/metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from api import metrics as api_metrics

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    body, content_type = api_metrics.exposition()
    return Response(body, media_type=content_type)
