from tests.helpers.temporal_server import temporal_env  # noqa: F401 - the shared fixture
