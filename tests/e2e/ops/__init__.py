"""Running it: call and verbose logs, shards and their recovery, flush races, the viewer in a
browser, the docs' snippets, passthrough traffic."""
