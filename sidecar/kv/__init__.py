"""The paged KV cache: layer specs and page math, the block pool and batch layout, paged attention, quantised pages, the cache adapters a forward takes."""
