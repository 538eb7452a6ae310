"""The real agent CLIs and scaffolds (Claude Code, Codex, Gemini CLI, OpenCode, OpenHands,
mini-swe-agent, Harbor's Terminus) driven through the proxy."""
