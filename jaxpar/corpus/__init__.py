"""The corpus: documents read and tokenized (`documents`), conversations rendered through chat
templates (`chat`), prepared token shards written, read and verified (`shards`), and the batches
a run reads (`data`: packing, mixtures, grain's order). Plain host code; no model, no mesh."""
