"""What is kept: sessions in memory and their journals (``sessions``; the journal file, its
name, a durable line and its reading back in ``journal_files``, the lines' encoding in
``journal_lines``, the batched fsync in ``journal_sync``), what was written per session
(``written``), a call's record (``records``), the rows a session is written as (``rows``),
Parquet shards (``shards``), late rewards (``rewards``) and taking them back (``take_back``), a
row's rules (``row_rules``: its reward, its weight versions and their order), and reading them
back for a trainer (``reader``, which gathers ``out_folder``, ``unverified`` and ``batches``;
``capture.reader`` is the same, kept for users).

May import: ``capture.trajectory``, ``rewriter``. Nothing above it (no HTTP)."""
