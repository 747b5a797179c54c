"""The API's routes, one `APIRouter` per resource (api/app.py mounts them): gateways, deployments
and hot-loads under `/v1alpha1/inference` (api/auth.py's `PREFIX`), and the service's own
`/healthz` and `/metrics` outside it."""
