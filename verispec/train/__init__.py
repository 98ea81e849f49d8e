"""Draft training: draft heads learned from the target's own outputs, written in vLLM's checkpoint formats."""
