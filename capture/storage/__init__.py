"""What is kept: sessions in memory and their journals (``sessions``, ``journal_lines``), a
call's record (``records``), Parquet shards (``shards``), late rewards (``rewards``), and reading
them back for a trainer (``reader``; ``capture.reader`` is the same, kept for users).

May import: ``capture.trajectory``, ``rewriter``. Nothing above it (no HTTP)."""
