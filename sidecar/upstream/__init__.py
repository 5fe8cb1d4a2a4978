"""The upstream HTTP/1.1 client: a pooled keep-alive client over asyncio protocols.

aiohttp's ClientSession is not used on the hot path: it silently resends an idempotent request
once on a stale keep-alive connection (so the upstream sees two requests for one attempt), adds
headers, decompresses, and costs most of a proxy's CPU. This client sends exactly the bytes it is
given, once, and maps every failure to the project's own error types (``errors``).
"""
