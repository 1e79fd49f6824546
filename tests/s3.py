"""An S3 API on loopback for tests: moto's server in a thread of the test process, one bucket, and the environment
that points boto (s3fs) and LanceDB (its object_store) at it; processes the tests start inherit it."""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
from collections.abc import Iterator

import pytest

from tests.ports import free_port

BUCKET = "lockstep-test"


def forget_s3_clients() -> None:
    """fsspec keeps one S3FileSystem per set of arguments, bound to the endpoint it first connected to: after the
    environment changes, the next `Lake` must make a new one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_store() -> Iterator[str]:
    """Yield `s3://BUCKET` of a fresh S3 server, the environment set for the duration."""
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ALLOW_HTTP": "true",  # LanceDB refuses a plain-http endpoint otherwise
    }
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):  # a developer's own, which
                # would take precedence (the last one over AWS_ENDPOINT_URL) or send other credentials
                mp.delenv(k, raising=False)
            for k in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
                mp.setenv(k, os.devnull)
            forget_s3_clients()
            # moto keeps its buckets in the process, not in the server: a second store in one process (pytest-xdist
            # can set a module's fixture up twice in a worker) would find the first one's bucket and its objects
            urllib.request.urlopen(urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST"))
            import fsspec

            fsspec.filesystem("s3").mkdir(BUCKET)
            yield f"s3://{BUCKET}"
    finally:
        forget_s3_clients()
        server.stop()
        werkzeug.setLevel(level)
