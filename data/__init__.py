"""FineWeb shards: download, the .bin format, text-to-shard tokenizer, the per-rank loader."""
