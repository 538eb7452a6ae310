"""``python -m capture.startup --policy-url URL --tokenizer DIR``, as scripts/run_proxy.sh runs
it: the start-up check of ``capture.policy.startup``."""

from capture.policy.startup import main

if __name__ == "__main__":
    raise SystemExit(main())
