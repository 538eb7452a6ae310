"""The policy servers a gateway talks to: which one answers a call, and the model names it lists.

Requested model names go to pools of vLLM servers (``agenttap_model_map``, fnmatch patterns;
unmatched names: ``agenttap_policy_url``); within a pool a session sticks to one server, so its
consecutive calls reuse that server's prefix cache. Each session's own model names are kept
(bounded) so that ``GET /v1/models`` lists the asker's names and never another session's.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import aiohttp

from rewriter.vllm_client import PolicyError, VLLMClient

# The policy connection failing mid-call (a read timeout, a dropped connection).
POLICY_FAILURES = (aiohttp.ClientError, TimeoutError)
# Bounds on the remembered model names: a client inventing names must not grow memory.
MAX_MODELS_PER_SESSION = 32
MAX_SESSIONS_WITH_MODELS = 10_000


def policy_failure(client: VLLMClient, exc: BaseException) -> PolicyError:
    """One of ``POLICY_FAILURES`` as the PolicyError its client is answered with."""
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return PolicyError(
            f"the policy server at {client.base_url} did not answer in time; "
            "option agenttap_policy_timeout"
        )
    return PolicyError(f"the connection to the policy server at {client.base_url} failed: {exc}")


class PolicyPools:
    """The policy servers by requested model name, over one shared HTTP connection pool."""

    def __init__(
        self,
        policy_urls: Sequence[str],
        model_map: Sequence[tuple[str, list[str]]],
        model_names: Sequence[str],
        timeout_s: float,
        max_connections: int,
    ) -> None:
        self.policy_urls = list(policy_urls)
        # (pattern, servers): the first pattern a requested name matches picks its servers.
        self.model_map = list(model_map)
        self.configured_names = list(model_names)
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None
        self._clients: dict[str, VLLMClient] = {}
        # Model names each session asked for (GET /v1/models lists the asker's own), bounded.
        self._session_models: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def open(self, decode: Callable[[list[int]], str]) -> None:
        """Create the HTTP connection pool and one client per server (in the running loop)."""
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout_s),
        )
        urls = list(self.policy_urls)
        for _, servers in self.model_map:
            urls += servers
        # The policy timeout bounds time without a new token, not without a byte (keep-alives).
        self._clients = {
            url: VLLMClient(url, self._http, decode=decode, progress_timeout_s=self.timeout_s)
            for url in dict.fromkeys(urls)
        }

    async def close(self) -> None:
        if self._http:
            await self._http.close()

    def pool_for(self, model: str) -> list[VLLMClient]:
        for pattern, servers in self.model_map:
            if fnmatch.fnmatchcase(model, pattern):
                return [self._clients[u] for u in servers]
        return [self._clients[u] for u in self.policy_urls]

    def client_for(self, session_id: str, model: str = "") -> VLLMClient:
        pool = self.pool_for(model)
        # Sticky per session: a scaffold's consecutive calls reuse one server's prefix cache.
        return pool[zlib.crc32(session_id.encode()) % len(pool)]

    def model_names(self, served: str, session_id: str = "") -> list[str]:
        """Names clients may ask for: every one maps to a policy (``model_map``). Besides the
        configured ones, only the asking session's own names: never another session's."""
        own = list(self._session_models.get(session_id, ())) if session_id else []
        names = [served, *self.configured_names, *own]
        names += [p for p, _ in self.model_map if not any(c in p for c in "*?[")]
        return list(dict.fromkeys(n for n in names if n))

    def remember_model(self, session_id: str, model: str) -> None:
        """Note a name a session asked for; the least recently used go past the bounds."""
        models = self._session_models.pop(session_id, None) or OrderedDict()
        models.pop(model, None)
        models[model] = None
        while len(models) > MAX_MODELS_PER_SESSION:
            models.popitem(last=False)
        self._session_models[session_id] = models
        while len(self._session_models) > MAX_SESSIONS_WITH_MODELS:
            self._session_models.popitem(last=False)
