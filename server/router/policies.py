"""How the router picks a server of a pool (``--router-policy``).

- ``load``: the least loaded (``load_score``: the requests a server holds, those of them still
  waiting for their first token counted four times, and its KV usage).
- ``round-robin``: the baseline.
- ``prefix``: prefix affinity. A request goes to a server that took a request with the same
  prompt prefix, as long as that server is not much busier than the least loaded one. A server's
  prefix cache holds the prompts it served recently, so a conversation's next turn, or another
  request behind the same long system prompt, skips most of its prefill there (and, on a decode
  server, most of its KV transfer). The router does not tokenize: it cuts the prompt's text into
  chunks of ``CHUNK_CHARS`` characters and chains their hashes, the way servers chain their KV
  blocks' hashes, so one hash names one prefix, and remembers in a bounded LRU table which
  servers each prefix went to (the latest ``MAX_HOLDERS`` of them). Among the servers whose load
  score is within ``SLACK`` of the least loaded one it picks, of those that took the longest
  matching prefix, the least loaded; with no match, the least loaded. Past the slack load wins:
  a hot prefix spreads once its server queues, and a prefix every server has taken (a system
  prompt all requests share) leaves the choice to the next, rarer one, or to load.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from llmfleet.server.router.load import UNSTARTED_WEIGHT, Server

Policy = Callable[["list[Server]", Sequence[int]], "Server"]  # candidates, the prompt's prefix hashes

CHUNK_CHARS = 128  # about 30-60 tokens: a few KV blocks
MAX_PREFIXES = 100_000  # remembered prefix hashes: about 33 MB, some 125 prompts of 100k characters
SLACK = 2 * (1 + UNSTARTED_WEIGHT)  # load score units: two requests yet to start
# servers remembered per prefix, the most recent takers: pods come and go (new addresses) under
# autoscaling, and a prefix every request shares would otherwise list every pod that ever ran
MAX_HOLDERS = 64


def least_loaded(candidates: list[Server], prefixes: Sequence[int] = ()) -> Server:
    return min(candidates, key=lambda s: (s.score, s.assigned, s.url))


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, candidates: list[Server], prefixes: Sequence[int] = ()) -> Server:
        ordered = sorted(candidates, key=lambda s: s.url)
        return ordered[next(self._turn) % len(ordered)]


def prompt_text(body: dict[str, Any]) -> str:
    """The text a server's prompt starts from: tools and messages in order for chat, the prompt
    for completions (the first one of a batch). Serialized JSON keeps a longer conversation's text
    an extension of a shorter one's up to the last message."""
    if "messages" in body:
        return json.dumps([body.get("tools"), *(body.get("messages") or [])], sort_keys=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt decides
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_hashes(body: dict[str, Any]) -> list[int]:
    """The chained hashes of the prompt's whole chunks: the i-th names its first i + 1 chunks."""
    text = prompt_text(body)
    return chained_hashes(
        text[start : start + CHUNK_CHARS] for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS)
    )


def chained_hashes(parts: Iterable[Hashable]) -> list[int]:
    """One hash per prefix of ``parts``: the i-th names its first i + 1 parts, as servers chain
    their KV blocks' hashes (the simulator chains a trace's content block ids the same way)."""
    hashes, parent = [], 0
    for part in parts:
        parent = hash((parent, part))
        hashes.append(parent)
    return hashes


class PrefixAffinity:
    """The policy: of the servers within the slack, the least loaded that took the longest prefix
    of this prompt."""

    def __init__(self, slack: float = SLACK, max_prefixes: int = MAX_PREFIXES) -> None:
        self.slack = slack
        self.max_prefixes = max_prefixes
        # prefix hash -> the urls that took it (a dict as an ordered set), least recent prefix first
        self._servers_of: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __call__(self, candidates: list[Server], prefixes: Sequence[int] = ()) -> Server:
        chosen = least_loaded(candidates)
        within = {s.url: s for s in candidates if s.score <= chosen.score + self.slack}
        for prefix in reversed(prefixes):  # the longest prefix first
            holders = [within[url] for url in self._servers_of.get(prefix, ()) if url in within]
            if holders:
                chosen = least_loaded(holders)
                break
        self._remember(prefixes, chosen.url)
        return chosen

    def _remember(self, prefixes: Sequence[int], url: str) -> None:
        for prefix in prefixes:
            holders = self._servers_of.setdefault(prefix, {})
            holders.pop(url, None)  # the most recent taker last
            holders[url] = None
            if len(holders) > MAX_HOLDERS:
                del holders[next(iter(holders))]
            self._servers_of.move_to_end(prefix)
        while len(self._servers_of) > self.max_prefixes:
            self._servers_of.popitem(last=False)


POLICIES: dict[str, Callable[[], Policy]] = {
    "load": lambda: least_loaded,
    "round-robin": RoundRobin,
    "prefix": PrefixAffinity,
}
