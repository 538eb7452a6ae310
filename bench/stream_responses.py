"""``mitmdump -s bench/stream_responses.py``: relay every response as it comes, chunk by chunk.

Plain mitmdump holds each response whole before sending it on, an SSE stream included (the
client gets it all at once, when it has ended). ``stream_large_bodies`` would stream responses
too, but it streams requests as well, and a streamed request is sent on before ``map_remote``
rewrites its destination. bench/overhead.py's ``mitmdump-s`` path loads this.
"""

from mitmproxy import http


def responseheaders(flow: http.HTTPFlow) -> None:
    if flow.response is not None:
        flow.response.stream = True
