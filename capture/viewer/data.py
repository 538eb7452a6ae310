"""What the trajectory viewer shows, as plain data, gathered in one namespace for
``capture.viewer.http`` (no HTTP here).

Sessions (``session_list``: the list, sorted, filtered, paged; ``run``: per step, per group) ->
the tree of their thread rows and their calls (``tree``) -> one row's tokens, decoded, with loss
mask, provenance and logprobs (``tokens``) -> the diff of two calls of one conversation
(``diff``). Rows come from a ``RowSource`` (``sources``: ``ShardSource`` reads an output
folder's shards; the proxy adds its live sessions' unwritten rows,
``capture.viewer.http.LiveSource``). A row's reward and weight versions are read by
``capture.storage.row_rules``.
"""

from __future__ import annotations

from capture.viewer.diff import DIFF_CONTEXT_TOKENS, diff_calls
from capture.viewer.run import (
    RUN_BY,
    group_list,
    group_view,
    run_by_default,
    run_summary,
    trainer_step_times,
)
from capture.viewer.session_list import (
    DEFAULT_PAGE,
    MAX_PAGE,
    SESSION_FIELDS,
    default_sort,
    metadata_keys,
    query_sessions,
    reward_of,
    session_list,
    session_value,
)
from capture.viewer.sources import RowSource, ShardSource
from capture.viewer.tokens import (
    MAX_PAGE_TOKENS,
    PAGE_TOKENS,
    PROVENANCE,
    STRIP_POINTS,
    Decode,
    entropy,
    ids_only,
    load_decoder,
    logprob_strip,
    row_overview,
    token_page,
    tokenizer_decoder,
)
from capture.viewer.tree import (
    call_list,
    first_trained,
    row_node,
    row_tree,
    tool_calls,
    versions_in,
)

__all__ = [
    "DEFAULT_PAGE",
    "DIFF_CONTEXT_TOKENS",
    "MAX_PAGE",
    "MAX_PAGE_TOKENS",
    "PAGE_TOKENS",
    "PROVENANCE",
    "RUN_BY",
    "SESSION_FIELDS",
    "STRIP_POINTS",
    "Decode",
    "RowSource",
    "ShardSource",
    "call_list",
    "default_sort",
    "diff_calls",
    "entropy",
    "first_trained",
    "group_list",
    "group_view",
    "ids_only",
    "load_decoder",
    "logprob_strip",
    "metadata_keys",
    "query_sessions",
    "reward_of",
    "row_node",
    "row_overview",
    "row_tree",
    "run_by_default",
    "run_summary",
    "session_list",
    "session_value",
    "token_page",
    "tokenizer_decoder",
    "tool_calls",
    "trainer_step_times",
    "versions_in",
]
