"""What is kept: sessions in memory and their journals (``sessions``; the journal file, its
name, a durable line and its reading back in ``journal_files``, the lines' encoding in
``journal_lines``, the batched fsync in ``journal_sync``), what was written per session
(``written``), a call's record (``records``), the rows a session is written as (``rows``),
Parquet shards (``shards``), late rewards (``rewards``) and taking them back (``take_back``), a
row's rules (``row_rules``: its reward, its weight versions and their order), and reading them
back for a trainer (``reader``, which gathers ``out_folder``, ``unverified`` and ``batches``;
``capture.reader`` is the same, kept for users)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.trajectory",
    "rewriter",  # nothing above it: no HTTP
)
