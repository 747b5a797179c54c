"""What the dynamo stack's tests share (tests/dynamo/conftest.py makes the stack and deployment)."""

REPLICAS = 2  # the deployment's replicas: two Dynamo workers
DYNAMO_PREFIX = "dynamo-hl"  # its hot-load path prefix in the bucket
