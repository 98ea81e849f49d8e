"""The target forward over ragged rows and the KV cache it reads and writes."""
