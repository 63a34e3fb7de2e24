#!/usr/bin/env python3
"""moto's S3 server, with conditional writes made atomic as S3's are.

Usage: `python moto_server.py -H HOST -p PORT` (the arguments of moto's own
`moto_server`). The test suite runs it (scripts/test.sh points MOTO_SERVER at
a wrapper that runs this file with the venv's Python).

Why: S3 decides `If-None-Match: *` and `If-Match` writes atomically; two
concurrent creators of one key get one 200 and one 412. Stock moto checks the
condition, then writes, in whichever of its server threads took the request,
with no lock between the two: under load two creators can both pass the check
and both be told they won (seen in CI: the conformance suite's eight racers
had two winners). That is moto's defect, not a property of the stores
weightcast targets, so this launcher serialises the requests that carry a
condition (PUT and POST with If-None-Match or If-Match; PutObject and
CompleteMultipartUpload) against each other. Unconditional requests run as
before, in parallel.
"""

import sys
import threading


def make_conditional_writes_atomic() -> None:
    """Patches moto's S3 key handler: conditional writes hold one lock."""
    from moto.s3 import responses

    lock = threading.Lock()
    key_response = responses.S3Response.key_response

    def key_response_atomic(self, request, full_url, headers):
        h = request.headers
        if request.method in ("PUT", "POST") and (h.get("If-None-Match") or h.get("If-Match")):
            with lock:
                return key_response(self, request, full_url, headers)
        return key_response(self, request, full_url, headers)

    responses.S3Response.key_response = key_response_atomic


def main(argv: list[str]) -> None:
    make_conditional_writes_atomic()
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
