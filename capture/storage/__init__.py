"""What is kept: sessions in memory and their journals (``sessions``, ``journal_lines``, the
batched fsync ``journal_sync``), a call's record (``records``), the rows a session is written as
(``rows``), Parquet shards (``shards``), late rewards (``rewards``), and reading them back for a
trainer (``reader``; ``capture.reader`` is the same, kept for users).

May import: ``capture.trajectory``, ``rewriter``. Nothing above it (no HTTP)."""
