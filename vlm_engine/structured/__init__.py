"""Structured output: constraint specs (`spec`), grammar compilation and per-request matchers
(`grammar`), finishing inside the token budget (`closing`), and tool calls (`tools`)."""
