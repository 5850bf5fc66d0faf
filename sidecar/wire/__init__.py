"""The wire: request bodies (codec), the vLLM v1 types (protocol), bounds by shape (limits), the exactly-once step ledger (steps)."""
